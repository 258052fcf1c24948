"""scatter: part r of the root's list to rank r, and to no one else. Each receiver gets a slot of
its own part: in small worlds in the first exchange itself, beyond it in a second exchange of one
size the root announces (small parts whole); parts that don't fit it follow, root to receiver."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..._calls import CallSpec, Op
from ..._errors import FrameError
from ..._wire import frame as _frame
from ..._wire.serialization import dumps_for, failure_text, serializer_for
from .base import Incoming, Outgoing, build_slot, over_max_bytes, status_outgoing
from .direct import DirectRoute, move_direct

if TYPE_CHECKING:
    from ..._communicator import Communicator

__all__ = ["ScatterRoute", "part_slot_size", "parts_problem", "scatter_head"]


class ScatterRoute(DirectRoute):
    """scatter (and a prefix reduction's results): part r of the root's to rank r."""

    name = "scatter"
    counts_per_rank = False  # a receiver's plan stays O(1), and there is no all-to-all
    sends_own_slots = True
    expects_common = True

    def serialize(self, comm: Communicator, root: int, obj: Any, rank: int) -> tuple[list[list[memoryview]], int, str]:
        if rank != root:
            return [], _frame.OK, ""
        try:
            return [[] if r == root else dumps_for(comm, o) for r, o in enumerate(obj)], _frame.OK, ""
        except Exception as e:  # reported on every rank
            return [], _frame.SERIALIZE_FAILED, failure_text(serializer_for(comm), list(obj), e, "objs")

    def build(self, comm: Communicator, spec: CallSpec, seq: int, parts: list[list[memoryview]],
              size: int) -> Outgoing:
        root = spec.root
        if comm.rank != root:
            slot, mine = scatter_head(spec.op, seq, root, spec.digest, size, size)
            return Outgoing(slot, mine, [], [])
        # each receiver gets a slot of its own part: nobody receives a table of every part
        part_slot = part_slot_size(comm, parts, root, size)
        built = [build_slot(spec.op, seq, root, spec.digest, [p], part_slot) for p in parts]
        status, message = parts_problem(comm, [d for _, _, d in built])
        if status != _frame.OK:
            return status_outgoing(spec, seq, status, message, size)
        slot, mine = scatter_head(spec.op, seq, root, spec.digest, part_slot, size)
        return Outgoing(slot, mine, [p[0] for _, p, _ in built], [d.parts[0] if d.parts else [] for _, _, d in built],
                        subs=[s for s, _, _ in built])

    def own_slots(self, comm: Communicator, root: int, out: Outgoing) -> list[bytearray]:
        # in small worlds the root sends each rank the slot of its part in the first exchange
        return out.subs if out.status == _frame.OK and comm.world_size <= _frame.SMALL_WORLD else []

    def move(self, comm: Communicator, spec: CallSpec, seq: int, out: Outgoing, slots: _frame.Slots,
             size: int) -> Incoming:
        root = spec.root
        if comm.world_size <= _frame.SMALL_WORLD:  # the root's slot was this rank's own
            slots = _frame.Slots(b"", size, 0, None if comm.rank == root else slots[root])
        else:
            slots = deliver_part_slots(comm, spec.op, seq, root, out.subs, size, spec.timeout, slots)
        return move_direct(comm, self, root, out, slots, spec.timeout)

    def direct_peers(self, comm: Communicator, root: int,
                     slots: _frame.Slots) -> tuple[list[tuple[int, int]], list[tuple[int, _frame.Slot, int]]]:
        # ``slots`` holds only the root's slot for this rank
        if comm.rank == root:
            return [(r, r) for r in range(comm.world_size) if r != root], []
        return [], [(root, slots[0], 0)]

    def own_result(self, comm: Communicator, root: int, obj: Any) -> Any:
        return obj[comm.rank] if comm.rank == root else None

    def lands_at(self, comm: Communicator, src: int) -> int:
        return comm.rank


def part_slot_cap(comm: Communicator) -> int:
    """The most a scatter's per-rank slot holds beyond small worlds."""
    return min(comm.slot_bytes, comm._SCATTER_SLOT_MAX)


def part_slot_size(comm: Communicator, parts: list[list[memoryview]], root: int, size: int) -> int:
    """The size of the slot a scatter's root sends each rank. Beyond small worlds: large enough to
    hold whole (table and bytes, rounded up to 8) as many parts as it can, up to the largest that
    fits in ``part_slot_cap`` (and ``max_bytes``), so that small parts reach their ranks in
    that one message (one native scatter on gloo) — but no larger than keeps what the root sends
    in those slots within twice the bytes of the parts they hold: a few large parts among many
    small ones travel after their slots instead of padding every rank's. ``size`` (the header
    slot's, announced by nothing) when no size over it qualifies."""
    if comm.world_size <= _frame.SMALL_WORLD:
        return size
    cap = part_slot_cap(comm)
    if comm.max_bytes is not None:
        cap = min(cap, comm.max_bytes)
    table = _frame.table_size([1])
    needs = []
    for r, p in enumerate(parts):
        if r != root:
            n = -(-(_frame.table_size([len(p)]) + sum(seg.nbytes for seg in p)) // 8) * 8
            if n <= cap:
                needs.append(n)
    needs.sort()
    held = sum(needs)  # the bytes of the parts a slot of needs[k] holds whole: needs[0..k]
    for k in range(len(needs) - 1, -1, -1):
        n = needs[k]
        if n <= size:
            break
        if (comm.world_size - 1) * n <= 2 * held + (comm.world_size - 1) * table:
            return n
        held -= n
    return size


def parts_problem(comm: Communicator, decoded: list[_frame.Slot]) -> tuple[int, str]:
    """What a scatter's root reports of the slots of its parts (``decoded``): a status and a
    message (OK, ""). A part as it travels (packed, when its table doesn't fit its slot) is what
    its receiver checks against max_bytes: refused here, so that every rank refuses it."""
    bad = next((d.message for d in decoded if d.header.status), None)
    if bad is not None:
        return _frame.INVALID, bad
    over = over_max_bytes(comm, max((d.header.total for d in decoded), default=0))
    if over is not None:
        return _frame.TOO_LARGE, f"a part as it travels: {over}"
    return _frame.OK, ""


def scatter_head(op: Op, seq: int, root: int, digest: int, sub: int, size: int) -> tuple[bytearray, _frame.Slot]:
    """A scatter's header slot, and the slot as decoded: the root's announces the size ``sub`` of
    the slot each rank then receives from it, as one segment that travels later, where it is
    over ``size``."""
    if sub > size:
        slot = _frame.encode_later(op, seq, root, digest, sub, size)
        return slot, _frame.decode(slot)
    return _frame.encode_slot(op, seq, root, digest, [], size)


def announced_slot_size(comm: Communicator, op: Op, seq: int, root: int, head: _frame.Slot, size: int) -> int:
    """The size of the slot this rank receives from scatter's root, as the root's header slot
    ``head`` announced it: ``size``, or over it and at most ``part_slot_cap`` (the same
    check on every rank, before anything is allocated)."""
    if not head.parts:
        return size
    entries = head.parts[0] if len(head.parts) == 1 else []
    if len(entries) != 1 or entries[0][1] is not None:
        raise FrameError(f"{op.label} #{seq}: rank {root}'s header slot doesn't announce the size of the slot "
                         f"of each rank's part (one segment that travels later)", op=op.label, ranks=[root])
    n, cap = entries[0][0], part_slot_cap(comm)
    if not size < n <= cap:
        raise FrameError(f"{op.label} #{seq}: rank {root} announced a slot of {n} bytes for each rank's part "
                         f"(this communicator's are over {size} and at most {cap} bytes)", op=op.label,
                         ranks=[root])
    return n


def deliver_part_slots(comm: Communicator, op: Op, seq: int, root: int, subs: list[bytearray], size: int,
                       timeout: float | None, slots: _frame.Slots) -> _frame.Slots:
    """Scatter's second exchange beyond small worlds: the root sends each rank the slot of its
    own part only, of the size its header slot announced (``part_slot_size``)."""
    size = len(subs[root]) if comm.rank == root else announced_slot_size(comm, op, seq, root, slots[root], size)
    buf = comm._scatter_slots(root, subs, size, timeout)
    if buf is None:
        return _frame.Slots(b"", size, 0, None)
    try:
        sub = _frame.decode(memoryview(buf.numpy()))  # type: ignore[arg-type]
    except FrameError as e:
        raise FrameError(f"{op.label} #{seq}: the slot of this rank's part from rank {root} is corrupt: {e}",
                         op=op.label, ranks=[root]) from e
    if (sub.header.op, sub.header.seq, sub.header.root, sub.header.status) != (op, seq, root, _frame.OK):
        raise FrameError(f"{op.label} #{seq}: rank {root} sent a slot for another call", op=op.label,
                         ranks=[root])
    return _frame.Slots(b"", size, 0, sub)
