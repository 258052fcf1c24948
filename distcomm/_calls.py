"""What a collective call is: its id on the wire (``Op``), its counters (``OpStats``), and the one
value the pipeline runs it from (``CallSpec``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

from ._wire import frame as _frame

__all__ = ["CallSpec", "Op", "OpStats"]


class Op(IntEnum):
    """A collective's id in the slot header. Ranks that call different collectives send different
    ids, so they disagree in the first exchange instead of exchanging the wrong bytes."""

    SETUP = 1
    SYNCHRONIZE = 2  # (synchronize and its alias barrier)
    ALL_GATHER = 3
    GATHER = 4
    BROADCAST = 5
    SCATTER = 6
    REDUCE_DICT = 7
    ALL_REDUCE_DICT = 8
    KEYS = 9  # reduce_dict's keys and shapes, exchanged on the error path only
    ALL_REDUCE = 10
    REDUCE = 11
    BROADCAST_TENSOR = 12
    ALL_GATHER_TENSOR = 13
    REDUCE_SCATTER_TENSOR = 14
    TENSOR_INFO = 15  # the tensors' dtypes and shapes, exchanged on the error path only
    REDUCE_OBJECT = 16
    ALL_REDUCE_OBJECT = 17
    SCAN = 18
    EXSCAN = 19
    RESULT = 20  # an object reduction's outcome, from its root to every rank
    RESULTS = 21  # a prefix reduction's outcomes, one per rank, from rank 0
    ALL_TO_ALL = 22
    SPLIT = 23
    SHARED_RANDOM_SEED = 24
    CREATE_LOCAL_GROUPS = 25
    GATHER_IN_ORDER = 26  # every rank's count of results (then a gather)
    ADMIT = 27  # who comes in, from rank 0 (see _membership.admit)
    SYNC_STATE = 28  # every rank's fingerprints of its state, then whether it loaded what it was sent
    CHECK_IDENTICAL = 29  # every rank's fingerprints, then the keys' of those that differ

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {op: op.name.lower() for op in Op}


@dataclass
class OpStats:
    """Counters for one kind of collective on one communicator (times in seconds)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    serialize_s: float = 0.0
    transfer_s: float = 0.0
    deserialize_s: float = 0.0


class CallSpec:
    """One collective as the pipeline runs it: what every rank puts in its slot, and how.

    Args:
        op: the collective's id (its route follows from it).
        root: the root rank (-1 where there is none).
        obj: this rank's object (read where the route serializes it).
        timeout: seconds to wait for peers.
        serialize: False for collectives whose slot carries only a header (barrier, the checks of
            tensor collectives and reduce_dict): the call then returns after the first exchange.
        digest: 8 bytes every rank must agree on (keys and shapes, dtypes), compared in the slots.
        problem: this rank's input is unfit: the message every rank reports (with ``status``).
        status: the status ``problem`` is reported with.
        on_digest_mismatch: raises the error that names what differs, when digests disagree.
        slot_size: the first exchange's slot size (default: the communicator's).
        inline: with ``serialize=False``, 8 bytes every rank carries in its slot; the call then
            returns every rank's 8 bytes as an int.
        carries: ``inline`` is a payload of any length that fits the slot (a small tensor's bytes);
            the call then returns every rank's payload, one uint8 row per rank.
        stat: count this call under that op (an error-path exchange of another collective).
    """

    # The options' defaults live on the class: the common call (an all_gather, a gather...) sets
    # only the four fields every call has, a small part of each small collective's Python.
    serialize = True
    digest = 0
    problem: str | None = None
    status = _frame.INVALID
    on_digest_mismatch: Callable[[], None] | None = None
    slot_size: int | None = None
    inline: bytes | None = None
    carries = False
    stat: Op | None = None

    def __init__(self, op: Op, root: int, obj: Any, timeout: float | None, *, serialize: bool = True,
                 digest: int = 0, problem: str | None = None, status: int = _frame.INVALID,
                 on_digest_mismatch: Callable[[], None] | None = None, slot_size: int | None = None,
                 inline: bytes | None = None, carries: bool = False, stat: Op | None = None) -> None:
        self.op, self.root, self.obj, self.timeout = op, root, obj, timeout
        if not serialize:  # (only what differs from the class's defaults is set)
            self.serialize = False
        if digest:
            self.digest = digest
        if problem is not None:
            self.problem, self.status = problem, status
        if on_digest_mismatch is not None:
            self.on_digest_mismatch = on_digest_mismatch
        if slot_size is not None:
            self.slot_size = slot_size
        if inline is not None:
            self.inline = inline
        if carries:
            self.carries = True
        if stat is not None:
            self.stat = stat

    @property
    def counted_as(self) -> Op:
        """The op whose counters this call adds to."""
        return self.op if self.stat is None else self.stat

