"""What every route shares: the interface a route implements, the slot it builds by default, and
the receiver's check of an announced size."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

from ..._calls import CallSpec, Op
from ..._errors import PayloadTooLargeError
from ..._wire import frame as _frame
from ..._wire.memory import PHYSICAL_MEMORY
from ..._wire.serialization import dumps_for, failure_text, serializer_for

if TYPE_CHECKING:
    from ..._communicator import Communicator

__all__ = ["Incoming", "Outgoing", "Route", "Segment", "build_slot", "check_receivable", "over_max_bytes",
           "root_is_the_odd_slot", "status_outgoing"]

Segment = tuple[memoryview, bool]
"""A segment this rank received: its bytes, and whether they came inline in a slot (the transport's
buffer, copied before they become a result's memory) or in a buffer of their own."""
Incoming = tuple[dict[int, list[Segment]], dict[int, bool]]
"""What a route's second step brought: each source's segments, and whether they were packed."""


class Outgoing:
    """What this rank sends in a collective: its slot (and the slot as decoded), its parts as they
    travel with their tables, a scatter root's slot per receiver, and its status."""

    __slots__ = ("message", "mine", "parts", "slot", "status", "subs", "tables")

    def __init__(self, slot: bytearray, mine: _frame.Slot, parts: list[list[memoryview]],
                 tables: list[list[tuple[int, memoryview | None]]], status: int = _frame.OK, message: str = "",
                 subs: list[bytearray] | None = None) -> None:
        self.slot, self.mine, self.parts, self.tables = slot, mine, parts, tables
        self.status, self.message, self.subs = status, message, subs or []


def build_slot(op: Op, seq: int, root: int, digest: int, parts: list[list[memoryview]],
               size: int) -> tuple[bytearray, list[list[memoryview]], _frame.Slot]:
    """The slot, the parts as they travel (each packed into one segment if the table overflows),
    and the slot as decoded."""
    try:
        slot, mine = _frame.encode_slot(op, seq, root, digest, parts, size)
        return slot, parts, mine
    except ValueError:  # the segment table doesn't fit: one packed segment per part
        packed = [[memoryview(_frame.pack(p))] for p in parts]
    try:
        slot, mine = _frame.encode_slot(op, seq, root, digest, packed, size, flags=_frame.PACKED)
        return slot, packed, mine
    except ValueError:  # a status slot whose message fits (so nothing follows it)
        message = f"{len(parts)} parts don't fit a slot of {size} bytes"[: size - _frame.HEADER_SIZE]
        slot = _frame.encode_status(_frame.INVALID, op, seq, root, message, size)
        return slot, [], _frame.decode(slot)


def over_max_bytes(comm: Communicator, total: int) -> str | None:
    """Why a rank's payload of ``total`` bytes can't be sent (None: it can); reported on every rank."""
    if comm.max_bytes is not None and total > comm.max_bytes:
        return f"payload of {total} bytes is over max_bytes={comm.max_bytes}"
    return None


def status_outgoing(spec: CallSpec, seq: int, status: int, message: str, size: int) -> Outgoing:
    """The slot of a rank that can't take part: its status and message, nothing else."""
    slot = _frame.encode_status(status, spec.op, seq, spec.root, message, size)
    return Outgoing(slot, _frame.decode(slot), [], [], status, message)


def root_is_the_odd_slot(comm: Communicator, spec: CallSpec, seq: int, out: Outgoing,
                         size: int) -> tuple[bytes | bytearray | None, int]:
    """``expected_slot`` of the routes where only the root sends something (broadcast, scatter):
    every other rank sends a bare header, which is this rank's slot unless it is the root."""
    if out.status != _frame.OK:
        return None, -1
    if comm.rank != spec.root:
        return out.slot, spec.root
    return _frame.encode(spec.op, seq, spec.root, spec.digest, [], size), spec.root


def check_receivable(comm: Communicator, size: int, src: int, label: str) -> None:
    """Refuse, before allocating, a segment larger than this machine's memory.

    Only this receiver makes this check (machines differ), so refusing leaves its peers in the
    second step: the communicator is marked broken. Sizes over ``max_bytes``, which every rank
    shares, are refused alike on every rank by the agreement.
    """
    if size > PHYSICAL_MEMORY:
        why = f"rank {src} announced a segment of {size} bytes, more than this machine's memory"
        comm._mark_broken(why)
        raise PayloadTooLargeError(why, op=label, ranks=[src])


class Route(abc.ABC):
    """How one kind of collective's objects travel, from serializing to where results land.

    The pipeline (``_pipeline.run``) calls these in order on every rank: ``serialize`` this rank's
    object into parts, ``build`` the slot of the first exchange (and what rides with it:
    ``carried``, ``own_slots``, where the route's flags say so), ``expected_slot`` for the
    agreement's fast check, ``move`` what
    didn't fit the slots, then ``own_result`` and ``lands_at`` to assemble the results. The
    defaults are the all_gather route's: every rank sends one part to every rank.
    """

    name: str
    # which of the optional steps the route takes (flags: the pipeline skips a call per step it doesn't)
    carries = False  # ``carried``: segments ride in the first exchange after the root's slot
    sends_own_slots = False  # ``own_slots``: each rank gets a slot of its own in the first exchange
    expects_common = False  # ``expected_slot``: every slot but the root's is known before the exchange

    def serialize(self, comm: Communicator, root: int, obj: Any, rank: int) -> tuple[list[list[memoryview]], int, str]:
        """``rank``'s segments per part, plus a status and message when it can't take part."""
        try:
            return [dumps_for(comm, obj)], _frame.OK, ""
        except Exception as e:  # any failure of user objects' pickling is reported on every rank
            return [], _frame.SERIALIZE_FAILED, failure_text(serializer_for(comm), obj, e)

    def build(self, comm: Communicator, spec: CallSpec, seq: int, parts: list[list[memoryview]],
              size: int) -> Outgoing:
        """This rank's slot for a call whose parts serialized (status OK)."""
        slot, parts, mine = build_slot(spec.op, seq, spec.root, spec.digest, parts, size)
        return Outgoing(slot, mine, parts, mine.parts)

    def carried(self, comm: Communicator, root: int, out: Outgoing) -> list[memoryview]:
        """Segments that may ride in the first exchange after the root's slot (broadcast's)."""
        return []

    def own_slots(self, comm: Communicator, root: int, out: Outgoing) -> list[bytearray]:
        """Slots of each rank's own, sent in the first exchange in small worlds (scatter's)."""
        return []

    def expected_slot(self, comm: Communicator, spec: CallSpec, seq: int, out: Outgoing,
                      size: int) -> tuple[bytes | bytearray | None, int]:
        """(c, k): when all is well every rank but k (-1: none) sends c; (None, -1): unknown. Called
        where ``expects_common``; this default is that of the routes where only the root sends."""
        return root_is_the_odd_slot(comm, spec, seq, out, size)

    @abc.abstractmethod
    def move(self, comm: Communicator, spec: CallSpec, seq: int, out: Outgoing, slots: _frame.Slots,
             size: int) -> Incoming:
        """Move what didn't fit the slots; returns the segments received, per source."""

    def direct_peers(self, comm: Communicator, root: int,
                     slots: _frame.Slots) -> tuple[list[tuple[int, int]], list[tuple[int, _frame.Slot, int]]]:
        """For a direct move: (receiver, part) pairs this rank sends to, (source, slot, part) it
        receives from."""
        me, world = comm.rank, comm.world_size
        return [(r, 0) for r in range(world) if r != me], [(r, slots[r], 0) for r in range(world) if r != me]

    def own_result(self, comm: Communicator, root: int, obj: Any) -> Any:
        """This rank's own entry in the results."""
        return obj

    def lands_at(self, comm: Communicator, src: int) -> int:
        """Where the object received from ``src`` goes in the results."""
        return src
