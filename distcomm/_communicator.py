"""The Communicator base class: the object pipeline, written once for every transport.

A collective runs in up to three steps, the same on every rank:

1. Every rank serializes its object into segments and all-gathers one fixed-size *slot*: a header
   (op, sequence number, root, status, digest), the sizes of its segments, and in small worlds the
   segments that fit (small objects are then done in one round trip). Every rank now knows every
   rank's sizes, failures and what it called, so all ranks take the same decision: raise the same
   error, or go on. Small worlds exchange ``slot_bytes`` slots in one step; larger ones exchange
   64-byte header slots: the torch transports in native gathers and broadcasts over blocks of ranks
   (the machines, or rank 0 and runs of sqrt(world) ranks; a broadcast's payload from rank 0 of up
   to a few hundred bytes rides in the summary they end with), the test doubles with Bruck's
   all-gather (log2(world) messages per rank).
2. Segments that did not fit move into buffers of their exact size, sent from the sender's own
   memory. Nobody pads to the largest rank; a rank that needs nothing gets nothing. Who sends what
   to whom is computed per op in closed form, O(world): all_gather and gather in one all-to-all when
   that costs no copy or only small ones (every rank decides alike, from the slots), else point to
   point; broadcast down a split binary tree in pipelined chunks; scatter as a slot per receiver with
   that receiver's part only (in small worlds, the root's slot in step 1 itself; beyond, after it, of
   one size the root announces, holding small parts whole: the one bounded padding, see
   ``_scatter_slot_size``), then the part if it didn't fit.
3. Each receiver deserializes; out-of-band buffers become the results' memory. Python's cyclic
   garbage collector waits while large results load.

Subclasses only move bytes: ``_exchange`` (point to point), ``_reduce_tensor``, and optionally
native forms of the pipeline's moves, whose defaults go through ``_exchange``: ``_exchange_slots``
(the first exchange; the torch transports' header exchange beyond small worlds),
``_allgather_small`` (the small-world slot exchange), ``_alltoallv`` (an all-to-all),
``_broadcast_buffer``, ``_scatter_slots``, the tensor collectives' ``_tensor_*`` and
``_device_barrier``. The in-process test world implements the same, so unit tests run this very code.
"""

from __future__ import annotations

import abc
import contextlib
import datetime
import functools
import gc
import hashlib
import math
import os
import struct
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal, NamedTuple, TypeVar

import numpy as np
import torch

from . import _frame
from ._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CommunicatorStateError,
    FrameError,
    PayloadTooLargeError,
    SerializationError,
)
from ._ops import FoldError, fold_objects, fold_tensors, object_op, tensor_op, tensor_problem
from ._serialization import _CUDA_TARGET, Serializer, default_serializer, failure_text

__all__ = ["DEFAULT_TIMEOUT", "Communicator", "OpStats"]

DEFAULT_TIMEOUT = 600.0
"""Seconds a collective waits for its peers unless told otherwise."""

DEFAULT_SLOT_BYTES = 4096

_T = TypeVar("_T", bound="Communicator")


class Op(IntEnum):
    SETUP = 1
    BARRIER = 2
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

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {op: op.name.lower() for op in Op}

# The members the per-call path compares against, as module names: reading an attribute of an
# enum class costs several times a global lookup on Python 3.11, and small collectives are
# dominated by such per-call Python work.
_ALL_GATHER, _GATHER, _BROADCAST, _SCATTER, _KEYS, _SETUP = (
    Op.ALL_GATHER, Op.GATHER, Op.BROADCAST, Op.SCATTER, Op.KEYS, Op.SETUP)

# How each op's objects travel: like an all_gather, a gather to the root, a broadcast from it, or a
# scatter from it. The slot carries the op itself, so ranks that call different ops still disagree.
_ROUTE = {op: _ALL_GATHER for op in Op}
_ROUTE.update({Op.GATHER: _GATHER, Op.REDUCE_OBJECT: _GATHER, Op.ALL_REDUCE_OBJECT: _GATHER, Op.SCAN: _GATHER,
               Op.EXSCAN: _GATHER, Op.BROADCAST: _BROADCAST, Op.RESULT: _BROADCAST,
               Op.SHARED_RANDOM_SEED: _BROADCAST, Op.SCATTER: _SCATTER,
               Op.RESULTS: _SCATTER})


@dataclass
class OpStats:
    """Counters for one kind of collective on one communicator (times in seconds)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    serialize_s: float = 0.0
    transfer_s: float = 0.0
    deserialize_s: float = 0.0


_Seg = tuple[memoryview, bool]
"""A segment this rank received: its bytes, and whether they came inline in a slot (the transport's
buffer, copied before they become a result's memory) or in a buffer of their own."""
_Alike = tuple[int, bytes] | None
"""What a slot exchange learnt of the slots: (k, c), every slot but slot k (-1: none) is c; or None."""


def _mv(t: torch.Tensor) -> memoryview:
    return memoryview(t.numpy())  # type: ignore[arg-type]


@dataclass
class _Plan:
    """What this rank sends and receives in step 2, and the segments it will deserialize."""

    sends: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    recvs: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # point to point only
    # per source rank: its segments, each an inline view or the tensor it is received into
    incoming: dict[int, list[_Seg]] = field(default_factory=dict)
    packed: dict[int, bool] = field(default_factory=dict)
    send_counts: list[int] = field(default_factory=list)  # bytes to / from each rank
    recv_counts: list[int] = field(default_factory=list)
    # set when step 2 runs as one all-to-all: every received segment is a view of it
    recv_buf: torch.Tensor | None = None


class _Slots:
    """The slots of one exchange, decoded on first use: a rank decodes only the slots it reads."""

    def __init__(self, raw: memoryview | bytes, size: int, me: int, mine: _frame.Slot | None) -> None:
        self._raw, self._size = raw, size
        self._done: dict[int, _frame.Slot] = {} if mine is None else {me: mine}

    def totals(self, count: int) -> np.ndarray[Any, Any]:
        """Every slot's total (the bytes of its segments, inline ones included), as int64s: one
        strided view, no decode. For slots that passed agreement (OK, totals not negative)."""
        view: np.ndarray[Any, Any] = np.ndarray((count,), dtype="<i8", buffer=self._raw, offset=_frame.TOTAL_AT,
                                                strides=(self._size,))
        out: np.ndarray[Any, Any] = view.copy()
        return out

    def __getitem__(self, r: int) -> _frame.Slot:
        got = self._done.get(r)
        if got is None:
            try:
                got = self._done[r] = _frame.decode(self._raw[r * self._size : (r + 1) * self._size])
            except FrameError as e:
                raise FrameError(f"slot from rank {r} is corrupt: {e}", ranks=[r]) from e
        return got


def _tree_gather_totals(slots: _Slots, world: int, root: int, limit: int) -> np.ndarray[Any, Any] | None:
    """The slots' totals when a gather goes up the binomial tree (every rank's, and all but the
    root's together, at most ``limit``); None when it goes straight to the root. Each total is
    bounded before they are summed, so forged ones can't wrap the sum past the receivers' checks."""
    totals = slots.totals(world)
    if int(totals.max()) > limit or int(totals.sum()) - int(totals[root]) > limit:
        return None
    return totals


class _Tree(NamedTuple):
    """One rank's place in a broadcast tree, as offsets from the root (v = rank - root)."""

    parent: int | None  # whom this rank's half comes from
    children: list[int]  # whom it forwards its half to
    mates: list[int]  # whom it also sends its half to: they hold the other half
    other: int | None  # whom the other half comes from
    second: bool = False  # this rank's half (from its parent) is the second one


def _broadcast_tree(world: int, v: int, split: bool) -> _Tree:
    """Where rank v (counted from the root) receives and sends a broadcast's bytes.

    ``split=False``: a binary tree (v's parent (v - 1) // 2, children 2v + 1 and 2v + 2), the whole
    payload down every edge; the root sends it twice. ``split=True``: the root sends the first half
    to a binary tree over ranks 1..a and the second half to one over a + 1..world - 1 (a =
    ceil((world - 1) / 2)); then rank i of each tree sends its half to rank i of the other, and the
    first tree's last rank, when it has no counterpart, gets the second half from the second tree's
    last rank (a leaf). The root sends the payload once, no rank sends more than 1.5 times it (and a
    byte, for an odd size), and every rank receives it once.
    """
    if not split or world < 3:
        kids = [c for c in (2 * v + 1, 2 * v + 2) if c < world]
        return _Tree(None if v == 0 else (v - 1) // 2, kids, [], None)
    n = world - 1
    a = (n + 1) // 2
    b = n - a
    if v == 0:
        return _Tree(None, [1, 1 + a], [], None)
    first = v <= a
    start, size = (1, a) if first else (1 + a, b)
    i = v - start
    parent = 0 if i == 0 else start + (i - 1) // 2
    kids = [start + c for c in (2 * i + 1, 2 * i + 2) if c < size]
    if first:
        mate = 1 + a + min(i, b - 1)  # the first tree's unmatched last rank: the second tree's last
        return _Tree(parent, kids, [mate] if i < b else [], mate)
    mates = [1 + i] + ([1 + b] if i == b - 1 and a > b else [])
    return _Tree(parent, kids, mates, 1 + i, second=True)


def _cut(bufs: list[torch.Tensor], lo: int, hi: int, step: int) -> list[torch.Tensor]:
    """Views of bytes [lo, hi) of ``bufs`` laid end to end, in pieces of at most ``step`` bytes."""
    out, pos = [], 0
    for b in bufs:
        n = b.numel()
        start, end = max(lo - pos, 0), min(hi - pos, n)
        for i in range(start, end, step):
            out.append(b[i : min(i + step, end)])
        pos += n
    return out


def _all_to_all_problem(objs: Any, world: int) -> str | None:
    """What is wrong with a rank's all_to_all list (None: nothing); reported on every rank."""
    if objs is None or isinstance(objs, (str, bytes)) or not isinstance(objs, Sequence):
        return f"all_to_all needs a sequence of {world} objects, got {type(objs).__name__}"
    if len(objs) != world:
        return f"all_to_all got {len(objs)} objects for world_size {world}"
    return None


def _seconds(timeout: float | datetime.timedelta | None, default: float | None) -> float | None:
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be seconds (float) or a timedelta, got {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive, finite number of seconds (or None for no limit), got {timeout}")
    return float(timeout)


def _owned_copy(view: memoryview) -> memoryview:
    """A copy of ``view`` in fresh, aligned memory of its own."""
    t = torch.empty(view.nbytes, dtype=torch.uint8)
    out = memoryview(t.numpy())  # type: ignore[arg-type]
    out[:] = _frame.flat(view)
    return out


def _materialized(t: torch.Tensor, fresh: bool = False) -> torch.Tensor:
    """``t`` as a native collective must get it: contiguous, with a conjugate or negative view's
    bit applied (the transports read a view's memory, not its flags: a conj() view would travel
    unconjugated). ``fresh``: a copy even when ``t`` is fit as it is."""
    if t.is_conj() or t.is_neg():
        return t.resolve_conj().resolve_neg().contiguous()  # a new tensor
    if t.is_contiguous() and not fresh:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _is_aligned(view: memoryview) -> bool:
    return view.nbytes == 0 or np.frombuffer(view, dtype=np.uint8).ctypes.data % _frame.ALIGN == 0


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 50


_PHYSICAL_MEMORY = _physical_memory()


def _byte_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over the view's memory (no copy). Read-only memory is only ever sent."""
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        with warnings.catch_warnings():  # torch warns about non-writable memory; the transport only reads it
            warnings.simplefilter("ignore")
            return torch.frombuffer(view, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


class _GCPause:
    """Hold off Python's cyclic garbage collector while large payloads are unpickled.

    Unpickling allocates one container per dict or list in the payload; every 700 of them start a
    collection that walks the young objects, and later the whole heap. For results made of many
    small objects (detections, metrics rows) that is most of the unpickling time. The collector is
    only postponed: it runs as usual once loading ends. Nested and concurrent pauses (threads) are
    counted, so the last one out restores the state found by the first one in.
    """

    _lock = threading.Lock()
    _depth = 0
    _threshold: tuple[int, ...] = (700, 10, 10)

    # It sets the collector's first threshold to 0 (no automatic collections) rather than calling
    # gc.disable(): a gc.disable() or gc.enable() of the user's, from any thread, meanwhile stays as it is.
    def __enter__(self) -> None:
        cls = _GCPause
        with cls._lock:
            if cls._depth == 0:
                cls._threshold = gc.get_threshold()
                gc.set_threshold(0, *cls._threshold[1:])
            cls._depth += 1

    def __exit__(self, *exc: object) -> None:
        cls = _GCPause
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0 and gc.get_threshold()[0] == 0:  # thresholds the user set meanwhile stay
                gc.set_threshold(*cls._threshold)


_GC_PAUSE_BYTES = 16 * 1024
"""Loading what arrived after the slots pauses the collector when that is at least this many bytes."""


def _work_dtype(values: Iterable[Any]) -> torch.dtype:
    """The dtype reduce_dict reduces in: float64, or complex128 when there are complex values."""
    return torch.complex128 if any(isinstance(v, torch.Tensor) and v.is_complex() for v in values) else torch.float64


def _digest(value: Any) -> int:
    """An 8-byte digest of ``repr(value)``, compared across ranks in the first exchange."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little")


def _dict_problem(input_dict: Mapping[Any, Any]) -> tuple[list[Any], str | None]:
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


def _dict_signature(d: Mapping[Any, Any]) -> tuple[list[Any], list[tuple[int, ...]], torch.dtype]:
    """reduce_dict's sorted keys, each value's shape, and the dtype every rank reduces in."""
    names = sorted(d)
    return names, [tuple(torch.as_tensor(d[k]).shape) for k in names], _work_dtype(d.values())


def _reduce_digest(names: Sequence[Any], shapes: Sequence[tuple[int, ...]], work_dtype: torch.dtype) -> int:
    """The digest of reduce_dict's keys, shapes and reduce dtype, compared across ranks."""
    return _digest([*zip(names, shapes, strict=True), ("reduce dtype", str(work_dtype))])


_I64 = struct.Struct("<q")


def _odd_ones(values: Sequence[Any]) -> list[int]:
    """The ranks whose value differs from the one most ranks have (the lowest rank's among equals)."""
    usual = max(values, key=values.count)
    return [r for r, v in enumerate(values) if v != usual]
_NOTHING = contextlib.nullcontext()


def _tensor_fields(op: Op, tensor: Any, rop: str | None, problem: str | None) -> tuple[int, bytes]:
    """A tensor collective's check: the digest of what must match across ranks, and the 8 bytes
    that may differ (all_gather_tensor's first dimension)."""
    if problem is not None:
        return 0, bytes(8)
    shape = tuple(tensor.shape)
    if op is Op.ALL_GATHER_TENSOR:
        return _tensor_digest(tensor.dtype, shape[1:], rop), _I64.pack(shape[0] if shape else 1)
    return _tensor_digest(tensor.dtype, shape, rop), _ZERO_WORD


_ZERO_WORD = bytes(8)


@functools.lru_cache(maxsize=256)
def _tensor_digest(dtype: torch.dtype, shape: tuple[int, ...], rop: str | None) -> int:
    return _digest((str(dtype), shape, rop))


class _AllGather(torch.autograd.Function):
    """all_gather_tensor with a backward pass: the result's gradient summed across ranks, this rank's rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, rows: list[int],
                timeout: float | None) -> torch.Tensor:
        ctx.comm, ctx.rows, ctx.timeout = comm, rows, timeout
        return comm._gathered(x, rows, timeout)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        comm, rows = ctx.comm, ctx.rows
        total = grad.contiguous().clone()
        # a collective of its own (recorded by FakeCommunicator, its peers asked as for any all_reduce);
        # unchecked: every rank's gradient has the forward result's shape
        comm.all_reduce(total, "sum", check=False, timeout=ctx.timeout)
        start = sum(rows[: comm.rank])
        return total[start : start + rows[comm.rank]], None, None, None


class MainProcessFlag(int):
    """``comm.is_main_process``: 1 (True) or 0 (False), printed as True or False, and callable.

    ``if comm.is_main_process:`` and ``if comm.is_main_process():`` both work; ``bool(flag)`` is a
    plain bool (``flag is True`` is not: it's an int, like True itself is).
    """

    def __call__(self) -> bool:
        return bool(self)

    def __reduce__(self) -> tuple[type[bool], tuple[bool]]:
        return bool, (bool(self),)  # travels as a plain bool (SafeSerializer loads it)

    def __repr__(self) -> str:
        return repr(bool(self))

    __str__ = __repr__


_MAIN, _NOT_MAIN = MainProcessFlag(1), MainProcessFlag(0)


class Communicator(abc.ABC):
    """Everything a job's processes say to each other, behind one object.

    Every collective must be called by every rank of the communicator, in the same order.
    Objects are anything picklable (lambdas and local classes through cloudpickle). A rank's own
    entry in a result is its own object, not a copy.

    Args:
        timeout: seconds (or a timedelta) each collective waits for its peers; each call can
            override it. A peer that doesn't arrive in time raises CollectiveTimeoutError.
        serializer: how objects become bytes; default PickleSerializer, or SafeSerializer when
            the environment variable DISTCOMM_SERIALIZER=safe.
        max_bytes: refuse payloads over this many bytes on any rank (PayloadTooLargeError on
            every rank, raised before anything large is allocated).
        slot_bytes: size of each rank's first-exchange slot; objects that fit finish in one round.
        receive_cuda_on: where tensors that were on a CUDA device when sent are rebuilt:
            "device" (this rank's CUDA device when it has one, else CPU) or "cpu".
    """

    # In a world of one, collectives return at once without serializing (LocalCommunicator); the
    # fake sets this False to run the whole pipeline at every world size.
    _alone = True

    # Step 2 runs as one all-to-all unless a rank would have to copy more than this many bytes to
    # line up its sends, or any rank sends or receives more than the max: then point to point.
    _alltoall_copy_bytes = 1 << 20
    _alltoall_max_bytes = (1 << 31) - 1

    def __init__(
        self,
        *,
        timeout: float | datetime.timedelta | None = None,
        serializer: Serializer | None = None,
        max_bytes: int | None = None,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        receive_cuda_on: Literal["device", "cpu"] = "device",
    ) -> None:
        self._timeout = _seconds(timeout, DEFAULT_TIMEOUT)
        if serializer is None:
            serializer = default_serializer()
        if not isinstance(serializer, Serializer):
            raise TypeError(f"serializer must be a distcomm.Serializer, got {type(serializer).__name__}")
        self.serializer = serializer
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        if not isinstance(slot_bytes, int) or slot_bytes < _frame.MIN_SLOT:
            raise ValueError(f"slot_bytes must be an int >= {_frame.MIN_SLOT}, got {slot_bytes!r}")
        self.slot_bytes = slot_bytes
        if receive_cuda_on not in ("device", "cpu"):
            raise ValueError(f"receive_cuda_on must be 'device' or 'cpu', got {receive_cuda_on!r}")
        self.receive_cuda_on = receive_cuda_on
        self._seq = 0
        self._pid = os.getpid()
        self._closed = False
        self._broken: str | None = None
        self._stats: dict[str, OpStats] = {}
        self._cur = OpStats()  # the counters of the collective in progress
        self._op_label = "setup"  # its name, for errors the transport raises
        # communicators over other groups that the module helpers' group= argument asked for
        self._children: dict[Any, Communicator] = {}
        self._local = (0, 1)  # (local rank, local size)
        self._busy = threading.Lock()  # held while a collective runs: one at a time, from one thread
        self._busy_thread = 0
        # where the user called the collective in progress (file, line), and the last one that returned
        self._site: tuple[str, int] = ("", 0)
        self._done: tuple[str, int, tuple[str, int]] | None = None
        self._raised: tuple[str, int | None, tuple[str, int], str] | None = None  # the last call, if it raised

    # ------------------------------------------------------------------ identity
    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's rank in the communicator, in [0, world_size)."""

    @property
    @abc.abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the communicator."""

    @property
    def local_rank(self) -> int:
        """This process's rank among the ranks on its machine."""
        return self._local[0]

    @property
    def local_size(self) -> int:
        """Number of ranks on this process's machine."""
        return self._local[1]

    @property
    def group(self) -> Any:
        """The torch process group of this communicator's ranks (None where there is none)."""
        return None

    @property
    def local_group(self) -> Any:
        """The torch process group of the ranks on this machine (None where there is none)."""
        return None

    def create_local_groups(self, num_workers_per_machine: int) -> None:
        """Regroup ranks by machine as ``rank // num_workers_per_machine``, for processes started
        without launch() or torchrun, where host names don't tell machines apart.

        Collective: every rank must call it with the same number, which must divide world_size.
        ``local_rank``, ``local_size`` and ``local_group`` then follow the new grouping.
        """
        n = num_workers_per_machine
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_workers_per_machine must be an int >= 1, got {n!r}")
        if self.world_size % n:
            raise ValueError(f"num_workers_per_machine={n} does not divide world_size {self.world_size}")
        self._check_usable()
        if self.world_size > 1 or not self._alone:  # every rank must regroup alike: compare first
            asked = self._run(Op.CREATE_LOCAL_GROUPS, -1, n, self._timeout)
            if len(set(asked)) > 1:
                rows = "\n".join(f"  rank {r}: {a}" for r, a in enumerate(asked))
                raise CollectiveMismatchError(f"create_local_groups: the ranks passed different numbers:\n{rows}",
                                              op="create_local_groups", ranks=_odd_ones(asked))
        self._set_machines([list(range(m, m + n)) for m in range(0, self.world_size, n)])

    def _set_machines(self, machines: list[list[int]]) -> None:
        """Take ``machines`` (the ranks of each machine, in order) as the local grouping."""
        mine = next(m for m in machines if self.rank in m)
        self._local = (mine.index(self.rank), len(mine))

    @property
    def is_main_process(self) -> MainProcessFlag:
        """True on rank 0: a bool-like flag that can also be called, so that ``comm.is_main_process``
        and ``comm.is_main_process()`` (the module helper's spelling) both work."""
        return _MAIN if self.rank == 0 else _NOT_MAIN

    @property
    def device(self) -> torch.device:
        """The device this communicator's tensor collectives use (CPU unless NCCL)."""
        return torch.device("cpu")

    @property
    def timeout(self) -> float | None:
        """Default seconds a collective waits for its peers."""
        return self._timeout

    @property
    def stats(self) -> dict[str, OpStats]:
        """Counters per collective (calls, bytes, seconds per step): a snapshot."""
        return {k: OpStats(**vars(v)) for k, v in self._stats.items()}

    def reset_stats(self) -> None:
        """Zero the counters."""
        self._stats.clear()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, {state})"

    # ------------------------------------------------------------------ transport primitives
    @abc.abstractmethod
    def _exchange(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], timeout: float | None
    ) -> None:
        """Send each (dst, tensor) and receive each (src, tensor) concurrently, in list order per pair."""

    def _alltoallv(
        self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor, recv_counts: list[int],
        timeout: float | None,
    ) -> None:
        """Send ``send_counts[r]`` bytes of ``send`` (chunks in rank order) to each rank r; receive
        ``recv_counts[r]`` bytes from each rank r into ``recv``, in rank order. Every rank calls it.

        This default moves each chunk point to point through ``_exchange``; transports with a
        native all-to-all override it.
        """
        sends, recvs = [], []
        out = inp = 0
        for r in range(self.world_size):
            if send_counts[r]:
                sends.append((r, send[out : out + send_counts[r]]))
                out += send_counts[r]
            if recv_counts[r]:
                recvs.append((r, recv[inp : inp + recv_counts[r]]))
                inp += recv_counts[r]
        self._exchange(sends, recvs, timeout)

    @abc.abstractmethod
    def _reduce_tensor(self, tensor: torch.Tensor, dst: int | None, timeout: float | None) -> None:
        """Sum ``tensor`` in place across ranks, onto ``dst`` (None: onto every rank)."""

    def _device_barrier(self, timeout: float | None) -> None:  # noqa: B027 - optional hook
        """Wait for the device streams too (NCCL); nothing on CPU transports."""

    def _shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources (groups this communicator created)."""

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release what this communicator created. Idempotent. Not collective by itself."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() == self._pid:
            for child in self._children.values():
                child.close()
            self._children.clear()
            self._shutdown()

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise CommunicatorStateError(
                f"{type(self).__name__} was created in process {self._pid} and can't be used in "
                f"forked process {os.getpid()}: create a communicator in each process"
            )
        if self._closed:
            raise CommunicatorStateError(f"{type(self).__name__} is closed")
        if self._broken is not None:
            raise CommunicatorStateError(
                f"{type(self).__name__} can't be used after an earlier transport failure "
                f"({self._broken}); its ranks no longer agree on what was sent"
            )

    def _alone_error(self, op: Op, problem: str) -> CollectiveError:
        """The error a world of one raises for a rank's bad input: what every rank raises in larger worlds."""
        return CollectiveError(f"{op.label} failed on rank 0:\n  rank 0: {problem}", op=op.label, ranks=[0])

    def _mark_broken(self, why: str) -> None:
        if self._broken is None:  # the first failure is the one worth naming
            self._broken = why

    def _op_timeout(self, timeout: float | datetime.timedelta | None) -> float | None:
        return _seconds(timeout, self._timeout)

    def _check_root(self, name: str, root: int) -> None:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise TypeError(f"{name} must be an int rank, got {type(root).__name__}")
        if not 0 <= root < self.world_size:
            raise ValueError(f"{name}={root} is out of range for world_size {self.world_size}")

    def _settings(self) -> dict[str, Any]:
        """The settings every rank of a communicator must share."""
        return {"slot_bytes": self.slot_bytes, "max_bytes": self.max_bytes,
                "serializer": type(self.serializer).__name__}

    def _check_settings(self, everyone: list[dict[str, Any]]) -> None:
        """Raise the same error on every rank when the ranks' settings differ."""
        for name in everyone[0]:
            values = [s.get(name) for s in everyone]
            if len(set(map(repr, values))) > 1:
                rows = "\n".join(f"  rank {r}: {name}={v!r}" for r, v in enumerate(values))
                raise CollectiveMismatchError(
                    f"the ranks created their communicators with different {name}; every rank must pass "
                    f"the same:\n{rows}", op="setup",
                    ranks=[r for r, v in enumerate(values) if repr(v) != repr(values[0])])

    def _stat(self, op: Op) -> OpStats:
        st = self._stats.get(op.label)
        if st is None:
            st = self._stats[op.label] = OpStats()
        return st

    # ------------------------------------------------------------------ public collectives
    def synchronize(self, timeout: float | datetime.timedelta | None = None) -> None:
        """Wait until every rank has called it (a barrier). Every rank must call it."""
        self._check_usable()
        t = self._op_timeout(timeout)
        if self.world_size == 1 and self._alone:
            return
        self._run(Op.BARRIER, -1, None, t, serialize=False)
        self._device_barrier(t)

    def all_gather(self, obj: Any, *, timeout: float | datetime.timedelta | None = None) -> list[Any]:
        """Collect one object from every rank, on every rank.

        Every rank must call it. Returns a list indexed by rank; this rank's entry is ``obj``
        itself. Objects travel over CPU (CUDA tensors inside are copied to CPU and rebuilt on the
        receiver's device).
        """
        self._check_usable()
        t = self._op_timeout(timeout)
        if self.world_size == 1 and self._alone:
            return [obj]
        return self._run(Op.ALL_GATHER, -1, obj, t)

    def gather(self, obj: Any, dst: int = 0, *, timeout: float | datetime.timedelta | None = None) -> list[Any]:
        """Collect one object from every rank on ``dst``.

        Every rank must call it. Returns the list indexed by rank on ``dst`` and ``[]`` elsewhere.
        Ranks other than dst send from their object's own memory and allocate nothing large.
        """
        self._check_usable()
        self._check_root("dst", dst)
        t = self._op_timeout(timeout)
        if self.world_size == 1 and self._alone:
            return [obj]
        out = self._run(Op.GATHER, int(dst), obj, t)
        return out if self.rank == dst else []

    def broadcast(self, obj: Any = None, src: int = 0, *, timeout: float | datetime.timedelta | None = None) -> Any:
        """Send ``obj`` from ``src`` to every rank; returns it everywhere (on src: obj itself).

        Every rank must call it; ``obj`` is read on ``src`` only.
        """
        self._check_usable()
        self._check_root("src", src)
        t = self._op_timeout(timeout)
        if self.world_size == 1 and self._alone:
            return obj
        out = self._run(Op.BROADCAST, int(src), obj, t)
        return out[int(src)]

    def scatter(
        self, objs: Sequence[Any] | None = None, src: int = 0, *, timeout: float | datetime.timedelta | None = None
    ) -> Any:
        """Send ``objs[r]`` from ``src`` to rank r; returns this rank's object.

        Every rank must call it; ``objs`` is read on ``src`` only and must hold world_size objects
        there (otherwise every rank raises CollectiveError).
        """
        self._check_usable()
        self._check_root("src", src)
        t = self._op_timeout(timeout)
        src = int(src)
        if self.rank == src:
            problem = None
            if objs is None or isinstance(objs, (str, bytes)) or not isinstance(objs, Sequence):
                problem = (f"scatter on src {src} needs a sequence of {self.world_size} objects, "
                           f"got {type(objs).__name__}")
            elif len(objs) != self.world_size:
                problem = f"scatter on src {src} got {len(objs)} objects for world_size {self.world_size}"
            if self.world_size == 1 and self._alone:
                if problem:
                    raise self._alone_error(Op.SCATTER, problem)
                assert objs is not None
                return objs[0]
            out = self._run(Op.SCATTER, src, objs, t, invalid=problem)
        else:
            out = self._run(Op.SCATTER, src, objs, t)  # objs is not read off src (FakeCommunicator may)
        return out[self.rank]

    def shared_random_seed(self, *, timeout: float | datetime.timedelta | None = None) -> int:
        """An int in [0, 2**31) that is the same on every rank (drawn by rank 0 from numpy's RNG)."""
        self._check_usable()
        t = self._op_timeout(timeout)
        seed = int(np.random.randint(2**31))
        if self.world_size == 1 and self._alone:
            return seed
        return int(self._run(Op.SHARED_RANDOM_SEED, 0, seed, t)[0])

    def reduce_dict(
        self, input_dict: Mapping[Any, torch.Tensor], average: bool = True, *,
        timeout: float | datetime.timedelta | None = None,
    ) -> dict[Any, torch.Tensor]:
        """Sum (or average) a dict of tensors onto rank 0, element-wise, in one collective.

        Every rank must call it with the same keys, and each key's tensor with the same shape on
        every rank (any shape; scalars are the usual case). Rank 0 gets the reduced dict (keys
        sorted); other ranks get their input back unchanged. Key sets or shapes that differ raise
        CollectiveMismatchError on every rank, naming the keys and ranks.
        """
        return self._reduce_dict(input_dict, average, 0, timeout)

    def all_reduce_dict(
        self, input_dict: Mapping[Any, torch.Tensor], average: bool = True, *,
        timeout: float | datetime.timedelta | None = None,
    ) -> dict[Any, torch.Tensor]:
        """Like reduce_dict, but every rank gets the reduced dict."""
        return self._reduce_dict(input_dict, average, None, timeout)

    # ------------------------------------------------------------------ tensor collectives
    # Every rank must pass a tensor of the same dtype and shape (all_gather_tensor: beyond the first
    # dimension). With check=True (the default) the ranks first compare them in one small exchange,
    # and every rank raises the same error, naming the ranks, instead of hanging or reducing
    # mismatched memory. check=False skips that exchange for hot loops: then nothing compares dtypes,
    # shapes, reduce ops or roots across ranks, and all_gather_tensor takes every rank's first
    # dimension to be this rank's. Only all_gather_tensor takes part in autograd.
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", *, check: bool = True,
                   timeout: float | datetime.timedelta | None = None) -> torch.Tensor:
        """Reduce ``tensor`` across ranks, in place on every rank; returns it.

        ``op``: "sum", "mean", "min", "max" or "prod". Every rank must call it.
        """
        rop = tensor_op(op)
        if check is False and timeout is None:
            out = self._lane(Op.ALL_REDUCE, -1, tensor, rop)
            if out is not None:
                return out
        return self._tensor_op(Op.ALL_REDUCE, -1, tensor, rop, check, timeout)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: str = "sum", *, check: bool = True,
               timeout: float | datetime.timedelta | None = None) -> torch.Tensor:
        """Reduce ``tensor`` across ranks onto ``dst``, in place there; returns it.

        Other ranks' tensors are left as they were. Every rank must call it.
        """
        self._check_root("dst", dst)
        return self._tensor_op(Op.REDUCE, int(dst), tensor, tensor_op(op), check, timeout)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0, *, check: bool = True,
                         timeout: float | datetime.timedelta | None = None) -> torch.Tensor:
        """Copy ``src``'s tensor into every rank's ``tensor`` (same dtype and shape); returns it."""
        self._check_root("src", src)
        if check is False and timeout is None:
            out = self._lane(Op.BROADCAST_TENSOR, int(src), tensor, None)
            if out is not None:
                return out
        return self._tensor_op(Op.BROADCAST_TENSOR, int(src), tensor, None, check, timeout)

    def all_gather_tensor(self, tensor: torch.Tensor, *, check: bool = True,
                          timeout: float | datetime.timedelta | None = None) -> torch.Tensor:
        """Every rank's tensor concatenated along dim 0, in rank order, on every rank.

        The first dimension may differ between ranks (with check=True); the rest and the dtype must
        match. A 0-d tensor counts as one row. Differentiable: the gradient of the result is summed
        across ranks and each rank gets its own rows', so every rank must run the backward pass.
        """
        if check is False and timeout is None:
            out = self._lane(Op.ALL_GATHER_TENSOR, -1, tensor, None)
            if out is not None:
                return out
        return self._tensor_op(Op.ALL_GATHER_TENSOR, -1, tensor, None, check, timeout)

    def reduce_scatter_tensor(self, tensor: torch.Tensor, op: str = "sum", *, check: bool = True,
                              timeout: float | datetime.timedelta | None = None) -> torch.Tensor:
        """Reduce ``tensor`` (dim 0 of world_size x n) across ranks; rank r gets the r-th n-slice."""
        return self._tensor_op(Op.REDUCE_SCATTER_TENSOR, -1, tensor, tensor_op(op), check, timeout)

    def _device_problem(self, tensor: torch.Tensor) -> str | None:
        """Why this transport can't take ``tensor``'s device (None: it can)."""
        return None

    def _lane(self, op: Op, root: int, tensor: torch.Tensor, rop: str | None) -> torch.Tensor | None:
        """An unchecked all_reduce, broadcast_tensor or all_gather_tensor (check=False, the default
        timeout) in the fewest Python calls the transport allows: the hot path of training loops.
        It must do exactly what ``_tensor_op`` does (results, stats); None sends the call there.
        This default always does: the test doubles run ``_tensor_op``."""
        return None

    def _tensor_input_problem(self, op: Op, tensor: Any, rop: str | None) -> str | None:
        """What is wrong with a rank's tensor for ``op`` (None: nothing); reported on every rank."""
        problem = tensor_problem(tensor, rop)
        if problem is None:
            problem = self._device_problem(tensor)
        world = self.world_size
        if problem is None and op is Op.REDUCE_SCATTER_TENSOR and (tensor.dim() == 0 or tensor.shape[0] % world):
            problem = f"dim 0 must be a multiple of world_size {world}, got shape {tuple(tensor.shape)}"
        return problem

    def _tensor_op(self, op: Op, root: int, tensor: torch.Tensor, rop: str | None, check: bool,
                   timeout: float | datetime.timedelta | None) -> torch.Tensor:
        self._check_usable()
        if not isinstance(check, bool):
            raise TypeError(f"check must be a bool, got {type(check).__name__}")
        t = self._op_timeout(timeout)
        world = self.world_size
        problem = self._tensor_input_problem(op, tensor, rop)
        if problem is not None:
            if not check:
                raise (TypeError if not isinstance(tensor, torch.Tensor) else ValueError)(f"{op.label}: {problem}")
            if world == 1 and self._alone:
                raise self._alone_error(op, problem)
        gathering = op is Op.ALL_GATHER_TENSOR
        x = tensor.reshape(1) if gathering and problem is None and tensor.dim() == 0 else tensor
        if world == 1 and self._alone:
            return x.clone() if gathering or op is Op.REDUCE_SCATTER_TENSOR else tensor
        st = self._stat(op)
        t0 = time.perf_counter()
        if check:
            counts = self._tensor_check(op, root, tensor, rop, problem, t)
        else:
            st.calls += 1
            self._cur = st
            self._op_label = op.label
            counts = None
        t1 = time.perf_counter()
        if tensor.requires_grad:  # the collectives don't record autograd (all_gather_tensor's own Function does)
            differentiable = gathering and torch.is_grad_enabled()
            with torch.no_grad():
                out = self._tensor_move(op, root, tensor, x, rop, counts, t, st, differentiable)
        else:
            out = self._tensor_move(op, root, tensor, x, rop, counts, t, st, False)
        st.serialize_s += t1 - t0
        st.transfer_s += time.perf_counter() - t1
        return out

    def _tensor_move(self, op: Op, root: int, tensor: torch.Tensor, x: torch.Tensor, rop: str | None,
                     counts: Any, t: float | None, st: OpStats, differentiable: bool) -> torch.Tensor:
        """The transfer of a tensor collective whose inputs are checked (or unchecked by request)."""
        world = self.world_size
        nbytes = x.numel() * x.element_size()
        if op is Op.ALL_GATHER_TENSOR:
            rows = [int(n) for n in counts] if counts is not None else [x.shape[0]] * world
            moved = sum(rows) * (nbytes // max(x.shape[0], 1)) - nbytes  # a ring's share: everyone else's rows
            st.bytes_sent += moved
            st.bytes_received += moved
            if differentiable:
                with torch.enable_grad():
                    out: torch.Tensor = _AllGather.apply(x, self, rows, t)  # type: ignore[no-untyped-call]
                return out
            return self._gathered(x, rows, t)
        if op is Op.REDUCE_SCATTER_TENSOR:
            assert rop is not None
            self._count(nbytes * (world - 1) // world, nbytes * (world - 1) // world)
            out = torch.empty((x.shape[0] // world, *x.shape[1:]), dtype=x.dtype, device=x.device)
            self._tensor_reduce_scatter(out, _materialized(x), rop, t)
            if rop == "mean":
                out.div_(world)
            return out
        receiver = op is not Op.REDUCE or self.rank == root
        work = _materialized(tensor, fresh=not receiver)
        if op is Op.BROADCAST_TENSOR:
            if self.rank == root:
                st.bytes_sent += nbytes
            else:
                st.bytes_received += nbytes
            self._tensor_broadcast(work, root, t)
        else:
            assert rop is not None
            moved = 2 * (world - 1) * nbytes // world
            st.bytes_sent += moved
            st.bytes_received += moved
            self._tensor_reduce(work, None if op is Op.ALL_REDUCE else root, rop, t)
            if rop == "mean" and receiver:
                work.div_(world)
        if receiver and work is not tensor:
            tensor.copy_(work)
        return tensor

    def _gathered(self, x: torch.Tensor, rows: list[int], timeout: float | None) -> torch.Tensor:
        out = x.new_empty((sum(rows), *x.shape[1:]))
        self._tensor_all_gather(out, _materialized(x), rows, timeout)
        return out

    def _tensor_check(self, op: Op, root: int, tensor: torch.Tensor, rop: str | None, problem: str | None,
                      timeout: float | None) -> Any:
        """Compare the ranks' dtypes, shapes and reduce ops in one exchange; all_gather_tensor's
        first dimensions ride along (returned, per rank)."""
        digest, inline = _tensor_fields(op, tensor, rop, problem)
        return self._run(op, root, tensor, timeout, serialize=False, digest=digest, invalid=problem,
                         inline=inline, on_digest_mismatch=lambda: self._tensor_mismatch(op, tensor, rop, timeout))

    def _tensor_mismatch(self, op: Op, tensor: torch.Tensor, rop: str | None, timeout: float | None) -> None:
        infos = self._run(Op.TENSOR_INFO, -1, (str(tensor.dtype), tuple(tensor.shape), rop), timeout, stat=op)
        gathering = op is Op.ALL_GATHER_TENSOR

        def key(info: tuple[str, tuple[int, ...], str | None]) -> Any:
            return (info[0], tuple(info[1])[1:], info[2]) if gathering else info

        odd = _odd_ones([key(info) for info in infos])
        rows = "\n".join(f"  rank {r}: {dtype} {tuple(shape)}" + (f" op={o!r}" if o else "")
                         for r, (dtype, shape, o) in enumerate(infos))
        what = ("dtype and shape beyond the first dimension" if gathering else
                "dtype, shape and op" if rop else "dtype and shape")
        raise CollectiveMismatchError(
            f"{op.label}: the ranks' tensors differ; every rank must pass the same {what}:\n{rows}",
            op=op.label, ranks=odd)

    # The tensor transport. These defaults move every rank's tensor to every rank through
    # ``_gather_tensors`` (the test doubles' way); torch communicators run the native collectives.
    def _gather_tensors(self, tensor: torch.Tensor, timeout: float | None) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order (this rank's own included)."""
        raise NotImplementedError(f"{type(self).__name__} has no tensor transport")

    def _same_tensors(self, values: list[torch.Tensor], mine: torch.Tensor, rows: bool = False) -> list[torch.Tensor]:
        """Refuse what a real transport can't combine (only reachable with check=False)."""
        for r, v in enumerate(values):
            if v.dtype != mine.dtype or (v.shape[1:] if rows else v.shape) != (mine.shape[1:] if rows else mine.shape):
                raise CollectiveError(
                    f"rank {r}'s tensor ({v.dtype}, {tuple(v.shape)}) doesn't match this rank's ({mine.dtype}, "
                    f"{tuple(mine.shape)}); with check=False the transport fails (or hangs) on this", ranks=[r])
        return values

    def _tensor_reduce(self, tensor: torch.Tensor, dst: int | None, op: str, timeout: float | None) -> None:
        """Reduce ``tensor`` in place onto ``dst`` (None: every rank); "mean" sums."""
        values = self._same_tensors(self._gather_tensors(tensor, timeout), tensor)
        if dst is None or dst == self.rank:
            tensor.copy_(fold_tensors(values, op))

    def _tensor_broadcast(self, tensor: torch.Tensor, src: int, timeout: float | None) -> None:
        values = self._same_tensors(self._gather_tensors(tensor, timeout), tensor)
        tensor.copy_(values[src])

    def _tensor_all_gather(self, out: torch.Tensor, tensor: torch.Tensor, rows: list[int],
                           timeout: float | None) -> None:
        values = self._same_tensors(self._gather_tensors(tensor, timeout), tensor, rows=True)
        if [v.shape[0] for v in values] != rows:
            raise CollectiveError(f"the ranks' first dimensions are {[v.shape[0] for v in values]}, this rank expected "
                                  f"{rows}; with check=False every rank's must equal this rank's")
        torch.cat(values, out=out)

    def _tensor_reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: str, timeout: float | None) -> None:
        values = self._same_tensors(self._gather_tensors(tensor, timeout), tensor)
        out.copy_(fold_tensors(values, op).chunk(self.world_size)[self.rank])

    # ------------------------------------------------------------------ object reductions
    def reduce_object(self, obj: Any, op: str | Callable[[Any, Any], Any], dst: int = 0, *,
                      timeout: float | datetime.timedelta | None = None) -> Any:
        """Reduce every rank's object onto ``dst`` in rank order: ``op(op(obj_0, obj_1), obj_2)``...

        ``op``: a callable ``op(a, b)``, or "sum", "min", "max", "any", "all", "union" (sets and
        dicts). Returns the result on ``dst`` and None elsewhere. If ``op`` raises, every rank
        raises the same CollectiveError naming the rank whose object it failed on.
        """
        name, fn = object_op(op)
        self._check_root("dst", dst)
        return self._reduce_objects(Op.REDUCE_OBJECT, obj, name, fn, int(dst), timeout)

    def all_reduce_object(self, obj: Any, op: str | Callable[[Any, Any], Any], *,
                          timeout: float | datetime.timedelta | None = None) -> Any:
        """Like reduce_object, with the result on every rank ("did any rank see NaN?": op="any")."""
        name, fn = object_op(op)
        return self._reduce_objects(Op.ALL_REDUCE_OBJECT, obj, name, fn, 0, timeout)

    def scan(self, obj: Any, op: str | Callable[[Any, Any], Any], *,
             timeout: float | datetime.timedelta | None = None) -> Any:
        """Inclusive prefix reduction: rank r gets the reduction of ranks 0..r's objects, in rank order."""
        name, fn = object_op(op)
        return self._reduce_objects(Op.SCAN, obj, name, fn, 0, timeout)

    def exscan(self, obj: Any, op: str | Callable[[Any, Any], Any], *,
               timeout: float | datetime.timedelta | None = None) -> Any:
        """Exclusive prefix reduction: rank r gets the reduction of ranks 0..r-1's objects; rank 0 gets None."""
        name, fn = object_op(op)
        return self._reduce_objects(Op.EXSCAN, obj, name, fn, 0, timeout)

    def _reduce_objects(self, op: Op, obj: Any, name: str, fn: Callable[[Any, Any], Any], root: int,
                        timeout: float | datetime.timedelta | None) -> Any:
        # The objects are gathered on the root, which folds them in rank order and sends each rank
        # its outcome: the result, or the fold's error so that every rank raises it.
        self._check_usable()
        t = self._op_timeout(timeout)
        if self.world_size == 1 and self._alone:
            if op is Op.EXSCAN:
                return None
            return bool(obj) if name in ("any", "all") else obj  # the type a fold of two would give
        objs = self._run(op, root, obj, t)
        prefix = op is Op.SCAN or op is Op.EXSCAN
        payload = self._fold_payload(op, objs, name, fn, root) if self.rank == root else None
        mine = payload
        if op is Op.REDUCE_OBJECT and payload is not None and payload[0]:
            payload = (True, None)  # the others only need to know that it worked
        if prefix:
            outcome = self._run(Op.RESULTS, root, payload, t, stat=op)[self.rank]
        else:
            outcome = self._run(Op.RESULT, root, payload, t, stat=op)[root]
            if self.rank == root:
                outcome = mine
        ok, value = outcome
        if not ok:
            text, bad = value
            raise CollectiveError(text, op=op.label, ranks=[bad])
        return None if op is Op.REDUCE_OBJECT and self.rank != root else value

    def _fold_payload(self, op: Op, objs: list[Any], name: str, fn: Callable[[Any, Any], Any], root: int) -> Any:
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

    # ------------------------------------------------------------------ all_to_all
    def all_to_all(self, objs: Sequence[Any], *, timeout: float | datetime.timedelta | None = None) -> list[Any]:
        """Send ``objs[d]`` to rank d; returns the list of what each rank sent this one, by source.

        Every rank must call it with world_size objects. This rank's own entry is ``objs[rank]``
        itself. Each object travels from its sender straight to its receiver, out of band where large.
        """
        self._check_usable()
        t = self._op_timeout(timeout)
        world, me = self.world_size, self.rank
        problem = _all_to_all_problem(objs, world)
        if world == 1 and self._alone:
            if problem:
                raise self._alone_error(Op.ALL_TO_ALL, problem)
            return [objs[0]]
        t0 = time.perf_counter()
        status, segments, lengths = _frame.INVALID, [], [0] * world
        if problem is None:
            try:  # each object's segments, packed below straight into the one send buffer
                segments = [[] if d == me else self.serializer.dumps(o) for d, o in enumerate(objs)]
                lengths = [0 if d == me else _frame.packed_size(segs) for d, segs in enumerate(segments)]
                status = _frame.OK
            except Exception as e:  # reported on every rank
                sent = [None if d == me else o for d, o in enumerate(objs)]  # this rank's own entry stays here
                status, problem = _frame.SERIALIZE_FAILED, failure_text(self.serializer, sent, e, "objs")
        if status == _frame.OK and (over := self._over_max_bytes(sum(lengths))) is not None:
            status, problem = _frame.TOO_LARGE, over
        self._run(Op.ALL_TO_ALL, -1, objs, t, serialize=False, invalid=problem, invalid_status=status)
        st = self._cur
        t1 = time.perf_counter()
        seq = self._seq
        try:
            # the sizes first: 8 bytes to and from each peer (chunks lie back to back, in rank order)
            counts = [0 if d == me else 8 for d in range(world)]
            sizes = torch.tensor([n for d, n in enumerate(lengths) if d != me], dtype=torch.int64)
            theirs = torch.zeros(world - 1, dtype=torch.int64)
            self._count(8 * (world - 1), 8 * (world - 1))
            self._alltoallv(sizes.view(torch.uint8), counts, theirs.view(torch.uint8), counts, t)
            got = theirs.tolist()
            got.insert(me, 0)
            for src, n in enumerate(got):
                if n < 0:
                    raise FrameError(f"all_to_all #{seq}: rank {src} announced {n} bytes", op="all_to_all",
                                     ranks=[src])
                self._check_receivable(n, src, "all_to_all")
            send = torch.zeros(sum(lengths), dtype=torch.uint8)  # one copy of what this rank sends
            send_view, at = _mv(send), 0
            for d, segs in enumerate(segments):
                if d != me:
                    _frame.pack_into(send_view[at : at + lengths[d]], segs)
                    at += lengths[d]
            del segments  # the streams, now copied
            recv = torch.empty(sum(got), dtype=torch.uint8)
            self._count(send.numel(), recv.numel())
            self._alltoallv(send, lengths, recv, got, t)
        except BaseException as e:
            self._mark_broken(f"all_to_all #{seq}: {type(e).__name__} while moving data: {str(e)[:160]}")
            raise
        t2 = time.perf_counter()
        out: list[Any] = [None] * world
        out[me] = objs[me]
        view, at = _mv(recv), 0
        with _GCPause() if recv.numel() >= _GC_PAUSE_BYTES else _NOTHING:
            for src, n in enumerate(got):
                if src != me:
                    out[src] = self._load(Op.ALL_TO_ALL, seq, src, [(view[at : at + n], False)], True)
                    at += n
        st.serialize_s += t1 - t0
        st.transfer_s += t2 - t1
        st.deserialize_s += time.perf_counter() - t2
        return out

    # ------------------------------------------------------------------ sub-communicators
    def split(self, color: int | None, key: int | None = None, *,
              timeout: float | datetime.timedelta | None = None) -> Communicator | None:
        """A communicator over the ranks that pass the same ``color`` (an int >= 0); None for None.

        Collective: every rank calls it. The new ranks are ordered by ``key`` (default: this
        rank), which must order them as their ranks here do: torch orders a process group's ranks
        by global rank, so every communicator keeps that order. The new communicator is of this
        communicator's class and settings, over a group created now; this communicator owns it and
        closes it (closing it earlier is fine).
        """
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ValueError(f"color must be an int >= 0 or None, got {color!r}")
        if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
            raise TypeError(f"key must be an int or None, got {type(key).__name__}")
        return self._split(color, self.rank if key is None else key, None, timeout)

    def new_group(self, ranks: Sequence[int], *,
                  timeout: float | datetime.timedelta | None = None) -> Communicator | None:
        """A communicator over ``ranks`` (of this communicator), ordered by rank; None off them.

        Collective: every rank of this communicator calls it with the same ranks.
        """
        if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
            raise TypeError(f"ranks must be a sequence of ints, got {type(ranks).__name__}")
        members = []
        for r in ranks:
            if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
                raise TypeError(f"ranks must be ints, got {type(r).__name__}")
            if not 0 <= r < self.world_size:
                raise ValueError(f"rank {r} is out of range for world_size {self.world_size}")
            members.append(int(r))
        if len(set(members)) != len(members) or not members:
            raise ValueError(f"ranks must be distinct and not empty, got {list(ranks)}")
        members.sort()
        return self._split(0 if self.rank in members else None, self.rank, tuple(members), timeout)

    def _split(self, color: int | None, key: int, agree: tuple[int, ...] | None,
               timeout: float | datetime.timedelta | None) -> Communicator | None:
        self._check_usable()
        t = self._op_timeout(timeout)
        asked = (color, key, agree)
        infos = [asked] if self.world_size == 1 and self._alone else self._run(Op.SPLIT, -1, asked, t)
        label = "new_group" if agree is not None else "split"
        if len({repr(a) for _, _, a in infos}) > 1:
            rows = "\n".join(f"  rank {r}: {list(a) if a is not None else 'split'}"
                             for r, (_, _, a) in enumerate(infos))
            raise CollectiveMismatchError(f"{label}: the ranks asked for different groups:\n{rows}", op=label,
                                          ranks=_odd_ones([a for _, _, a in infos]))
        groups: dict[int, list[int]] = {}
        for r, (c, _, _) in enumerate(infos):
            if c is not None:
                groups.setdefault(c, []).append(r)
        for c, members in groups.items():
            keys = [infos[r][1] for r in members]
            if keys != sorted(keys):
                raise CollectiveError(
                    f"{label}: the keys of color {c} order its ranks {sorted(members, key=lambda r: infos[r][1])}, "
                    f"not by rank; a torch process group orders its ranks by global rank, so the keys must too",
                    op=label, ranks=members)
        ordered = [groups[c] for c in sorted(groups)]
        mine = next((m for m in ordered if self.rank in m), None)
        sub = self._make_sub(ordered, mine, t)
        for k in [k for k, c in self._children.items() if c._closed]:  # closed ones are let go
            del self._children[k]
        if sub is not None:
            self._children[("sub", self._seq, id(sub))] = sub
        return sub

    def _sub_settings(self, timeout: float | None) -> dict[str, Any]:
        return {"timeout": timeout, "serializer": self.serializer, "max_bytes": self.max_bytes,
                "slot_bytes": self.slot_bytes, "receive_cuda_on": self.receive_cuda_on}

    def _make_sub(self, groups: list[list[int]], mine: list[int] | None, timeout: float | None) -> Communicator | None:
        """Create a communicator for each group (every rank, the same order); return this rank's."""
        raise NotImplementedError(f"{type(self).__name__} can't create sub-communicators")

    # ------------------------------------------------------------------ reduce_dict
    def _reduce_dict(
        self, input_dict: Mapping[Any, torch.Tensor], average: bool, dst: int | None,
        timeout: float | datetime.timedelta | None,
    ) -> dict[Any, torch.Tensor]:
        self._check_usable()
        if not isinstance(input_dict, Mapping):
            raise TypeError(f"reduce_dict needs a dict of tensors, got {type(input_dict).__name__}")
        if not isinstance(average, bool):
            raise TypeError(f"average must be a bool, got {type(average).__name__}")
        t = self._op_timeout(timeout)
        op = Op.REDUCE_DICT if dst is not None else Op.ALL_REDUCE_DICT
        names, problem = _dict_problem(input_dict)
        if self.world_size == 1 and self._alone:
            if problem:
                raise self._alone_error(op, problem)
            return {k: input_dict[k] for k in names}
        # Every rank reduces in the same dtype whatever its values' dtypes (float64, exact for float32
        # and for integers below 2**53; complex128 when the dicts hold complex values), and the
        # digest that the first exchange compares covers the keys, their shapes and that choice.
        shapes: list[tuple[int, ...]] = []
        work_dtype, digest = torch.float64, 0  # with a problem every rank raises before the digests count
        if problem is None:
            names, shapes, work_dtype = _dict_signature(input_dict)
            digest = _reduce_digest(names, shapes, work_dtype)
        self._run(op, -1 if dst is None else dst, None, t, serialize=False, digest=digest, invalid=problem,
                  on_digest_mismatch=lambda: self._key_mismatch(names, shapes, work_dtype, t))
        if not names:
            return {}
        with torch.no_grad():
            flat = [input_dict[k].detach().reshape(-1).to(work_dtype) for k in names]
            values = flat[0].clone() if len(flat) == 1 else torch.cat(flat)
            orig = values.device
            work = values.to(self.device) if values.device != self.device else values
            st = self._stat(op)
            t0 = time.perf_counter()
            # what a ring reduction moves per rank: 2 (world - 1) / world of the values, each way
            moved = 2 * (self.world_size - 1) * work.numel() * work.element_size() // self.world_size
            self._count(moved, moved)
            self._reduce_tensor(work, dst, t)
            st.transfer_s += time.perf_counter() - t0
            if dst is not None and self.rank != dst:
                return dict(input_dict)
            if average:
                work /= self.world_size
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

    def _key_mismatch(self, names: list[Any], shapes: list[tuple[int, ...]], work_dtype: torch.dtype,
                      timeout: float | None) -> None:
        infos = self._run(Op.KEYS, -1, ([repr(k) for k in names], shapes, str(work_dtype)), timeout,
                          stat=Op.REDUCE_DICT)
        everyone = [keys for keys, _, _ in infos]
        kinds = [kind for _, _, kind in infos]
        if len(set(kinds)) > 1:
            complex_ranks = [r for r, kind in enumerate(kinds) if "complex" in kind]
            raise CollectiveMismatchError(
                f"reduce_dict: ranks {complex_ranks} have complex values and the others don't; "
                f"every rank must pass the same kinds of values", op="reduce_dict", ranks=complex_ranks)
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
            op="reduce_dict", ranks=_odd_ones([[t[k] for k in odd_keys] for t in table]),
        )

    # ------------------------------------------------------------------ the pipeline
    @property
    def _slot_size(self) -> int:
        """The first exchange's slot: ``slot_bytes`` in small worlds, a bare header slot beyond."""
        return self.slot_bytes if self.world_size <= _frame.SMALL_WORLD else _frame.HEADER_SLOT

    def _serialize_local(
        self, op: Op, root: int, obj: Any, rank: int | None = None
    ) -> tuple[list[list[memoryview]], int, str]:
        """Segments per part, plus a status and message when the rank can't take part."""
        rank = self.rank if rank is None else rank
        op = _ROUTE[op]
        try:
            if op is _SCATTER:
                if rank != root:
                    return [], _frame.OK, ""
                return [
                    [] if r == root else self.serializer.dumps(o) for r, o in enumerate(obj)
                ], _frame.OK, ""
            if op is _BROADCAST and rank != root:
                return [], _frame.OK, ""
            return [self.serializer.dumps(obj)], _frame.OK, ""
        except Exception as e:  # any failure of user objects' pickling is reported on every rank
            if op is _SCATTER:
                return [], _frame.SERIALIZE_FAILED, failure_text(self.serializer, list(obj), e, "objs")
            return [], _frame.SERIALIZE_FAILED, failure_text(self.serializer, obj, e)

    def _over_max_bytes(self, total: int) -> str | None:
        """Why a rank's payload of ``total`` bytes can't be sent (None: it can); reported on every rank."""
        if self.max_bytes is not None and total > self.max_bytes:
            return f"payload of {total} bytes is over max_bytes={self.max_bytes}"
        return None

    def _build_slot(
        self, op: Op, seq: int, root: int, digest: int, parts: list[list[memoryview]], size: int
    ) -> tuple[bytearray, list[list[memoryview]], _frame.Slot]:
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

    def _run(
        self,
        op: Op,
        root: int,
        obj: Any,
        timeout: float | None,
        *,
        serialize: bool = True,
        digest: int = 0,
        invalid: str | None = None,
        invalid_status: int = _frame.INVALID,
        on_digest_mismatch: Callable[[], None] | None = None,
        slot_size: int | None = None,
        inline: bytes | None = None,
        stat: Op | None = None,
    ) -> list[Any]:
        """Run one collective; returns a list indexed by rank (entries this rank did not get: None).

        ``inline``: with ``serialize=False``, 8 bytes every rank carries in its slot; the call then
        returns every rank's 8 bytes as an int64. ``stat``: count this call under that op.
        """
        st = self._stat(op if stat is None else stat)
        self._op_label = (op if stat is None else stat).label
        kind = _ROUTE[op]
        t0 = time.perf_counter()
        size = self._slot_size if slot_size is None else slot_size
        parts: list[list[memoryview]] = []
        status, message = _frame.OK, ""
        if invalid is not None:
            status, message = invalid_status, invalid
        elif serialize:
            parts, status, message = self._serialize_local(op, root, obj)
            # set-up precedes agreement on max_bytes
            if status == _frame.OK and op is not _SETUP and self.max_bytes is not None:
                over = self._over_max_bytes(sum(s.nbytes for p in parts for s in p))
                if over is not None:
                    status, message = _frame.TOO_LARGE, over
        # Counted only now: an interrupt while pickling (KeyboardInterrupt) leaves this rank as if it
        # had never called, instead of one call ahead of its peers.
        elif inline is not None:
            parts = [[memoryview(inline)]]
        self._seq += 1
        seq = self._seq
        if stat is None:
            st.calls += 1
        self._cur = st
        subs: list[bytearray] = []
        part_slot = size  # scatter: the size of the slot of each rank's part (the root's to choose)
        tables: list[list[tuple[int, memoryview | None]]] = []  # how each of my parts travels
        if status == _frame.OK and kind is _SCATTER and self.rank == root:
            # each receiver gets a slot of its own part: nobody receives a table of every part
            part_slot = self._scatter_slot_size(parts, root, size)
            built = [self._build_slot(op, seq, root, digest, [p], part_slot) for p in parts]
            subs, parts = [s for s, _, _ in built], [p[0] for _, p, _ in built]
            status, message = self._scatter_slots_problem([d for _, _, d in built])
            tables = [d.parts[0] if d.parts else [] for _, _, d in built]
        if status != _frame.OK:
            slot = _frame.encode_status(status, op, seq, root, message, size)
            mine = _frame.decode(slot)
        elif kind is _SCATTER:
            slot, mine = self._scatter_head(op, seq, root, digest, part_slot, size)
        else:
            slot, parts, mine = self._build_slot(op, seq, root, digest, parts, size)
            tables = mine.parts
        t1 = time.perf_counter()
        st.serialize_s += t1 - t0

        carry: list[memoryview] = []  # a broadcast root's segments that follow its slot (see _exchange_slots)
        if kind is _BROADCAST and self.rank == root and status == _frame.OK and mine.later:
            carry = [seg for seg, (_, inline) in zip(parts[0], tables[0], strict=True) if inline is None]
        # in small worlds a scatter's root sends each rank the slot of its part in the first exchange
        own = subs if kind is _SCATTER and status == _frame.OK and self.world_size <= _frame.SMALL_WORLD else []
        raw, alike = self._exchange_slots(slot, size, timeout, carry, own)
        slots = _Slots(raw, size, self.rank, mine)
        # max_bytes caps serialized payloads (set-up precedes agreement on it; inline words aren't payloads)
        cap = self.max_bytes if serialize and op is not _SETUP else None
        # the common case in a few comparisons; anything else goes through the full check, which names it.
        # Where the exchange didn't say which slots are alike (``alike``): the slot every rank but ``odd``
        # sends when all is well, where it is known, to compare the slots with as bytes
        common: bytes | bytearray | None = None
        odd = -1
        if alike is None and (kind is _BROADCAST or kind is _SCATTER) and status == _frame.OK:
            common = slot if self.rank != root else _frame.encode(op, seq, root, digest, [], size)
            odd = root
        elif alike is None and not serialize and inline is None:
            common = slot
        if not _frame.agreed(raw, self.world_size, size, slot, digests=on_digest_mismatch is not None, cap=cap,
                             common=common, odd=odd, alike=alike):
            try:
                heads = _frame.headers(raw, self.world_size, size)
            except FrameError as e:
                raise FrameError(f"{op.label} #{seq}: a slot is corrupt: {e}", op=op.label) from e
            self._agree(op, seq, root, heads, slots, message, timeout, cap)
            if on_digest_mismatch is not None and (heads["digest"] != heads["digest"][0]).any():
                on_digest_mismatch()
        if not serialize:
            st.transfer_s += time.perf_counter() - t1
            return [] if inline is None else list(_frame.inline_words(raw, self.world_size, size).tolist())

        try:
            incoming, packed = self._step2(op, kind, seq, root, parts, tables, slots, subs, size, timeout)
        except BaseException as e:
            # Whatever stops this rank here (a corrupt table only it decodes, memory, Ctrl-C) leaves
            # its peers mid-transfer: the ranks no longer agree on what was sent.
            self._mark_broken(f"{op.label} #{seq}: {type(e).__name__} while moving data: {str(e)[:160]}")
            raise
        t2 = time.perf_counter()
        st.transfer_s += t2 - t1

        results: list[Any] = [None] * self.world_size
        if kind is _SCATTER:
            results[self.rank] = obj[self.rank] if self.rank == root else None
        elif kind is not _BROADCAST or self.rank == root:
            results[self.rank] = obj
        if incoming:  # a broadcast's or scatter's root loads nothing
            token = _CUDA_TARGET.set(self._cuda_target)
            try:
                received = sum([view.nbytes for v in incoming.values() for view, _ in v])
                if received >= _GC_PAUSE_BYTES:
                    with _GCPause():
                        self._load_all(op, seq, incoming, packed, results)
                else:
                    self._load_all(op, seq, incoming, packed, results)
            finally:
                _CUDA_TARGET.reset(token)
        st.deserialize_s += time.perf_counter() - t2
        return results

    def _step2(
        self, op: Op, kind: Op, seq: int, root: int, parts: list[list[memoryview]],
        tables: list[list[tuple[int, memoryview | None]]], slots: _Slots, subs: list[bytearray], size: int,
        timeout: float | None,
    ) -> tuple[dict[int, list[_Seg]], dict[int, bool]]:
        """Move what didn't fit the slots; returns the segments received, per source, and which were packed.

        ``kind`` is how ``op``'s objects travel (see ``_ROUTE``)."""
        if kind is _BROADCAST:
            head = slots[root]
            got = self._tree_broadcast(root, head, parts, timeout)
            return ({root: got} if self.rank != root else {}), {root: bool(head.header.flags & _frame.PACKED)}
        if kind is _GATHER and self.world_size > _frame.SMALL_WORLD:
            totals = _tree_gather_totals(slots, self.world_size, root, self._TREE_GATHER_BYTES)
            if totals is not None:
                return self._tree_gather(op, root, parts, slots, totals, timeout)
        if kind is _SCATTER and self.world_size <= _frame.SMALL_WORLD:  # the root's slot was this rank's own
            slots = _Slots(b"", size, 0, None if self.rank == root else slots[root])
        elif kind is _SCATTER:
            slots = self._deliver_scatter_slots(op, seq, root, subs, size, timeout, slots)
        plan = self._plan(kind, root, parts, tables, slots)
        if plan.recv_buf is not None:
            sends = [t for _, t in plan.sends]
            send = sends[0] if len(sends) == 1 else torch.cat(sends) if sends else torch.empty(0, dtype=torch.uint8)
            self._count(sum(plan.send_counts), sum(plan.recv_counts))
            self._alltoallv(send, plan.send_counts, plan.recv_buf, plan.recv_counts, timeout)
        elif plan.sends or plan.recvs:
            self._xchg(plan.sends, plan.recvs, timeout)
        return plan.incoming, plan.packed

    # ------------------------------------------------------------------ moving bytes, counted
    def _count(self, sent: int, received: int) -> None:
        st = self._cur
        st.bytes_sent += sent
        st.bytes_received += received

    def _xchg(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], timeout: float | None
    ) -> None:
        """``_exchange``, with what it moves added to this op's counters."""
        self._count(sum(t.numel() for _, t in sends), sum(t.numel() for _, t in recvs))
        self._exchange(sends, recvs, timeout)

    def _exchange_slots(self, slot: bytearray, size: int, timeout: float | None,
                        carry: Sequence[memoryview] = (), own: Sequence[bytearray] = ()) -> tuple[memoryview, _Alike]:
        """The pipeline's first exchange: every rank's slot (``_allgather_slots``), and what the
        exchange learnt of how alike they are, for ``_frame.agreed``: (k, c), every slot but slot k
        (-1: none) is c, byte for byte; None where it learnt nothing (this default).

        ``carry``: on a broadcast's root, the segments that follow its slot. A transport whose
        exchange ends in a broadcast from the root may send them with it (``_carried`` says where
        they went); this default doesn't.
        ``own``: in small worlds, on a scatter's root, the slot of each rank's part: rank r receives
        ``own[r]`` where the others receive ``slot``."""
        return self._allgather_slots(slot, size, timeout, own), None

    def _carried(self, root: int, total: int) -> memoryview | None:
        """The ``total`` bytes of ``root``'s broadcast segments where the last ``_exchange_slots``
        brought them along (a view that lasts until the next exchange), on every rank the same
        answer; None: they weren't, and go in ``_broadcast_buffer``. This default carries nothing."""
        return None

    def _allgather_slots(self, slot: bytearray, size: int, timeout: float | None,
                         own: Sequence[bytearray] = ()) -> memoryview:
        """Every rank's slot of ``size`` bytes, in rank order, flat (``own``: see ``_exchange_slots``).

        Small worlds use the transport's one-step exchange (``_allgather_small``). Larger ones run
        Bruck's all-gather over point to point: ceil(log2(world)) rounds, in round k each rank sends
        the slots it holds to rank - k and receives as many from rank + k. Every rank sends and
        receives (world - 1) slots in log2(world) messages, where an all-to-all takes world - 1.
        (The test doubles run this; the torch transports gather the slots in native collectives.)
        """
        world, me = self.world_size, self.rank
        if world <= _frame.SMALL_WORLD:
            self._count(size * (world - 1), size * (world - 1))
            return self._allgather_small(slot, size, timeout, own)
        if own:
            raise ValueError(f"slots of each rank's own are sent in worlds of up to {_frame.SMALL_WORLD} ranks")
        buf = torch.empty(world * size, dtype=torch.uint8)  # block j holds rank (me + j) % world
        view = memoryview(buf.numpy())  # type: ignore[arg-type]
        view[:size] = slot

        have = 1
        while have < world:
            n = min(have, world - have)
            self._xchg([((me - have) % world, buf[: n * size])],
                       [((me + have) % world, buf[have * size : (have + n) * size])], timeout)
            have += n
        first = (world - me) % world * size  # where rank 0's slot is
        return memoryview(bytes(view[first:]) + bytes(view[:first]))

    def _allgather_small(self, slot: bytearray, size: int, timeout: float | None,
                         own: Sequence[bytearray] = ()) -> memoryview:
        """The small-world slot exchange (``own``: see ``_exchange_slots``); this default sends the
        slot to every peer point to point."""
        world, me = self.world_size, self.rank
        out = torch.empty(world * size, dtype=torch.uint8)
        view = memoryview(out.numpy())  # type: ignore[arg-type]
        view[me * size : (me + 1) * size] = slot
        mine = torch.frombuffer(bytearray(slot), dtype=torch.uint8)
        peers = [r for r in range(world) if r != me]
        sends = [(r, torch.frombuffer(own[r], dtype=torch.uint8) if own else mine) for r in peers]
        self._exchange(sends, [(r, out[r * size : (r + 1) * size]) for r in peers], timeout)
        return view

    _SCATTER_SLOT_MAX = 4 << 10
    """The most a scatter's per-rank slot holds beyond small worlds (also at most ``slot_bytes``)."""

    def _scatter_slot_cap(self) -> int:
        return min(self.slot_bytes, self._SCATTER_SLOT_MAX)

    def _scatter_slot_size(self, parts: list[list[memoryview]], root: int, size: int) -> int:
        """The size of the slot a scatter's root sends each rank. Beyond small worlds: large enough to
        hold whole (table and bytes, rounded up to 8) as many parts as it can, up to the largest that
        fits in ``_scatter_slot_cap`` (and ``max_bytes``), so that small parts reach their ranks in
        that one message (one native scatter on gloo) — but no larger than keeps what the root sends
        in those slots within twice the bytes of the parts they hold: a few large parts among many
        small ones travel after their slots instead of padding every rank's. ``size`` (the header
        slot's, announced by nothing) when no size over it qualifies."""
        if self.world_size <= _frame.SMALL_WORLD:
            return size
        cap = self._scatter_slot_cap()
        if self.max_bytes is not None:
            cap = min(cap, self.max_bytes)
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
            if (self.world_size - 1) * n <= 2 * held + (self.world_size - 1) * table:
                return n
            held -= n
        return size

    def _scatter_slots_problem(self, decoded: list[_frame.Slot]) -> tuple[int, str]:
        """What a scatter's root reports of the slots of its parts (``decoded``): a status and a
        message (OK, ""). A part as it travels (packed, when its table doesn't fit its slot) is what
        its receiver checks against max_bytes: refused here, so that every rank refuses it."""
        bad = next((d.message for d in decoded if d.header.status), None)
        if bad is not None:
            return _frame.INVALID, bad
        over = self._over_max_bytes(max((d.header.total for d in decoded), default=0))
        if over is not None:
            return _frame.TOO_LARGE, f"a part as it travels: {over}"
        return _frame.OK, ""

    @staticmethod
    def _scatter_head(op: Op, seq: int, root: int, digest: int, sub: int, size: int) -> tuple[bytearray, _frame.Slot]:
        """A scatter's header slot, and the slot as decoded: the root's announces the size ``sub`` of
        the slot each rank then receives from it, as one segment that travels later, where it is
        over ``size``."""
        if sub > size:
            slot = _frame.encode_later(op, seq, root, digest, sub, size)
            return slot, _frame.decode(slot)
        return _frame.encode_slot(op, seq, root, digest, [], size)

    def _announced_slot_size(self, op: Op, seq: int, root: int, head: _frame.Slot, size: int) -> int:
        """The size of the slot this rank receives from scatter's root, as the root's header slot
        ``head`` announced it: ``size``, or over it and at most ``_scatter_slot_cap`` (the same
        check on every rank, before anything is allocated)."""
        if not head.parts:
            return size
        entries = head.parts[0] if len(head.parts) == 1 else []
        if len(entries) != 1 or entries[0][1] is not None:
            raise FrameError(f"{op.label} #{seq}: rank {root}'s header slot doesn't announce the size of the slot "
                             f"of each rank's part (one segment that travels later)", op=op.label, ranks=[root])
        n, cap = entries[0][0], self._scatter_slot_cap()
        if not size < n <= cap:
            raise FrameError(f"{op.label} #{seq}: rank {root} announced a slot of {n} bytes for each rank's part "
                             f"(this communicator's are over {size} and at most {cap} bytes)", op=op.label,
                             ranks=[root])
        return n

    def _deliver_scatter_slots(
        self, op: Op, seq: int, root: int, subs: list[bytearray], size: int, timeout: float | None, slots: _Slots
    ) -> _Slots:
        """Scatter's second exchange beyond small worlds: the root sends each rank the slot of its
        own part only, of the size its header slot announced (``_scatter_slot_size``)."""
        size = len(subs[root]) if self.rank == root else self._announced_slot_size(op, seq, root, slots[root], size)
        buf = self._scatter_slots(root, subs, size, timeout)
        if buf is None:
            return _Slots(b"", size, 0, None)
        try:
            sub = _frame.decode(memoryview(buf.numpy()))  # type: ignore[arg-type]
        except FrameError as e:
            raise FrameError(f"{op.label} #{seq}: the slot of this rank's part from rank {root} is corrupt: {e}",
                             op=op.label, ranks=[root]) from e
        if (sub.header.op, sub.header.seq, sub.header.root, sub.header.status) != (op, seq, root, _frame.OK):
            raise FrameError(f"{op.label} #{seq}: rank {root} sent a slot for another call", op=op.label,
                             ranks=[root])
        return _Slots(b"", size, 0, sub)

    def _scatter_slots(self, root: int, subs: list[bytearray], size: int, timeout: float | None) -> torch.Tensor | None:
        """The root's ``subs[r]`` (``size`` bytes each) to each rank r: here a message per rank.
        Returns what this rank received (None on the root)."""
        if self.rank == root:
            self._xchg([(r, torch.frombuffer(s, dtype=torch.uint8)) for r, s in enumerate(subs) if r != root],
                       [], timeout)
            return None
        buf = torch.empty(size, dtype=torch.uint8)
        self._xchg([], [(root, buf)], timeout)
        return buf

    _TREE_CHUNK = 4 << 20
    _TREE_MAX_CHUNKS = 16
    _BCAST_ONE_BUFFER = 64 << 10
    """Broadcasts whose bytes after the slots are at most this many travel as one buffer, in one
    ``_broadcast_buffer`` call: a native broadcast where the transport has one (its tree runs in C++,
    and its root sends log2(world) copies, at most 640 KiB at 1,024 ranks). Larger ones go down
    ``_tree_send``'s split tree, whose root sends one copy."""

    def _tree_broadcast(
        self, root: int, slot: _frame.Slot, parts: list[list[memoryview]], timeout: float | None
    ) -> list[_Seg]:
        """Move the root's segments that didn't fit its slot to every rank; returns this rank's
        segments (receivers: inline views and received buffers; the root: nothing it needs)."""
        if not slot.parts:
            raise FrameError(f"broadcast: rank {root} sent no parts", op="broadcast", ranks=[root])
        entries = slot.parts[0]
        total = slot.later if len(slot.parts) == 1 else sum(n for n, inline in entries if inline is None)
        me = self.rank
        if me == root:
            if not total or self._carried(root, total) is not None:  # nothing follows, or it went with the slots
                return []
            later = [_byte_tensor(parts[0][i]) for i, (_, inline) in enumerate(entries) if inline is None]
            if total > self._BCAST_ONE_BUFFER:
                self._tree_send(later, root, timeout)
            else:
                self._broadcast_buffer(later[0] if len(later) == 1 else torch.cat(later), root, timeout)
            return []
        if total > self._BCAST_ONE_BUFFER:  # exact-size buffers of their own, down the binary tree
            for n, inline in entries:
                if inline is None:
                    self._check_receivable(n, root, "broadcast")
            bufs = [torch.empty(n, dtype=torch.uint8) for n, inline in entries if inline is None]
            self._tree_send(bufs, root, timeout)
            it = iter(bufs)
            return [(inline, True) if inline is not None else (_mv(next(it)), False) for _, inline in entries]
        if not total:
            return [(inline, True) for _, inline in entries if inline is not None]
        # one buffer for the segments that follow the slot; a pickle stream alone (no out-of-band
        # buffers, which land in torch's aligned memory; a packed segment holds them) in a bytearray,
        # which is cheaper to make and view. ``view`` exports it for as long as a segment lives, so
        # nothing can resize it under the tensor (torch.frombuffer holds a reference, not an export).
        if len(entries) == 1 and not slot.header.flags & _frame.PACKED:
            mem = bytearray(total)
            buf, view = torch.frombuffer(mem, dtype=torch.uint8), memoryview(mem)
        else:
            buf = torch.empty(total, dtype=torch.uint8)
            view = _mv(buf)
        carried = self._carried(root, total)
        if carried is None:
            self._broadcast_buffer(buf, root, timeout)
        else:  # copied out of the exchange's buffers, which the next call reuses
            view[:] = carried
        pos, segs = 0, []
        for n, inline in entries:
            if inline is not None:
                segs.append((inline, True))
            else:
                segs.append((view[pos : pos + n], False))
                pos += n
        return segs

    def _broadcast_buffer(self, buf: torch.Tensor, root: int, timeout: float | None) -> None:
        """Copy the root's ``buf`` into every rank's (every rank's is the same size). Here a binary
        tree of point-to-point messages; transports with a native broadcast use it instead."""
        self._tree_send([buf], root, timeout)

    def _tree_send(self, bufs: list[torch.Tensor], root: int, timeout: float | None) -> None:
        """Send the root's ``bufs`` into every rank's down a tree, in pipelined chunks.

        Payloads over ``_BCAST_ONE_BUFFER`` split in two halves, each down a binary tree of half the
        ranks, and the two trees then swap halves rank by rank (see ``_broadcast_tree``): the root
        sends the payload once and no rank more than 1.5 times (and a byte). Smaller ones go down one
        binary tree.
        A chunk is forwarded while the next one arrives.
        """
        world = self.world_size
        v = (self.rank - root) % world
        total = sum(b.numel() for b in bufs)
        split = total > self._BCAST_ONE_BUFFER and world > 2
        tree = _broadcast_tree(world, v, split)
        step = max(self._TREE_CHUNK, _frame.aligned(-(-total // self._TREE_MAX_CHUNKS)))
        half = total // 2 if split else total
        first, second = _cut(bufs, 0, half, step), _cut(bufs, half, total, step)
        if v == 0:  # the root: half to each tree (split), or all of it to each child; a chunk per step,
            peers = [(c + root) % world for c in tree.children]  # each step within the timeout
            routes = [(peers[0], first), (peers[1], second)] if split else [(p, first) for p in peers]
            for i in range(max(len(first), len(second))):
                self._xchg([(p, chunks[i]) for p, chunks in routes if i < len(chunks)], [], timeout)
            return
        mine, other = (second, first) if tree.second else (first, second)
        ranks = [(c + root) % world for c in (*tree.children, *tree.mates)]
        parent = ((tree.parent or 0) + root) % world
        source = None if tree.other is None else (tree.other + root) % world
        for i in range(max(len(mine), len(other)) + 1):  # receive chunk i while chunk i - 1 goes on
            sends = [(r, mine[i - 1]) for r in ranks] if 0 < i <= len(mine) else []
            recvs = [(parent, mine[i])] if i < len(mine) else []
            if source is not None and 0 < i <= len(other):
                recvs.append((source, other[i - 1]))
            if sends or recvs:
                self._xchg(sends, recvs, timeout)

    _TREE_GATHER_BYTES = 256 << 10
    """Gathers beyond SMALL_WORLD ranks whose segments add up to at most this many bytes travel up
    a binomial tree (``_tree_gather``): the root posts log2(world) receives instead of one per
    rank (at 1,024 ranks: 10, not 1,023), and no rank receives or forwards more than this many
    bytes (a dict of 8 floats from each of 1,024 ranks is about 200 KiB). Larger ones go straight
    from each rank to the root, each byte sent once, and the ranks that need nothing receive
    nothing but the slots."""

    def _tree_gather(
        self, op: Op, root: int, parts: list[list[memoryview]], slots: _Slots, totals: np.ndarray[Any, Any],
        timeout: float | None,
    ) -> tuple[dict[int, list[_Seg]], dict[int, bool]]:
        """Move every rank's segments to the root up a binomial tree; returns the root's segments
        per source (views of one receive buffer), or nothing on the other ranks.

        Ranks are numbered from the root (v = rank - root). Rank v's subtree is v up to
        v + lowbit(v), and its children are v + k for the powers of two k < lowbit(v) (the root's:
        every power of two below world). Each rank receives its children's subtrees into one
        buffer, behind its own segments, in rank order, and sends that buffer to its parent
        v - lowbit(v) in one message. Every rank computes the same sizes from the slots' totals
        (each rank's segments, inline ones included), so every buffer has its exact size.
        """
        world, me = self.world_size, self.rank
        v = (me - root) % world
        tables = []  # the root reads every table before it receives anything (a corrupt one is refused)
        for u in range(1, world) if not v else ():
            src = (u + root) % world
            slot = slots[src]
            if len(slot.parts) != 1:
                raise FrameError(f"rank {src} sent {len(slot.parts)} parts, not 1", op=op.label, ranks=[src])
            tables.append((src, slot.parts[0], bool(slot.header.flags & _frame.PACKED)))
        low = v & -v if v else 1 << max(world - 1, 1).bit_length()
        end = min(v + low, world)
        sizes = np.roll(totals, -root)  # by relative rank
        sizes[0] = 0  # the root keeps its own object
        starts = [0, *np.cumsum(sizes[v:end]).tolist()]  # offsets in my buffer, by relative rank - v
        buf = torch.empty(starts[-1], dtype=torch.uint8)
        view = _mv(buf)
        if v:
            pos = 0
            for seg in parts[0]:
                n = seg.nbytes
                view[pos : pos + n] = _frame.flat(seg)
                pos += n
        recvs = []
        k = 1
        while k < low and v + k < world:  # child v + k holds v + k up to v + 2k
            a, b = starts[k], starts[min(2 * k, end - v)]
            if b > a:
                recvs.append(((v + k + root) % world, buf[a:b]))
            k *= 2
        if recvs:
            self._xchg([], recvs, timeout)
        if v:
            if starts[-1]:
                self._xchg([((v - low + root) % world, buf)], [], timeout)
            return {}, {}
        incoming: dict[int, list[_Seg]] = {}
        packed: dict[int, bool] = {}
        for u, (src, entries, was_packed) in enumerate(tables, start=1):
            pos, segs = starts[u], []
            for n, _ in entries:
                segs.append((view[pos : pos + n], False))
                pos += n
            incoming[src] = segs
            packed[src] = was_packed
        return incoming, packed

    def _check_receivable(self, size: int, src: int, label: str) -> None:
        """Refuse, before allocating, a segment larger than this machine's memory.

        Only this receiver makes this check (machines differ), so refusing leaves its peers in
        step 2: the communicator is marked broken. Sizes over ``max_bytes``, which every rank
        shares, are refused alike on every rank by ``_agree``.
        """
        if size > _PHYSICAL_MEMORY:
            why = f"rank {src} announced a segment of {size} bytes, more than this machine's memory"
            self._mark_broken(why)
            raise PayloadTooLargeError(why, op=label, ranks=[src])

    def _load_all(self, op: Op, seq: int, incoming: dict[int, list[_Seg]],
                  packed: dict[int, bool], results: list[Any]) -> None:
        scatter = _ROUTE[op] is _SCATTER
        for src, segs in incoming.items():
            results[self.rank if scatter else src] = self._load(op, seq, src, segs, packed[src])

    def _load(self, op: Op, seq: int, src: int, segs: list[_Seg], packed: bool) -> Any:
        """Deserialize one rank's segments (inline views or received tensors)."""
        # The segments become the results' memory (a serializer may keep them). Those that came
        # inline in the slot are copied out of it: the slot buffers are the transport's, reused by
        # the next call (and may be read-only); out-of-band buffers into aligned memory. Buffers that
        # landed at an unaligned offset of a shared receive buffer are copied too (an all-to-all
        # lands them back to back): every out-of-band buffer starts at a multiple of 64.
        if packed:
            inline = segs[0][1]
            views = _frame.unpack(segs[0][0])
            views[1:] = [_owned_copy(v) if inline or not _is_aligned(v) else v for v in views[1:]]
            if inline:
                views[0] = memoryview(bytearray(views[0]))
        else:
            stream, inline = segs[0]
            views = [memoryview(bytearray(stream)) if inline else stream]
            if len(segs) > 1:
                views += [_owned_copy(v) if inline or not _is_aligned(v) else v for v, inline in segs[1:]]
        try:
            return self.serializer.loads(views)
        except CollectiveError as e:
            e.args = (f"{op.label} #{seq}: can't load the object from rank {src}: {e}",)
            e.op, e.ranks = op.label, (src,)
            raise
        except Exception as e:
            raise SerializationError(
                f"{op.label} #{seq}: can't load the object from rank {src}: {type(e).__name__}: {e}",
                op=op.label, ranks=[src],
            ) from e

    def _cuda_target(self) -> torch.device | None:
        if self.receive_cuda_on == "cpu":
            return None
        if self.device.type == "cuda":
            return self.device
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def _agree(self, op: Op, seq: int, root: int, heads: Any, slots: _Slots, message: str,
               timeout: float | None, cap: int | None) -> None:
        """Raise the same error on every rank when ranks disagree or any rank failed.

        The common case is a few comparisons over the header array; rows are built for errors only.
        """
        # compared with rank 0's (which is this rank's when they all agree): every rank names the same ranks
        first = heads[0]
        same = (heads["op"] == first["op"]) & (heads["seq"] == first["seq"]) & (heads["root"] == first["root"])
        if not same.all():
            # read before the call sites' exchange, which may reuse the buffer that ``heads`` views
            calls = list(zip(heads["op"].tolist(), heads["seq"].tolist(), heads["root"].tolist(), strict=True))
            sites = self._gather_sites(timeout)
            rows = {}
            for r, (hop, hseq, hroot) in enumerate(calls):
                name = Op(hop).label if hop in Op._value2member_map_ else f"op {hop}"
                where = f" root={hroot}" if hroot >= 0 else ""
                rows[r] = f"{name}{where} (call #{hseq}) at {sites[r]}"
            odd = _odd_ones(calls)
            raise CollectiveMismatchError(
                "ranks called different collectives:\n" + _states_table(rows, self.world_size), op=op.label,
                ranks=odd)
        bad = heads["status"] != _frame.OK
        if not bad.any():
            if cap is not None:  # a peer that skipped its check: refused alike
                over = np.flatnonzero(heads["total"] > cap).tolist()
                if over:
                    raise PayloadTooLargeError(
                        f"{op.label} #{seq}: rank{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} "
                        f"announced payloads over max_bytes={self.max_bytes}", op=op.label, ranks=over)
            return
        failed = [(r, slots[r]) for r in np.flatnonzero(bad).tolist()]
        texts = self._full_messages(failed, message, timeout)
        lines = "\n".join(f"  rank {r}: {texts[r]}" for r, _ in failed)
        ranks = [r for r, _ in failed]
        statuses = {s.header.status for _, s in failed}
        what = f"{op.label} #{seq} failed on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}:\n{lines}"
        if statuses == {_frame.TOO_LARGE}:
            raise PayloadTooLargeError(what, op=op.label, ranks=ranks)
        if statuses == {_frame.SERIALIZE_FAILED}:
            raise SerializationError(what, op=op.label, ranks=ranks)
        raise CollectiveError(what, op=op.label, ranks=ranks)

    def _state(self) -> str:
        """What this rank is doing, with the user's call sites, for other ranks' error messages."""
        raised = self._raised
        if self._busy.locked():
            now = f"in {self._op_label} #{self._seq} at {_where(self._site)}"
        elif raised is not None:
            number = "(before its first exchange)" if raised[1] is None else f"#{raised[1]}"
            now = f"{raised[3]} in {raised[0]} {number} at {_where(raised[2])}"
        else:
            now = "not in a collective"
        last = self._done
        return now + ("" if last is None else f" (last returned: {last[0]} #{last[1]} at {_where(last[2])})")

    def _gather_sites(self, timeout: float | None) -> list[str]:
        """Every rank's call site for the call in progress (an error-path exchange, every rank alike)."""
        size = 256
        mine = _where(self._site).encode("utf-8", "replace")[: size - 2]
        slot = bytearray(struct.pack("<H", len(mine)) + mine + bytes(size - 2 - len(mine)))
        flat, _ = self._exchange_slots(slot, size, timeout)
        out = []
        for r in range(self.world_size):
            raw = bytes(flat[r * size : (r + 1) * size])
            (n,) = struct.unpack_from("<H", raw)
            out.append(raw[2 : 2 + min(n, size - 2)].decode("utf-8", "replace"))
        return out

    def _full_messages(self, failed: list[tuple[int, _frame.Slot]], message: str,
                       timeout: float | None) -> dict[int, str]:
        """The failed ranks' messages; those cut short by the slot are sent whole, to every rank."""
        texts = {r: s.message for r, s in failed}
        cut = [(r, s) for r, s in failed if s.later]
        if not cut:
            return texts
        me = self.rank
        sends = []
        if any(r == me for r, _ in cut):
            raw = torch.frombuffer(bytearray(_frame.message_bytes(message)), dtype=torch.uint8)
            sends = [(r, raw) for r in range(self.world_size) if r != me]
        recvs = [(r, torch.empty(s.header.total, dtype=torch.uint8)) for r, s in cut if r != me]
        self._xchg(sends, recvs, timeout)
        for r, buf in recvs:
            texts[r] = bytes(buf.numpy()).decode("utf-8", "replace")
        if any(r == me for r, _ in cut):
            texts[me] = _frame.message_bytes(message).decode("utf-8", "replace")
        return texts

    def _alltoall_fits(self, op: Op, root: int, slots: _Slots) -> bool:
        """Whether step 2 runs as one all-to-all (False too when nothing travels after the slots).

        Decided from the slots alone, in closed form per op, so every rank decides the same in
        O(world). An all-to-all takes each rank's sends from one buffer and lands its receives in
        one buffer: free when a rank sends or receives one segment (the usual case with two ranks);
        otherwise the sender copies its segments together, and the receiver's results share one
        buffer (which lives as long as any of them), so both are allowed up to
        ``_alltoall_copy_bytes``. Beyond small worlds only ops where every rank sends to every rank
        (all_gather) use it: a gather's all-to-all would post world x world empty messages.
        """
        world = self.world_size
        dense = op is _ALL_GATHER
        if not (dense or op is _GATHER) or (not dense and world > _frame.SMALL_WORLD):
            return False
        later = [slots[r].later for r in range(world)]
        pieces = [slots[r].later_segs for r in range(world)]
        total, total_pieces = sum(later), sum(pieces)
        if not total:
            return False
        most, copy = self._alltoall_max_bytes, self._alltoall_copy_bytes

        def ok(nbytes: int, n: int) -> bool:
            return nbytes <= most and (n <= 1 or nbytes <= copy)

        if dense:
            return all(ok(later[r] * (world - 1), pieces[r] * (world - 1))
                       and ok(total - later[r], total_pieces - pieces[r]) for r in range(world))
        return all(ok(later[r], pieces[r]) for r in range(world) if r != root) and ok(
            total - later[root], total_pieces - pieces[root])

    def _plan(self, op: Op, root: int, parts: list[list[memoryview]],
              tables: list[list[tuple[int, memoryview | None]]], slots: _Slots) -> _Plan:
        """Step 2 for the ops whose parts go straight from their sender to their receivers.

        all_gather (and set-up): everyone sends part 0 to everyone. gather: to the root. scatter:
        the root sends part r to rank r, and ``slots`` holds only the root's slot for this rank.
        """
        me, world = self.rank, self.world_size
        # bytes to and from each rank, for an all-to-all (not scatter's: a receiver's plan stays O(1))
        counted = op is not _SCATTER
        plan = _Plan(send_counts=[0] * world, recv_counts=[0] * world) if counted else _Plan()
        if op is _SCATTER:
            receivers = [(r, r) for r in range(world) if r != root] if me == root else []
            sources = [] if me == root else [(root, slots[0], 0)]
        elif op is _GATHER:
            receivers = [] if me == root else [(root, 0)]
            sources = [(r, slots[r], 0) for r in range(world) if r != me] if me == root else []
        else:
            receivers = [(r, 0) for r in range(world) if r != me]
            sources = [(r, slots[r], 0) for r in range(world) if r != me]
        # what I send: my segments that did not fit the slot, to each receiver of their part
        later: dict[int, list[torch.Tensor]] = {}  # each part's travelling segments, as tensors, made once
        for dst, p in receivers:
            out = later.get(p)
            if out is None:
                out = later[p] = [_byte_tensor(seg) for (size, inline), seg in zip(tables[p], parts[p], strict=True)
                                  if inline is None and size]
            for t in out:
                plan.sends.append((dst, t))
                if counted:
                    plan.send_counts[dst] += t.numel()
        # what I receive: each source's part meant for me, into exact-size buffers (with an
        # all-to-all: views of one buffer, each source's segments back to back; _load copies an
        # out-of-band buffer that lands unaligned)
        wanted = []
        for src, slot, p in sources:
            theirs = slot.parts
            if p >= len(theirs):
                raise FrameError(f"rank {src} sent {len(theirs)} parts, part {p} missing", op=op.label, ranks=[src])
            for size, inline in theirs[p]:
                if inline is None:
                    self._check_receivable(size, src, op.label)
                    if counted:
                        plan.recv_counts[src] += size
            wanted.append((src, theirs[p]))
            plan.packed[src] = bool(slot.header.flags & _frame.PACKED)
        if op is not _SCATTER and self._alltoall_fits(op, root, slots):
            plan.recv_buf = torch.empty(sum(plan.recv_counts), dtype=torch.uint8)
        offset = 0
        whole = _mv(plan.recv_buf) if plan.recv_buf is not None else None
        for src, entries in wanted:
            segs: list[_Seg] = []
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
                    segs.append((_mv(buf), False))
            plan.incoming[src] = segs
        return plan


# ---------------------------------------------------------------- one collective at a time
_COLLECTIVES = ("synchronize", "all_gather", "gather", "broadcast", "scatter", "shared_random_seed", "reduce_dict",
                "all_reduce_dict", "all_reduce", "reduce", "broadcast_tensor", "all_gather_tensor",
                "reduce_scatter_tensor", "reduce_object", "all_reduce_object", "scan", "exscan", "all_to_all",
                "split", "new_group", "create_local_groups")


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _where(site: tuple[str, int]) -> str:
    return f"{os.path.basename(site[0])}:{site[1]}"


def _spans(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0-2, 5'."""
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(parts)}"


def _states_table(states: Mapping[int, str | None], world: int) -> str:
    """One line per distinct state, naming its ranks; ranks absent from ``states`` gave no report."""
    groups: dict[str, list[int]] = {}
    for r in range(world):
        text = states.get(r)
        groups.setdefault(text if text else "no report (not in a collective when this rank gave up, or gone)",
                          []).append(r)
    return "\n".join(f"  {_spans(ranks)}: {text}" for text, ranks in groups.items())


def _exclusive(method: Callable[..., Any]) -> Callable[..., Any]:
    """Refuse a second collective on a communicator while one runs: from another thread (the two
    would interleave their messages), or from the same thread (an object's ``__setstate__`` calling
    a collective while a result loads)."""

    @functools.wraps(method)
    def run(self: Communicator, *args: Any, **kwargs: Any) -> Any:
        if not self._busy.acquire(False):
            name = type(self).__name__
            if self._busy_thread == threading.get_ident():
                raise CommunicatorStateError(
                    f"{method.__name__} was called on a {name} while another of its collectives runs in the same "
                    f"thread (for example from an object's __setstate__ while a result loads); call it after "
                    f"that collective returns")
            raise CommunicatorStateError(
                f"{method.__name__} was called on a {name} from two threads at once; a communicator serves one "
                f"thread at a time (their messages would interleave): give each thread its own communicator "
                f"(comm.split or comm.new_group), or hold a lock around the calls")
        self._busy_thread = threading.get_ident()
        # the user's call site, for other ranks' error messages: the first frame outside distcomm
        f: Any = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith(_PACKAGE_DIR):
            f = f.f_back
        self._site = ("?", 0) if f is None else (f.f_code.co_filename, f.f_lineno)
        entry = self._seq
        try:
            out = method(self, *args, **kwargs)
            self._done, self._raised = (self._op_label, self._seq, self._site), None
            return out
        except BaseException as e:
            reached = self._seq != entry  # or it failed before its first exchange (bad input)
            self._raised = (self._op_label if reached else method.__name__, self._seq if reached else None,
                            self._site, type(e).__name__)
            raise
        finally:
            self._busy_thread = 0
            self._busy.release()

    return run


for _name in _COLLECTIVES:
    setattr(Communicator, _name, _exclusive(getattr(Communicator, _name)))

