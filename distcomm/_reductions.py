"""Reductions of dicts and objects: reduce_dict / all_reduce_dict (a dict of tensors reduced in one
native collective, after one exchange that checks every rank has the same keys and shapes; in small
worlds, a few values ride in that exchange and no native collective follows), and reduce_object,
all_reduce_object, scan and exscan (objects folded on a root in rank order)."""

from __future__ import annotations

import datetime
import math
import numbers
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._agreement import digest_of, odd_ones
from ._calls import CallSpec, Op
from ._errors import CollectiveError, CollectiveMismatchError
from ._ops import FoldError, ReduceOpLike, fold_objects, op_name
from ._tensors import carried_bytes, fold_rows

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["DICT_OPS", "as_tensors", "dict_op", "dict_problem", "dict_signature", "fold_payload", "reduce_dict",
           "reduce_digest", "reduce_objects", "work_tensor"]


def _work_dtype(values: Iterable[Any]) -> torch.dtype:
    """The dtype reduce_dict reduces in: int64 when every value is an integer or bool tensor (exact,
    as torch's all_reduce of integers is), complex128 when any is complex, else float64."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if any(v.is_complex() for v in tensors):
        return torch.complex128
    if tensors and not any(v.is_floating_point() for v in tensors):
        return torch.int64
    return torch.float64


DICT_OPS = ("sum", "mean", "max", "min")


def dict_op(average: bool, op: ReduceOpLike | None) -> str:
    """reduce_dict's reduction: ``op`` where given ("sum", "mean", "max", "min"), else by ``average``."""
    if op is None:
        if not isinstance(average, bool):
            raise TypeError(f"average must be a bool, got {type(average).__name__}")
        return "mean" if average else "sum"
    name = op_name(op)
    if name not in DICT_OPS:
        raise ValueError(f"op must be one of {', '.join(map(repr, DICT_OPS))} or torch's dist.ReduceOp SUM, AVG, "
                         f"MAX, MIN, got {op!r}")
    return name


def as_tensors(input_dict: Mapping[Any, Any]) -> Mapping[Any, Any]:
    """The dict with its Python numbers and numpy scalars as 0-d tensors (the ``loss.item()`` habit)."""
    if all(isinstance(v, torch.Tensor) for v in input_dict.values()):
        return input_dict
    return {k: _as_tensor(v) if _is_number(v) else v for k, v in input_dict.items()}


def _as_tensor(v: Any) -> Any:
    """A number as a 0-d tensor; one torch can't convert (2**63, a Decimal) as it is, for
    ``dict_problem`` to report in the slots, so that every rank raises, not this one alone."""
    try:
        return torch.as_tensor(v)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return v


def _is_number(v: Any) -> bool:
    return isinstance(v, (numbers.Number, np.generic)) and not isinstance(v, (str, bytes))


def dict_problem(input_dict: Mapping[Any, Any], op: str = "sum") -> tuple[list[Any], str | None]:
    """reduce_dict's keys in order, and what makes the dict unfit (every rank reports it), or None."""
    try:
        names = sorted(input_dict.keys())
    except TypeError as e:
        return list(input_dict.keys()), f"keys can't be sorted: {e}"
    for k in names:
        v = input_dict[k]
        if not isinstance(v, torch.Tensor):
            if _is_number(v):  # one that _as_tensor left as it was
                return names, f"value of {k!r} is a {type(v).__name__} torch can't convert to a tensor: {v!r}"
            return names, f"value of {k!r} is a {type(v).__name__}, not a tensor or a number"
        if op in ("max", "min") and v.is_complex():
            return names, f"op={op!r} is not defined for complex values ({k!r} is {v.dtype})"
    if len({input_dict[k].device for k in names}) > 1:
        return names, "values are on different devices"
    return names, None


def dict_signature(d: Mapping[Any, Any]) -> tuple[list[Any], list[tuple[int, ...]], torch.dtype, list[Any]]:
    """reduce_dict's sorted keys, each value's shape, the dtype every rank reduces in, and the keys
    whose values are uint64 where that dtype is int64 (their signedness: every rank must agree)."""
    names = sorted(d)
    work_dtype = _work_dtype(d.values())
    unsigned = [k for k in names if d[k].dtype == torch.uint64] if work_dtype == torch.int64 else []
    return names, [tuple(torch.as_tensor(d[k]).shape) for k in names], work_dtype, unsigned


def reduce_digest(names: Sequence[Any], shapes: Sequence[tuple[int, ...]], work_dtype: torch.dtype,
                  unsigned: Sequence[Any], op: str) -> int:
    """The digest of reduce_dict's keys, shapes, reduce dtype, uint64 keys and op, compared across ranks."""
    return digest_of([*zip(names, shapes, strict=True), ("reduce dtype", str(work_dtype)), ("uint64", list(unsigned)),
                      ("op", op)])


def reduce_dict(comm: Communicator, input_dict: Mapping[Any, Any], op: str, dst: int | None,
                timeout: float | datetime.timedelta | None) -> dict[Any, Any]:
    """reduce_dict (onto ``dst``) or all_reduce_dict (``dst`` None) with reduction ``op``."""
    comm._check_usable()
    if not isinstance(input_dict, Mapping):
        raise TypeError(f"reduce_dict needs a dict of tensors or numbers, got {type(input_dict).__name__}")
    t = comm._op_timeout(timeout)
    call = Op.REDUCE_DICT if dst is not None else Op.ALL_REDUCE_DICT
    input_dict = as_tensors(input_dict)
    names, problem = dict_problem(input_dict, op)
    if comm._returns_at_once():
        if problem:
            raise comm._world_of_one_error(call, problem)
        if op == "mean":  # an average of integers is a float at every world size
            return {k: _in_result_dtype(input_dict[k], op) for k in names}
        return {k: input_dict[k] for k in names}
    # Every rank reduces in the same dtype whatever its values' dtypes (int64 for dicts of integers,
    # exact; else float64, exact for float32 and for integers below 2**53; complex128 when the dicts
    # hold complex values), and the digest that the first exchange compares covers the keys, their
    # shapes, that choice, which keys are uint64 in int64 (read back by each rank with its own
    # signedness, a key uint64 on some ranks only would give the ranks different results) and the op.
    shapes: list[tuple[int, ...]] = []
    unsigned: list[Any] = []
    work_dtype, digest = torch.float64, 0  # with a problem every rank raises before the digests count
    if problem is None:
        names, shapes, work_dtype, unsigned = dict_signature(input_dict)
        digest = reduce_digest(names, shapes, work_dtype, unsigned, op)
    values = [input_dict[k] for k in names]
    work = carried = None
    if problem is None and names:
        with torch.no_grad():
            work = work_tensor(values, work_dtype, op).to(comm.device)
        carried = carried_bytes(comm, call, work, op)  # alike on every rank whose digest agrees
    # the dict rides along unserialized: the fake's scripted peers read it
    mismatch = lambda: _key_mismatch(comm, names, shapes, work_dtype, unsigned, op, t)  # noqa: E731 - error path
    rows = comm._run(CallSpec(call, -1 if dst is None else dst, input_dict, t, serialize=False, digest=digest,
                              problem=problem, on_digest_mismatch=mismatch, inline=carried,
                              carries=carried is not None))
    if work is None:  # no keys
        return {}
    if dst is not None and comm.rank != dst:  # reduce_dict off its root
        if carried is None:
            _reduce_natively(comm, call, work, op, dst, t)
        return dict(input_dict)
    with torch.no_grad():
        if carried is not None:
            fold_rows(rows, work, op)
        else:
            _reduce_natively(comm, call, work, op, dst, t)
        work = _finished(work, values, op, comm.world_size).to(values[0].device)
    out, at = {}, 0
    for k, shape in zip(names, shapes, strict=True):
        dt = input_dict[k].dtype
        n = math.prod(shape)
        v = work[at : at + n].reshape(shape)
        if v.is_complex() and not dt.is_complex:  # a real value of a dict that holds complex ones
            v = v.real
        at += n
        out[k] = _in_result_dtype(v, op, dt)
    return out


def _in_result_dtype(v: torch.Tensor, op: str, dt: torch.dtype | None = None) -> torch.Tensor:
    """``v`` in its input's dtype ``dt`` (default: its own), but an average of integers (or bools):
    the default float dtype, at every world size."""
    dt = v.dtype if dt is None else dt
    keep = op != "mean" or dt.is_floating_point or dt.is_complex
    return v.to(dt if keep else torch.get_default_dtype())


def _reduce_natively(comm: Communicator, call: Op, work: torch.Tensor, op: str, dst: int | None,
                     timeout: float | None) -> None:
    """``work`` (reduce_dict's values, flattened end to end) reduced across ranks in one native
    collective, in place (onto ``dst``, or every rank)."""
    st = comm._stat(call)
    t0 = time.perf_counter()
    comm._count(*comm._reduce_traffic(work, dst, op))
    if op in ("sum", "mean"):
        comm._reduce_tensor(work, dst, timeout)
    else:
        comm._tensor_reduce(work, dst, op, timeout)
    st.transfer_s += time.perf_counter() - t0


def _finished(work: torch.Tensor, values: list[torch.Tensor], op: str, world: int) -> torch.Tensor:
    """The reduced ``work`` as values again: uint64 top bits flipped back for max and min, a mean divided."""
    if work.dtype == torch.int64 and op in ("max", "min"):
        work = work_tensor([work], torch.int64, op, _unsigned_elements(values))  # the top bits flipped back
    if op == "mean":
        work = _mean_of_halves(work, world) if work.dtype == torch.int64 else work / world
    return work


def work_tensor(values: list[torch.Tensor], work_dtype: torch.dtype, op: str,
                unsigned: torch.Tensor | None = None) -> torch.Tensor:
    """What reduce_dict's collective reduces: the values flattened end to end in ``work_dtype``. In
    int64, where uint64 values wrap (2**63 and more read as negatives), for max and min their top
    bit flipped (their order, restored by flipping it back), and for a mean every value as its high
    and low 32 bits (the halves then sum exactly across up to 2**30 ranks, uint64 and int64 values
    alike, where the sums of the values themselves wrap at 2**63). ``unsigned``: which elements are
    uint64 (default: from the values' dtypes)."""
    flat = [v.detach().reshape(-1).to(work_dtype) for v in values]
    work = flat[0].clone() if len(flat) == 1 else torch.cat(flat)
    if work.dtype != torch.int64 or op not in ("max", "min", "mean"):
        return work
    unsigned = _unsigned_elements(values) if unsigned is None else unsigned
    if op != "mean":
        return work if unsigned is None else work ^ torch.where(unsigned, -(2**63), 0)
    high = work >> 32  # (arithmetic: an int64 value's sign; a uint64 value's top half wants the bits alone)
    if unsigned is not None:
        high = torch.where(unsigned, high & 0xFFFFFFFF, high)
    return torch.cat([high, work & 0xFFFFFFFF])


def _unsigned_elements(values: list[torch.Tensor]) -> torch.Tensor | None:
    """Which elements of the values flattened end to end are uint64's; None where none is."""
    if not any(v.dtype == torch.uint64 for v in values):
        return None
    return torch.cat([torch.full((v.numel(),), v.dtype == torch.uint64) for v in values])


def _mean_of_halves(sums: torch.Tensor, world: int) -> torch.Tensor:
    """The mean, in float64, of the values whose high and low halves ``work_tensor`` made and the
    ranks summed: the sum's quotient by ``world`` computed in integers, so that only its conversion
    to float64 and the remainder's fraction round (the sum itself may pass 2**64)."""
    high, low = sums.chunk(2)
    q_high = torch.div(high, world, rounding_mode="floor")
    rest = (high - q_high * world) * 2**32 + low  # in [0, world * 2**33): no wrap below 2**30 ranks
    q_low = torch.div(rest, world, rounding_mode="floor")
    return q_high.to(torch.float64) * 2**32 + q_low.to(torch.float64) + (rest - q_low * world) / world


def _key_mismatch(comm: Communicator, names: list[Any], shapes: list[tuple[int, ...]], work_dtype: torch.dtype,
                  unsigned: list[Any], op: str, timeout: float | None) -> None:
    """The digests differ: every rank's keys, shapes, kind of values, uint64 keys and op, in one more
    exchange; raises the error that names what differs first of the op, the keys, the shapes, the
    kinds, the uint64 keys."""
    infos = comm._run(CallSpec(Op.KEYS, -1, keys_info(names, shapes, work_dtype, unsigned, op), timeout,
                               stat=Op.REDUCE_DICT))
    ops = [o for *_, o in infos]
    if len(set(ops)) > 1:
        rows = "\n".join(f"  rank {r}: op={o!r}" for r, o in enumerate(ops))
        raise CollectiveMismatchError(f"reduce_dict: the ranks asked for different reductions:\n{rows}",
                                      op="reduce_dict", ranks=odd_ones(ops))
    everyone = [keys for keys, *_ in infos]
    union = sorted(set().union(*[set(ks) for ks in everyone]))
    lines = [f"  rank {r} lacks {', '.join(k for k in union if k not in ks)}"
             for r, ks in enumerate(everyone) if set(ks) != set(union)]
    if lines:
        raise CollectiveMismatchError(
            "reduce_dict: the ranks' dicts have different keys:\n" + "\n".join(lines),
            op="reduce_dict", ranks=[r for r, ks in enumerate(everyone) if set(ks) != set(union)])
    table = [dict(zip(ks, map(tuple, shp), strict=True)) for ks, shp, *_ in infos]
    odd_keys = [k for k in union if len({t[k] for t in table}) > 1]
    if odd_keys:
        lines = [f"  {k}: " + ", ".join(f"rank {r} {t[k]}" for r, t in enumerate(table)) for k in odd_keys]
        raise CollectiveMismatchError(
            "reduce_dict: a key's tensors have different shapes on different ranks:\n" + "\n".join(lines),
            op="reduce_dict", ranks=odd_ones([[t[k] for k in odd_keys] for t in table]))
    kinds = [kind for _, _, kind, _, _ in infos]
    if len(set(kinds)) == 1:  # then it is the uint64 keys
        _raise_signedness_mismatch([set(u) for _, _, _, u, _ in infos], union)
    rows = "\n".join(f"  rank {r}: {_KINDS.get(kind, kind)}" for r, kind in enumerate(kinds))
    raise CollectiveMismatchError(
        f"reduce_dict: the ranks' dicts hold different kinds of values; every rank must pass the same "
        f"kinds (convert integers with .float() to reduce them with floats):\n{rows}", op="reduce_dict",
        ranks=odd_ones(kinds))


def keys_info(names: list[Any], shapes: list[tuple[int, ...]], work_dtype: torch.dtype, unsigned: list[Any],
              op: str) -> tuple[list[str], list[tuple[int, ...]], str, list[str], str]:
    """What a rank tells the others when the reduce_dict digests differ: keys (as reprs), shapes,
    reduce dtype, uint64 keys and op."""
    return [repr(k) for k in names], shapes, str(work_dtype), [repr(k) for k in unsigned], op


def _raise_signedness_mismatch(unsigned: list[set[str]], keys: list[str]) -> None:
    odd = [k for k in keys if len({k in u for u in unsigned}) > 1]
    lines = [f"  {k}: " + ", ".join(f"rank {r} {'uint64' if k in u else 'signed'}" for r, u in enumerate(unsigned))
             for k in odd]
    raise CollectiveMismatchError(
        "reduce_dict: a key's values are uint64 on some ranks and of a signed integer dtype on others (reduced "
        "in int64, each rank would read the result with its own signedness); pass one dtype on every rank:\n"
        + "\n".join(lines), op="reduce_dict", ranks=odd_ones([[k in u for k in odd] for u in unsigned]))


_KINDS = {"torch.int64": "only integer or bool values (reduced exactly, in int64)",
          "torch.float64": "floating point values (reduced in float64)",
          "torch.complex128": "complex values (reduced in complex128)"}


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
