"""all_to_all: objs[d] from every rank to rank d. After the first exchange (which only agrees
that every rank called it and can take part), each rank tells each peer its part's size, then
every part goes straight from its sender to its receiver in one all-to-all."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from .._calls import CallSpec, Op
from .._errors import FrameError
from .._wire import frame as _frame
from .._wire.memory import GC_PAUSE_BYTES, NOTHING, GCPause, as_view
from .._wire.serialization import dumps_for, failure_text, serializer_for
from .pipeline import load
from .routes import check_receivable, over_max_bytes

if TYPE_CHECKING:
    from .._communicator import Communicator

__all__ = ["all_to_all", "all_to_all_problem"]


def all_to_all_problem(objs: Any, world: int) -> str | None:
    """What is wrong with a rank's all_to_all list (None: nothing); reported on every rank."""
    if objs is None or isinstance(objs, (str, bytes)) or not isinstance(objs, Sequence):
        return f"all_to_all needs a sequence of {world} objects, got {type(objs).__name__}"
    if len(objs) != world:
        return f"all_to_all got {len(objs)} objects for world_size {world}"
    return None


def all_to_all(comm: Communicator, objs: Sequence[Any], problem: str | None, timeout: float | None) -> list[Any]:
    """Send ``objs[d]`` to rank d; returns what each rank sent this one, by source."""
    t0 = time.perf_counter()
    segments, lengths, status, problem = _serialize(comm, objs, problem)
    comm._run(CallSpec(Op.ALL_TO_ALL, -1, objs, timeout, serialize=False, problem=problem, status=status))
    st = comm._cur
    t1 = time.perf_counter()
    seq = comm._seq
    try:
        recv, got = _move(comm, seq, segments, lengths, timeout)
    except BaseException as e:
        comm._mark_broken(f"all_to_all #{seq}: {type(e).__name__} while moving data: {str(e)[:160]}")
        raise
    t2 = time.perf_counter()
    out: list[Any] = [None] * comm.world_size
    out[comm.rank] = objs[comm.rank]
    view, at = as_view(recv), 0
    with GCPause() if recv.numel() >= GC_PAUSE_BYTES else NOTHING:
        for src, n in enumerate(got):
            if src != comm.rank:
                out[src] = load(comm, Op.ALL_TO_ALL, seq, src, [(view[at : at + n], False)], True)
                at += n
    st.serialize_s += t1 - t0
    st.transfer_s += t2 - t1
    st.deserialize_s += time.perf_counter() - t2
    return out


def _serialize(comm: Communicator, objs: Sequence[Any],
               problem: str | None) -> tuple[list[list[memoryview]], list[int], int, str | None]:
    """Each part's segments and packed length (this rank's own: none), and this rank's status."""
    world, me = comm.world_size, comm.rank
    if problem is not None:
        return [], [0] * world, _frame.INVALID, problem
    try:  # each object's segments, packed later straight into the one send buffer
        segments = [[] if d == me else dumps_for(comm, o) for d, o in enumerate(objs)]
    except Exception as e:  # reported on every rank
        sent = [None if d == me else o for d, o in enumerate(objs)]  # this rank's own entry stays here
        return [], [0] * world, _frame.SERIALIZE_FAILED, failure_text(serializer_for(comm), sent, e, "objs")
    lengths = [0 if d == me else _frame.packed_size(segs) for d, segs in enumerate(segments)]
    over = over_max_bytes(comm, sum(lengths))
    if over is not None:
        return segments, lengths, _frame.TOO_LARGE, over
    return segments, lengths, _frame.OK, None


def _move(comm: Communicator, seq: int, segments: list[list[memoryview]], lengths: list[int],
          timeout: float | None) -> tuple[torch.Tensor, list[int]]:
    """The sizes, then the parts: returns what arrived, back to back by source, and each source's size."""
    world, me = comm.world_size, comm.rank
    # the sizes first: 8 bytes to and from each peer (chunks lie back to back, in rank order)
    counts = [0 if d == me else 8 for d in range(world)]
    sizes = torch.tensor([n for d, n in enumerate(lengths) if d != me], dtype=torch.int64)
    theirs = torch.zeros(world - 1, dtype=torch.int64)
    comm._count(8 * (world - 1), 8 * (world - 1))
    comm._alltoallv(sizes.view(torch.uint8), counts, theirs.view(torch.uint8), counts, timeout)
    got = theirs.tolist()
    got.insert(me, 0)
    for src, n in enumerate(got):
        if n < 0:
            raise FrameError(f"all_to_all #{seq}: rank {src} announced {n} bytes", op="all_to_all", ranks=[src])
        check_receivable(comm, n, src, "all_to_all")
    send = torch.zeros(sum(lengths), dtype=torch.uint8)  # one copy of what this rank sends
    send_view, at = as_view(send), 0
    for d, segs in enumerate(segments):
        if d != me:
            _frame.pack_into(send_view[at : at + lengths[d]], segs)
            at += lengths[d]
    segments.clear()  # the streams, now copied (the caller's list: nothing keeps them)
    recv = torch.empty(sum(got), dtype=torch.uint8)
    comm._count(send.numel(), recv.numel())
    comm._alltoallv(send, lengths, recv, got, timeout)
    return recv, got
