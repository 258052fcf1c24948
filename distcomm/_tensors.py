"""Tensor collectives: all_reduce, reduce, broadcast_tensor, all_gather_tensor and
reduce_scatter_tensor, checked across ranks in one small exchange first (unless check=False), then
moved by the transport's native collectives. The unchecked hot path lives in the transport
(``Communicator._unchecked_fast_path``); this is everything else, and the test doubles' way of
moving tensors (every rank's tensor to every rank)."""

from __future__ import annotations

import datetime
import functools
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._agreement import digest_of, odd_ones
from ._calls import CallSpec, Op, OpStats
from ._errors import CollectiveError, CollectiveMismatchError, CommunicatorStateError
from ._ops import fold_tensors, folds_as_ring, tensor_problem
from ._wire import frame as _frame
from ._wire.frame import I64
from ._wire.memory import materialized

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["all_gather_by_gathering", "broadcast_by_gathering", "reduce_by_gathering", "reduce_scatter_by_gathering",
           "carried_bytes", "fold_rows", "run_tensor_op", "tensor_fields", "tensor_input_problem"]

_ZERO_WORD = bytes(8)


class _AllGather(torch.autograd.Function):
    """all_gather_tensor with a backward pass: the result's gradient summed across ranks, this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, rows: list[int],
                timeout: float | None) -> torch.Tensor:
        ctx.comm, ctx.rows, ctx.timeout = comm, rows, timeout
        return _gathered(comm, x, rows, timeout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        comm, rows = ctx.comm, ctx.rows
        total = grad.contiguous().clone()
        # a collective of its own (recorded by FakeCommunicator, its peers asked as for any all_reduce);
        # unchecked: every rank's gradient has the forward result's shape
        comm.all_reduce(total, "sum", check=False, timeout=ctx.timeout)
        start = sum(rows[: comm.rank])
        return total[start : start + rows[comm.rank]], None, None, None


def tensor_fields(op: Op, tensor: Any, reduce_op: str | None, problem: str | None) -> tuple[int, bytes]:
    """A tensor collective's check: the digest of what must match across ranks, and the 8 bytes
    that may differ (all_gather_tensor's first dimension)."""
    if problem is not None:
        return 0, bytes(8)
    shape = tuple(tensor.shape)
    where = tensor.device.type  # (an NCCL communicator moves CPU tensors over its gloo group)
    if op is Op.ALL_GATHER_TENSOR:
        return _tensor_digest(tensor.dtype, shape[1:], reduce_op, where), I64.pack(shape[0] if shape else 1)
    return _tensor_digest(tensor.dtype, shape, reduce_op, where), _ZERO_WORD


@functools.lru_cache(maxsize=256)
def _tensor_digest(dtype: torch.dtype, shape: tuple[int, ...], reduce_op: str | None, where: str) -> int:
    return digest_of((str(dtype), shape, reduce_op, where))


def tensor_input_problem(comm: Communicator, op: Op, tensor: Any, reduce_op: str | None) -> str | None:
    """What is wrong with a rank's tensor for ``op`` (None: nothing); reported on every rank."""
    problem = tensor_problem(tensor, reduce_op)
    if problem is None:
        problem = comm._device_problem(tensor)
    if problem is None and reduce_op is not None:
        problem = _reducible_problem(comm, tensor)
    world = comm.world_size
    if problem is None and op is Op.REDUCE_SCATTER_TENSOR and (tensor.dim() == 0 or tensor.shape[0] % world):
        problem = f"dim 0 must be a multiple of world_size {world}, got shape {tuple(tensor.shape)}"
    return problem


def _reducible_problem(comm: Communicator, tensor: torch.Tensor) -> str | None:
    """Why the transport can't reduce ``tensor``'s dtype (None: it can). Complex tensors are
    reduced as (re, im) pairs of their real dtype. The test doubles refuse what gloo refuses."""
    dtype = tensor.real.dtype if tensor.is_complex() else tensor.dtype
    if dtype in comm._REDUCIBLE_DTYPES:
        return None
    names = ", ".join(sorted(str(d).removeprefix("torch.") for d in comm._REDUCIBLE_DTYPES))
    return (f"{tensor.dtype} tensors can't be reduced over this transport (it reduces {names}); "
            f"convert them first (for example tensor.float())")


def run_tensor_op(comm: Communicator, op: Op, root: int, tensor: torch.Tensor, reduce_op: str | None, check: bool,
               timeout: float | datetime.timedelta | None) -> torch.Tensor:
    comm._check_usable()
    if not isinstance(check, bool):
        raise TypeError(f"check must be a bool, got {type(check).__name__}")
    t = comm._op_timeout(timeout)
    if not check and comm._misused is not None:  # no exchange to tell the peers in: refused here
        raise CommunicatorStateError(f"{op.label}: {comm._misused}; this communicator fails every later collective")
    problem = tensor_input_problem(comm, op, tensor, reduce_op)
    if problem is not None:
        if not check:
            raise (TypeError if not isinstance(tensor, torch.Tensor) else ValueError)(f"{op.label}: {problem}")
        if comm._returns_at_once():
            raise comm._world_of_one_error(op, problem)
    gathering = op is Op.ALL_GATHER_TENSOR
    x = tensor.reshape(1) if gathering and problem is None and tensor.dim() == 0 else tensor
    if comm._returns_at_once():
        return x.clone() if gathering or op is Op.REDUCE_SCATTER_TENSOR else tensor
    st = comm._stat(op)
    t0 = time.perf_counter()
    carried = carried_bytes(comm, op, tensor, reduce_op) if check and problem is None else None
    if carried is not None:
        return _carried(comm, op, root, tensor, reduce_op, carried, t, st, t0)
    if check:
        counts = _check(comm, op, root, tensor, reduce_op, problem, t)
    else:
        st.calls += 1
        comm._cur = st
        comm._op_label = op.label
        counts = None
    t1 = time.perf_counter()
    if tensor.requires_grad:  # the collectives don't record autograd (all_gather_tensor's own Function does)
        differentiable = gathering and torch.is_grad_enabled()
        with torch.no_grad():
            out = _move(comm, op, root, tensor, x, reduce_op, counts, t, st, differentiable)
    else:
        out = _move(comm, op, root, tensor, x, reduce_op, counts, t, st, False)
    st.serialize_s += t1 - t0
    st.transfer_s += time.perf_counter() - t1
    return out


def _move(comm: Communicator, op: Op, root: int, tensor: torch.Tensor, x: torch.Tensor, reduce_op: str | None,
                 counts: Any, t: float | None, st: OpStats, differentiable: bool) -> torch.Tensor:
    """The transfer of a tensor collective whose inputs are checked (or unchecked by request)."""
    world = comm.world_size
    nbytes = x.numel() * x.element_size()
    if op is Op.ALL_GATHER_TENSOR:
        rows = [int(n) for n in counts] if counts is not None else [x.shape[0]] * world
        moved = sum(rows) * (nbytes // max(x.shape[0], 1)) - nbytes  # a ring's share: everyone else's rows
        st.bytes_sent += moved
        st.bytes_received += moved
        if differentiable:
            with torch.enable_grad():
                out: torch.Tensor = _AllGather.apply(x, comm, rows, t)  # type: ignore[no-untyped-call]
            return out
        return _gathered(comm, x, rows, t)
    if op is Op.REDUCE_SCATTER_TENSOR:
        assert reduce_op is not None
        comm._count(nbytes * (world - 1) // world, nbytes * (world - 1) // world)
        out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
        comm._tensor_reduce_scatter(out, materialized(x), reduce_op, t)
        if reduce_op == "mean":
            out.div_(world)
        return out
    receiver = op is not Op.REDUCE or comm.rank == root
    work = materialized(tensor, fresh=not receiver)
    if op is Op.BROADCAST_TENSOR:
        if comm.rank == root:
            st.bytes_sent += nbytes
        else:
            st.bytes_received += nbytes
        comm._tensor_broadcast(work, root, t)
    else:
        assert reduce_op is not None
        dst = None if op is Op.ALL_REDUCE else root
        sent, received = comm._reduce_traffic(work, dst, reduce_op)
        st.bytes_sent += sent
        st.bytes_received += received
        comm._tensor_reduce(work, dst, reduce_op, t)
        if reduce_op == "mean" and receiver:
            work.div_(world)
    if receiver and work is not tensor:
        tensor.copy_(work)
    return tensor


def _gathered(comm: Communicator, x: torch.Tensor, rows: list[int], timeout: float | None) -> torch.Tensor:
    out = x.new_empty((sum(rows), *x.shape[1:]))
    comm._tensor_all_gather(out, materialized(x), rows, timeout)
    return out


CARRY_BYTES = 1024
"""A checked all_reduce, broadcast_tensor or (all_)reduce_dict of at most this many bytes, in a
world whose slots are exchanged whole (``_frame.SMALL_WORLD``), rides in its own check: every rank's
values in its slot, each rank folding them; one exchange instead of two."""

_CARRIED_OPS = frozenset({Op.ALL_REDUCE, Op.BROADCAST_TENSOR, Op.REDUCE_DICT, Op.ALL_REDUCE_DICT})
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.int8: np.int8, torch.uint8: np.uint8,
                 torch.int32: np.int32, torch.int64: np.int64}  # (the dtypes a carried all_reduce folds)
_NUMPY_FOLDS: dict[str, np.ufunc] = {  # over the ranks' rows, in rank order, in the values' own dtype
    "sum": np.add, "mean": np.add, "prod": np.multiply, "max": np.maximum, "min": np.minimum}
_CARRIED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
                             torch.int32, torch.int64})


def carried_bytes(comm: Communicator, op: Op, tensor: torch.Tensor, reduce_op: str | None) -> bytes | None:
    """This rank's tensor as the bytes its check carries, where the call can ride in it (None: it
    can't). Whether it can depends only on what the check compares (dtype, shape, device, op): ranks
    whose tensors match take the same way, whatever else differs (one rank's tensor requires grad,
    another's is a transposed view); where they don't match, the check fails on every rank, whichever
    way each took. A fold in rank order gives what gloo's ring gives (``folds_as_ring``)."""
    if (op not in _CARRIED_OPS or comm.world_size > _frame.SMALL_WORLD or comm._agrees_by_reduction
            or tensor.dtype not in _CARRIED_DTYPES or tensor.device.type != "cpu"
            or (op is not Op.BROADCAST_TENSOR and not folds_as_ring(tensor.dtype, reduce_op))
            or not 0 < tensor.numel() * tensor.element_size() <= min(CARRY_BYTES, _frame.carry_room(comm._slot_size))):
        return None
    return _plain(tensor).view(-1).view(torch.uint8).numpy().tobytes()


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values in a tensor of the simplest kind, no autograd, no negative view,
    contiguous: ``tensor`` itself (detached) where it is one already, the common call, whose bytes
    are then written in place, bumping no version counter (as the native collective writes them)."""
    plain = tensor.detach() if tensor.requires_grad else tensor
    if plain.is_neg() or not plain.is_contiguous():
        return plain.resolve_neg().contiguous()
    return plain


def _carried(comm: Communicator, op: Op, root: int, tensor: torch.Tensor, reduce_op: str | None, carried: bytes,
             timeout: float | None, st: OpStats, t0: float) -> torch.Tensor:
    """The call inside its check: every rank's bytes come back with the slots; fold (or take the root's)."""
    digest, _ = tensor_fields(op, tensor, reduce_op, None)
    rows = comm._run(CallSpec(op, root, tensor, timeout, serialize=False, digest=digest, carries=True, inline=carried,
                              on_digest_mismatch=lambda: _mismatch(comm, op, tensor, reduce_op, timeout)))
    t1 = time.perf_counter()
    work = _plain(tensor)
    flat = work.view(-1)
    if op is Op.BROADCAST_TENSOR:
        flat.view(torch.uint8).numpy()[:] = rows[root]
    else:
        assert reduce_op is not None
        fold_rows(rows, flat, reduce_op)
        if reduce_op == "mean":
            flat.div_(comm.world_size)
    if work.data_ptr() != tensor.data_ptr():  # (a copy: written back, as the native path does)
        with torch.no_grad():
            tensor.copy_(work)
    st.serialize_s += t1 - t0
    st.transfer_s += time.perf_counter() - t1
    return tensor


def fold_rows(rows: Any, flat: torch.Tensor, reduce_op: str) -> None:
    """Every rank's bytes of ``flat`` (``rows``: one row per rank, from a carried check) folded into
    ``flat`` itself by ``reduce_op`` ("mean": summed; the caller divides). numpy folds a few values
    in a fraction of torch's per-call time, in rank order alike on every rank."""
    values = rows.view(_NUMPY_DTYPES[flat.dtype])
    with np.errstate(over="ignore", invalid="ignore"):  # inf and nan, silently, as torch's ring gives them (1 µs)
        _NUMPY_FOLDS[reduce_op].reduce(values, axis=0, dtype=values.dtype, out=flat.numpy())


def _check(comm: Communicator, op: Op, root: int, tensor: torch.Tensor, reduce_op: str | None, problem: str | None,
                  timeout: float | None) -> Any:
    """Compare the ranks' dtypes, shapes and reduce ops in one exchange; all_gather_tensor's
    first dimensions ride along (returned, per rank)."""
    digest, inline = tensor_fields(op, tensor, reduce_op, problem)
    return comm._run(CallSpec(op, root, tensor, timeout, serialize=False, digest=digest, problem=problem,
                              inline=inline,
                              on_digest_mismatch=lambda: _mismatch(comm, op, tensor, reduce_op, timeout)))


def _mismatch(comm: Communicator, op: Op, tensor: torch.Tensor, reduce_op: str | None, timeout: float | None) -> None:
    mine = (str(tensor.dtype), tuple(tensor.shape), reduce_op, tensor.device.type)
    infos = comm._run(CallSpec(Op.TENSOR_INFO, -1, mine, timeout, stat=op))
    gathering = op is Op.ALL_GATHER_TENSOR

    def key(info: tuple[str, tuple[int, ...], str | None, str]) -> Any:
        return (info[0], tuple(info[1])[1:], *info[2:]) if gathering else info

    odd = odd_ones([key(info) for info in infos])
    places = len({info[3] for info in infos}) > 1
    rows = "\n".join(f"  rank {r}: {dtype} {tuple(shape)}" + (f" op={o!r}" if o else "")
                     + (f" on {at}" if places else "") for r, (dtype, shape, o, at) in enumerate(infos))
    what = ("dtype and shape beyond the first dimension" if gathering else
            "dtype, shape and op" if reduce_op else "dtype and shape")
    what += " on the same kind of device" if places else ""
    raise CollectiveMismatchError(
        f"{op.label}: the ranks' tensors differ; every rank must pass the same {what}:\n{rows}",
        op=op.label, ranks=odd)


def _same_tensors(comm: Communicator, values: list[torch.Tensor], mine: torch.Tensor,
                  rows: bool = False) -> list[torch.Tensor]:
    """Refuse what a real transport can't combine (only reachable with check=False)."""
    for r, v in enumerate(values):
        if v.dtype != mine.dtype or (v.shape[1:] if rows else v.shape) != (mine.shape[1:] if rows else mine.shape):
            raise CollectiveError(
                f"rank {r}'s tensor ({v.dtype}, {tuple(v.shape)}) doesn't match this rank's ({mine.dtype}, "
                f"{tuple(mine.shape)}); with check=False the transport fails (or hangs) on this", ranks=[r])
    return values


def reduce_by_gathering(comm: Communicator, tensor: torch.Tensor, dst: int | None, op: str,
                        timeout: float | None) -> None:
    """Reduce ``tensor`` in place onto ``dst`` (None: every rank); "mean" sums."""
    values = _same_tensors(comm, comm._gather_tensors(tensor, timeout), tensor)
    if dst is None or dst == comm.rank:  # (``.data``: no version counter bumped, as a transport writes)
        tensor.data.copy_(fold_tensors(values, op))


def broadcast_by_gathering(comm: Communicator, tensor: torch.Tensor, src: int, timeout: float | None) -> None:
    values = _same_tensors(comm, comm._gather_tensors(tensor, timeout), tensor)
    tensor.data.copy_(values[src])


def all_gather_by_gathering(comm: Communicator, out: torch.Tensor, tensor: torch.Tensor, rows: list[int],
                       timeout: float | None) -> None:
    values = _same_tensors(comm, comm._gather_tensors(tensor, timeout), tensor, rows=True)
    if [v.shape[0] for v in values] != rows:
        raise CollectiveError(f"the ranks' first dimensions are {[v.shape[0] for v in values]}, this rank expected "
                              f"{rows}; with check=False every rank's must equal this rank's")
    torch.cat(values, out=out)


def reduce_scatter_by_gathering(comm: Communicator, out: torch.Tensor, tensor: torch.Tensor, op: str,
                                timeout: float | None) -> None:
    values = _same_tensors(comm, comm._gather_tensors(tensor, timeout), tensor)
    out.copy_(fold_tensors(values, op).chunk(comm.world_size)[comm.rank])
