"""gather: every rank's object to the root. Small gathers beyond small worlds go up a binomial
tree; the rest go straight to the root (the direct move)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..._calls import CallSpec
from ..._errors import FrameError
from ..._wire import frame as _frame
from ..._wire.memory import as_view
from .base import Incoming, Outgoing, Segment
from .direct import DirectRoute, _cheap, _later

if TYPE_CHECKING:
    from ..._communicator import Communicator

__all__ = ["GatherRoute", "subtrees", "tree_gather_totals"]


class GatherRoute(DirectRoute):
    """gather (and the object reductions' first step): every rank's part to the root."""

    name = "gather"

    def move(self, comm: Communicator, spec: CallSpec, seq: int, out: Outgoing, slots: _frame.Slots,
             size: int) -> Incoming:
        if comm.world_size > _frame.SMALL_WORLD:
            totals = tree_gather_totals(slots, comm.world_size, spec.root, comm._TREE_GATHER_BYTES)
            if totals is not None:
                return tree_gather(comm, spec.root, out.parts, slots, totals, spec.timeout, spec.op.label)
        return super().move(comm, spec, seq, out, slots, size)

    def direct_peers(self, comm: Communicator, root: int,
                     slots: _frame.Slots) -> tuple[list[tuple[int, int]], list[tuple[int, _frame.Slot, int]]]:
        me, world = comm.rank, comm.world_size
        if me != root:
            return [(root, 0)], []
        return [], [(r, slots[r], 0) for r in range(world) if r != me]

    def alltoall_fits(self, comm: Communicator, root: int, slots: _frame.Slots) -> bool:
        # beyond small worlds a gather's all-to-all would post world x world empty messages
        world = comm.world_size
        if world > _frame.SMALL_WORLD:
            return False
        later, pieces, total, total_pieces = _later(slots, world)
        if not total:
            return False
        return all(_cheap(comm, later[r], pieces[r]) for r in range(world) if r != root) and _cheap(
            comm, total - later[root], total_pieces - pieces[root])


def tree_gather_totals(slots: _frame.Slots, world: int, root: int, limit: int) -> np.ndarray[Any, Any] | None:
    """The slots' totals when a gather goes up the binomial tree (every rank's, and all but the
    root's together, at most ``limit``); None when it goes straight to the root. Each total is
    bounded before they are summed, so forged ones can't wrap the sum past the receivers' checks."""
    totals = slots.totals(world)
    if int(totals.max()) > limit or int(totals.sum()) - int(totals[root]) > limit:
        return None
    return totals


def subtrees(world: int, v: int) -> tuple[int, list[tuple[int, int]]]:
    """Rank v's place in the binomial tree (ranks counted from the root): the end of its subtree
    (v up to v + lowbit(v)), and each child's subtree as (first, end): child v + k holds v + k up
    to v + 2k, for the powers of two k < lowbit(v) (the root's: every power of two below world)."""
    low = v & -v if v else 1 << max(world - 1, 1).bit_length()
    end = min(v + low, world)
    children, k = [], 1
    while k < low and v + k < world:
        children.append((v + k, min(v + 2 * k, end)))
        k *= 2
    return end, children


def tree_gather(comm: Communicator, root: int, parts: list[list[memoryview]], slots: _frame.Slots,
                totals: np.ndarray[Any, Any], timeout: float | None, label: str) -> Incoming:
    """Move every rank's segments to the root up a binomial tree; returns the root's segments
    per source (views of one receive buffer), or nothing on the other ranks.

    Each rank receives its children's subtrees into one buffer, behind its own segments, in rank
    order, and sends that buffer to its parent v - lowbit(v) in one message. Every rank computes
    the same sizes from the slots' totals (each rank's segments, inline ones included), so every
    buffer has its exact size.
    """
    world, me = comm.world_size, comm.rank
    v = (me - root) % world
    tables = []  # the root reads every table before it receives anything (a corrupt one is refused)
    for u in range(1, world) if not v else ():
        src = (u + root) % world
        slot = slots[src]
        if len(slot.parts) != 1:
            raise FrameError(f"rank {src} sent {len(slot.parts)} parts, not 1", op=label, ranks=[src])
        tables.append((src, slot.parts[0], bool(slot.header.flags & _frame.PACKED)))
    end, children = subtrees(world, v)
    sizes = np.roll(totals, -root)  # by relative rank
    sizes[0] = 0  # the root keeps its own object
    starts = [0, *np.cumsum(sizes[v:end]).tolist()]  # offsets in my buffer, by relative rank - v
    buf = torch.empty(starts[-1], dtype=torch.uint8)
    view = as_view(buf)
    if v:
        pos = 0
        for seg in parts[0]:
            n = seg.nbytes
            view[pos : pos + n] = _frame.flat(seg)
            pos += n
    recvs = []
    for first, last in children:
        a, b = starts[first - v], starts[last - v]
        if b > a:
            recvs.append(((first + root) % world, buf[a:b]))
    if recvs:
        comm._exchange_counted([], recvs, timeout)
    if v:
        if starts[-1]:
            comm._exchange_counted([((v - (v & -v) + root) % world, buf)], [], timeout)
        return {}, {}
    incoming: dict[int, list[Segment]] = {}
    packed: dict[int, bool] = {}
    for u, (src, entries, was_packed) in enumerate(tables, start=1):
        pos, segs = starts[u], []
        for n, _ in entries:
            segs.append((view[pos : pos + n], False))
            pos += n
        incoming[src] = segs
        packed[src] = was_packed
    return incoming, packed
