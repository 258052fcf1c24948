"""Reductions of dicts and objects: reduce_dict / all_reduce_dict (a dict of tensors reduced in one
native collective, after one exchange that checks every rank has the same keys and shapes), and
reduce_object, all_reduce_object, scan and exscan (objects folded on a root in rank order)."""

from __future__ import annotations

import datetime
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._agreement import digest_of, odd_ones
from ._calls import CallSpec, Op
from ._errors import CollectiveError, CollectiveMismatchError
from ._ops import FoldError, fold_objects

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["dict_problem", "dict_signature", "fold_payload", "reduce_dict", "reduce_digest", "reduce_objects"]


def _work_dtype(values: Iterable[Any]) -> torch.dtype:
    """The dtype reduce_dict reduces in: int64 when every value is an integer or bool tensor (exact,
    as torch's all_reduce of integers is), complex128 when any is complex, else float64."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if any(v.is_complex() for v in tensors):
        return torch.complex128
    if tensors and not any(v.is_floating_point() for v in tensors):
        return torch.int64
    return torch.float64


def dict_problem(input_dict: Mapping[Any, Any]) -> tuple[list[Any], str | None]:
    """reduce_dict's keys in order, and what makes the dict unfit (every rank reports it), or None."""
    try:
        names = sorted(input_dict.keys())
    except TypeError as e:
        return list(input_dict.keys()), f"keys can't be sorted: {e}"
    for k in names:
        v = input_dict[k]
        if not isinstance(v, torch.Tensor):
            return names, f"value of {k!r} is a {type(v).__name__}, not a tensor"
    if len({input_dict[k].device for k in names}) > 1:
        return names, "values are on different devices"
    return names, None


def dict_signature(d: Mapping[Any, Any]) -> tuple[list[Any], list[tuple[int, ...]], torch.dtype]:
    """reduce_dict's sorted keys, each value's shape, and the dtype every rank reduces in."""
    names = sorted(d)
    return names, [tuple(torch.as_tensor(d[k]).shape) for k in names], _work_dtype(d.values())


def reduce_digest(names: Sequence[Any], shapes: Sequence[tuple[int, ...]], work_dtype: torch.dtype) -> int:
    """The digest of reduce_dict's keys, shapes and reduce dtype, compared across ranks."""
    return digest_of([*zip(names, shapes, strict=True), ("reduce dtype", str(work_dtype))])


def reduce_dict(
    comm: Communicator, input_dict: Mapping[Any, torch.Tensor], average: bool, dst: int | None,
    timeout: float | datetime.timedelta | None,
) -> dict[Any, torch.Tensor]:
    comm._check_usable()
    if not isinstance(input_dict, Mapping):
        raise TypeError(f"reduce_dict needs a dict of tensors, got {type(input_dict).__name__}")
    if not isinstance(average, bool):
        raise TypeError(f"average must be a bool, got {type(average).__name__}")
    t = comm._op_timeout(timeout)
    op = Op.REDUCE_DICT if dst is not None else Op.ALL_REDUCE_DICT
    names, problem = dict_problem(input_dict)
    if comm._returns_at_once():
        if problem:
            raise comm._world_of_one_error(op, problem)
        return {k: input_dict[k] for k in names}
    # Every rank reduces in the same dtype whatever its values' dtypes (int64 for dicts of integers,
    # exact; else float64, exact for float32 and for integers below 2**53; complex128 when the dicts
    # hold complex values), and the digest that the first exchange compares covers the keys, their
    # shapes and that choice.
    shapes: list[tuple[int, ...]] = []
    work_dtype, digest = torch.float64, 0  # with a problem every rank raises before the digests count
    if problem is None:
        names, shapes, work_dtype = dict_signature(input_dict)
        digest = reduce_digest(names, shapes, work_dtype)
    # the dict rides along unserialized: the fake's scripted peers read it
    comm._run(CallSpec(op, -1 if dst is None else dst, input_dict, t, serialize=False, digest=digest, invalid=problem,
                       on_digest_mismatch=lambda: _key_mismatch(comm, names, shapes, work_dtype, t)))
    if not names:
        return {}
    with torch.no_grad():
        flat = [input_dict[k].detach().reshape(-1).to(work_dtype) for k in names]
        values = flat[0].clone() if len(flat) == 1 else torch.cat(flat)
        orig = values.device
        work = values.to(comm.device) if values.device != comm.device else values
        st = comm._stat(op)
        t0 = time.perf_counter()
        # what a ring reduction moves per rank: 2 (world - 1) / world of the values, each way
        moved = 2 * (comm.world_size - 1) * work.numel() * work.element_size() // comm.world_size
        comm._count(moved, moved)
        comm._reduce_tensor(work, dst, t)
        st.transfer_s += time.perf_counter() - t0
        if dst is not None and comm.rank != dst:
            return dict(input_dict)
        if average:  # (a sum of integers is divided as float64)
            work = work / comm.world_size if work.is_floating_point() or work.is_complex() else \
                work.to(torch.float64) / comm.world_size
        work = work.to(orig)
    out, at = {}, 0
    for k, shape in zip(names, shapes, strict=True):
        dt = input_dict[k].dtype
        n = math.prod(shape)
        v = work[at : at + n].reshape(shape)
        at += n
        # sums keep each value's dtype; averages of integers become the default float dtype
        keep = not average or dt.is_floating_point or dt.is_complex
        out[k] = v.to(dt if keep else torch.get_default_dtype())
    return out


def _key_mismatch(comm: Communicator, names: list[Any], shapes: list[tuple[int, ...]], work_dtype: torch.dtype,
                  timeout: float | None) -> None:
    infos = comm._run(CallSpec(Op.KEYS, -1, ([repr(k) for k in names], shapes, str(work_dtype)), timeout,
                               stat=Op.REDUCE_DICT))
    everyone = [keys for keys, _, _ in infos]
    kinds = [kind for _, _, kind in infos]
    if len(set(kinds)) > 1:
        described = {"torch.int64": "only integer or bool values (reduced exactly, in int64)",
                     "torch.float64": "floating point values (reduced in float64)",
                     "torch.complex128": "complex values (reduced in complex128)"}
        rows = "\n".join(f"  rank {r}: {described.get(kind, kind)}" for r, kind in enumerate(kinds))
        raise CollectiveMismatchError(
            f"reduce_dict: the ranks' dicts hold different kinds of values; every rank must pass the same "
            f"kinds (convert integers with .float() to reduce them with floats):\n{rows}", op="reduce_dict",
            ranks=odd_ones(kinds))
    union = sorted(set().union(*[set(ks) for ks in everyone]))
    lines = []
    for r, ks in enumerate(everyone):
        missing = [k for k in union if k not in ks]
        if missing:
            lines.append(f"  rank {r} lacks {', '.join(missing)}")
    if lines:
        raise CollectiveMismatchError(
            "reduce_dict: the ranks' dicts have different keys:\n" + "\n".join(lines),
            op="reduce_dict", ranks=[r for r, ks in enumerate(everyone) if set(ks) != set(union)],
        )
    table = [dict(zip(ks, map(tuple, shp), strict=True)) for ks, shp, _ in infos]
    odd_keys = [k for k in union if len({t[k] for t in table}) > 1]
    lines = [f"  {k}: " + ", ".join(f"rank {r} {t[k]}" for r, t in enumerate(table)) for k in odd_keys]
    raise CollectiveMismatchError(
        "reduce_dict: a key's tensors have different shapes on different ranks:\n" + "\n".join(lines),
        op="reduce_dict", ranks=odd_ones([[t[k] for k in odd_keys] for t in table]),
    )


def reduce_objects(comm: Communicator, op: Op, obj: Any, name: str, fn: Callable[[Any, Any], Any], root: int,
                    timeout: float | datetime.timedelta | None) -> Any:
    # The objects are gathered on the root, which folds them in rank order and sends each rank
    # its outcome: the result, or the fold's error so that every rank raises it.
    comm._check_usable()
    t = comm._op_timeout(timeout)
    if comm._returns_at_once():
        if op is Op.EXSCAN:
            return None
        return bool(obj) if name in ("any", "all") else obj  # the type a fold of two would give
    objs = comm._run(CallSpec(op, root, obj, t))
    prefix = op is Op.SCAN or op is Op.EXSCAN
    payload = fold_payload(op, objs, name, fn, root) if comm.rank == root else None
    mine = payload
    if op is Op.REDUCE_OBJECT and payload is not None and payload[0]:
        payload = (True, None)  # the others only need to know that it worked
    if prefix:
        outcome = comm._run(CallSpec(Op.RESULTS, root, payload, t, stat=op))[comm.rank]
    else:
        outcome = comm._run(CallSpec(Op.RESULT, root, payload, t, stat=op))[root]
        if comm.rank == root:
            outcome = mine
    ok, value = outcome
    if not ok:
        text, bad = value
        raise CollectiveError(text, op=op.label, ranks=[bad])
    return None if op is Op.REDUCE_OBJECT and comm.rank != root else value


def fold_payload(op: Op, objs: list[Any], name: str, fn: Callable[[Any, Any], Any], root: int) -> Any:
    """What the root of an object reduction sends: (ok, result), or per rank for prefix reductions."""
    prefix = op is Op.SCAN or op is Op.EXSCAN
    try:
        folded = fold_objects(objs, fn, prefixes=prefix)
    except FoldError as e:
        failure = (False, (f"{op.label}: op {name!r} failed on rank {root} combining rank {e.rank}'s object: {e}",
                           e.rank))
        return [failure] * len(objs) if prefix else failure
    if name in ("any", "all"):  # a bool even where nothing was folded (one rank)
        folded = [bool(v) for v in folded]
    if op is Op.SCAN:
        return [(True, v) for v in folded]
    if op is Op.EXSCAN:
        return [(True, None)] + [(True, v) for v in folded[:-1]]
    return (True, folded[0])
