"""The direct move: each part goes straight from its sender to its receivers, in one all-to-all
when that costs no copy or only small ones, else point to point. all_gather travels this way, and
so do gather (in small worlds, and beyond them when its segments are too large for the tree) and
scatter after its slots."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..._calls import CallSpec
from ..._errors import FrameError
from ..._wire import frame as _frame
from ..._wire.memory import as_view, byte_tensor
from .base import Incoming, Outgoing, Route, Segment, check_receivable

if TYPE_CHECKING:
    from ..._communicator import Communicator

__all__ = ["AllGatherRoute", "DirectRoute", "Plan", "move_direct", "plan_direct"]


@dataclass
class Plan:
    """What this rank sends and receives in a direct move, and the segments it will deserialize."""

    sends: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    recvs: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # point to point only
    # per source rank: its segments, each an inline view or the tensor it is received into
    incoming: dict[int, list[Segment]] = field(default_factory=dict)
    packed: dict[int, bool] = field(default_factory=dict)
    send_counts: list[int] = field(default_factory=list)  # bytes to / from each rank
    recv_counts: list[int] = field(default_factory=list)
    # set when the move runs as one all-to-all: every received segment is a view of it
    recv_buf: torch.Tensor | None = None


class DirectRoute(Route):
    """A route whose second step is a direct move (``direct_peers`` says who sends what to whom)."""

    # bytes to and from each rank, for an all-to-all (scatter's receivers skip them: their plan stays O(1))
    counts_per_rank = True

    def move(self, comm: Communicator, spec: CallSpec, seq: int, out: Outgoing, slots: _frame.Slots,
             size: int) -> Incoming:
        return move_direct(comm, self, spec.root, out, slots, spec.timeout)

    def alltoall_fits(self, comm: Communicator, root: int, slots: _frame.Slots) -> bool:
        """Whether the move runs as one all-to-all (False too when nothing travels after the slots).

        Decided from the slots alone, in closed form, so every rank decides the same in O(world).
        An all-to-all takes each rank's sends from one buffer and lands its receives in one buffer:
        free when a rank sends or receives one segment (the usual case with two ranks); otherwise
        the sender copies its segments together, and the receiver's results share one buffer (which
        lives as long as any of them), so both are allowed up to ``_alltoall_copy_bytes``. This
        default is all_gather's, where every rank sends to every rank.
        """
        world = comm.world_size
        later, pieces, total, total_pieces = _later(slots, world)
        if not total:
            return False
        return all(_cheap(comm, later[r] * (world - 1), pieces[r] * (world - 1))
                   and _cheap(comm, total - later[r], total_pieces - pieces[r]) for r in range(world))


class AllGatherRoute(DirectRoute):
    """all_gather (and set-up, and the checks' exchanges): every rank's part to every rank."""

    name = "all_gather"


def _later(slots: _frame.Slots, world: int) -> tuple[list[int], list[int], int, int]:
    """Each rank's bytes and segments after its slot, and their totals."""
    later = [slots[r].later for r in range(world)]
    pieces = [slots[r].later_segs for r in range(world)]
    return later, pieces, sum(later), sum(pieces)


def _cheap(comm: Communicator, nbytes: int, n: int) -> bool:
    """Whether an all-to-all may send or land ``nbytes`` in ``n`` segments (see ``alltoall_fits``)."""
    return nbytes <= comm._alltoall_max_bytes and (n <= 1 or nbytes <= comm._alltoall_copy_bytes)


def move_direct(comm: Communicator, route: DirectRoute, root: int, out: Outgoing, slots: _frame.Slots,
                timeout: float | None) -> Incoming:
    """Send this rank's later segments to their receivers and receive its own, as ``plan_direct`` says."""
    plan = plan_direct(comm, route, root, out.parts, out.tables, slots)
    if plan.recv_buf is not None:
        sends = [t for _, t in plan.sends]
        send = sends[0] if len(sends) == 1 else torch.cat(sends) if sends else torch.empty(0, dtype=torch.uint8)
        comm._count(sum(plan.send_counts), sum(plan.recv_counts))
        comm._alltoallv(send, plan.send_counts, plan.recv_buf, plan.recv_counts, timeout)
    elif plan.sends or plan.recvs:
        comm._exchange_counted(plan.sends, plan.recvs, timeout)
    return plan.incoming, plan.packed


def plan_direct(comm: Communicator, route: DirectRoute, root: int, parts: list[list[memoryview]],
                tables: list[list[tuple[int, memoryview | None]]], slots: _frame.Slots) -> Plan:
    """Who sends which segments to whom, and into which buffers they land."""
    world = comm.world_size
    counted = route.counts_per_rank
    plan = Plan(send_counts=[0] * world, recv_counts=[0] * world) if counted else Plan()
    receivers, sources = route.direct_peers(comm, root, slots)
    # what I send: my segments that did not fit the slot, to each receiver of their part
    later: dict[int, list[torch.Tensor]] = {}  # each part's travelling segments, as tensors, made once
    for dst, p in receivers:
        out = later.get(p)
        if out is None:
            out = later[p] = [byte_tensor(seg) for (size, inline), seg in zip(tables[p], parts[p], strict=True)
                              if inline is None and size]
        for t in out:
            plan.sends.append((dst, t))
            if counted:
                plan.send_counts[dst] += t.numel()
    # what I receive: each source's part meant for me, into exact-size buffers (with an
    # all-to-all: views of one buffer, each source's segments back to back; loading copies an
    # out-of-band buffer that lands unaligned)
    wanted = []
    for src, slot, p in sources:
        theirs = slot.parts
        if p >= len(theirs):
            raise FrameError(f"rank {src} sent {len(theirs)} parts, part {p} missing", op=route.name, ranks=[src])
        for size, inline in theirs[p]:
            if inline is None:
                check_receivable(comm, size, src, route.name)
                if counted:
                    plan.recv_counts[src] += size
        wanted.append((src, theirs[p]))
        plan.packed[src] = bool(slot.header.flags & _frame.PACKED)
    if counted and route.alltoall_fits(comm, root, slots):
        plan.recv_buf = torch.empty(sum(plan.recv_counts), dtype=torch.uint8)
    _lay_out(plan, wanted)
    return plan


def _lay_out(plan: Plan, wanted: list[tuple[int, list[tuple[int, memoryview | None]]]]) -> None:
    """Each source's segments: inline views, views of the all-to-all's buffer, or buffers of their own."""
    offset = 0
    whole = as_view(plan.recv_buf) if plan.recv_buf is not None else None
    for src, entries in wanted:
        segs: list[Segment] = []
        for size, inline in entries:
            if inline is not None:
                segs.append((inline, True))
            elif whole is not None:
                segs.append((whole[offset : offset + size], False))
                offset += size
            else:
                buf = torch.empty(size, dtype=torch.uint8)
                if size:
                    plan.recvs.append((src, buf))
                segs.append((as_view(buf), False))
        plan.incoming[src] = segs
