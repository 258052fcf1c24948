"""The Communicator base class: the object pipeline, written once for every transport.

A collective runs in up to three steps, the same on every rank:

1. Every rank serializes its object into segments and all-gathers one fixed-size *slot*: a header
   (op, sequence number, root, status, digest), the sizes of its segments, and the segments that
   fit. Small objects are done here, in one round trip. Every rank now knows every rank's sizes,
   failures and what it called, so all ranks take the same decision: raise the same error, or go on.
2. Segments that did not fit move into buffers of their exact size, sent from the sender's own
   memory. Nobody pads to the largest rank; a rank that needs nothing gets nothing. They move in one
   all-to-all with per-rank sizes when that costs no copy or only small ones (every rank decides
   alike, from the slots), else point to point.
3. Each receiver deserializes; out-of-band buffers become the results' memory. Python's cyclic
   garbage collector waits while large results load.

Subclasses only move bytes: ``_allgather_slots``, ``_exchange`` (point to point), ``_reduce_tensor``
and optionally ``_alltoallv`` (a native all-to-all; the default goes through ``_exchange``) and
``_device_barrier``. The in-process test world implements the same, so unit tests run this very code.
"""

from __future__ import annotations

import abc
import datetime
import gc
import hashlib
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Literal, TypeVar

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
from ._serialization import _CUDA_TARGET, Serializer, default_serializer

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
    KEYS = 9

    @property
    def label(self) -> str:
        return _LABELS[self]


_LABELS = {op: op.name.lower() for op in Op}

# The members the per-call path compares against, as module names: reading an attribute of an
# enum class costs several times a global lookup on Python 3.11, and small collectives are
# dominated by such per-call Python work.
_ALL_GATHER, _GATHER, _BROADCAST, _SCATTER, _KEYS, _SETUP = (
    Op.ALL_GATHER, Op.GATHER, Op.BROADCAST, Op.SCATTER, Op.KEYS, Op.SETUP)


@dataclass
class OpStats:
    """Counters for one kind of collective on one communicator (times in seconds)."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    serialize_s: float = 0.0
    transfer_s: float = 0.0
    deserialize_s: float = 0.0


@dataclass
class _Plan:
    """What this rank sends and receives in step 2, and the segments it will deserialize."""

    sends: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    recvs: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # point to point only
    # per source rank: its segments, each an inline view or the tensor it is received into
    incoming: dict[int, list[memoryview | torch.Tensor]] = field(default_factory=dict)
    packed: dict[int, bool] = field(default_factory=dict)
    send_counts: list[int] = field(default_factory=list)  # bytes to / from each rank
    recv_counts: list[int] = field(default_factory=list)
    # set when step 2 runs as one all-to-all: every received segment is a view of it
    recv_buf: torch.Tensor | None = None


def _seconds(timeout: float | datetime.timedelta | None, default: float | None) -> float | None:
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be seconds (float) or a timedelta, got {type(timeout).__name__}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    return float(timeout)


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
    _was_enabled = False

    def __enter__(self) -> None:
        cls = _GCPause
        with cls._lock:
            if cls._depth == 0:
                cls._was_enabled = gc.isenabled()
                gc.disable()
            cls._depth += 1

    def __exit__(self, *exc: object) -> None:
        cls = _GCPause
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0 and cls._was_enabled:
                gc.enable()


_GC_PAUSE_BYTES = 16 * 1024
"""Loading what arrived after the slots pauses the collector when that is at least this many bytes."""


def _work_dtype(values: Iterable[Any]) -> torch.dtype:
    """The dtype reduce_dict reduces in: float64, or complex128 when there are complex values."""
    return torch.complex128 if any(isinstance(v, torch.Tensor) and v.is_complex() for v in values) else torch.float64


def _reduce_digest(names: Sequence[Any], work_dtype: torch.dtype) -> int:
    """An 8-byte digest of reduce_dict's sorted keys and reduce dtype, compared across ranks."""
    text = repr([*names, ("reduce dtype", str(work_dtype))])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


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
        # communicators over other groups that the module helpers' group= argument asked for
        self._children: dict[Any, Communicator] = {}

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
        return 0

    @property
    def local_size(self) -> int:
        """Number of ranks on this process's machine."""
        return 1

    @property
    def is_main_process(self) -> bool:
        """True on rank 0."""
        return self.rank == 0

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
    def _allgather_slots(self, slot: bytearray, timeout: float | None) -> memoryview:
        """All-gather one slot of ``slot_bytes`` bytes from every rank: their bytes in rank order, flat."""

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

    def _mark_broken(self, why: str) -> None:
        self._broken = why

    def _op_timeout(self, timeout: float | datetime.timedelta | None) -> float | None:
        return _seconds(timeout, self._timeout)

    def _check_root(self, name: str, root: int) -> None:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise TypeError(f"{name} must be an int rank, got {type(root).__name__}")
        if not 0 <= root < self.world_size:
            raise ValueError(f"{name}={root} is out of range for world_size {self.world_size}")

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
        if self.world_size == 1:
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
        if self.world_size == 1:
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
        if self.world_size == 1:
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
        if self.world_size == 1:
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
            if self.world_size == 1:
                if problem:
                    raise ValueError(problem)
                assert objs is not None
                return objs[0]
            out = self._run(Op.SCATTER, src, objs, t, invalid=problem)
        else:
            out = self._run(Op.SCATTER, src, objs, t)  # objs is not read off src (FakeCommunicator may)
        return out[self.rank]

    def shared_random_seed(self, *, timeout: float | datetime.timedelta | None = None) -> int:
        """An int in [0, 2**31) that is the same on every rank (drawn by rank 0 from numpy's RNG)."""
        seed = int(np.random.randint(2**31))
        return int(self.broadcast(seed, src=0, timeout=timeout))

    def reduce_dict(
        self, input_dict: Mapping[Any, torch.Tensor], average: bool = True, *,
        timeout: float | datetime.timedelta | None = None,
    ) -> dict[Any, torch.Tensor]:
        """Sum (or average) a dict of scalar tensors onto rank 0, in one collective.

        Every rank must call it with the same keys. Rank 0 gets the reduced dict (keys sorted);
        other ranks get their input back unchanged. Key sets that differ raise on every rank.
        """
        return self._reduce_dict(input_dict, average, 0, timeout)

    def all_reduce_dict(
        self, input_dict: Mapping[Any, torch.Tensor], average: bool = True, *,
        timeout: float | datetime.timedelta | None = None,
    ) -> dict[Any, torch.Tensor]:
        """Like reduce_dict, but every rank gets the reduced dict."""
        return self._reduce_dict(input_dict, average, None, timeout)

    # ------------------------------------------------------------------ reduce_dict
    def _reduce_dict(
        self, input_dict: Mapping[Any, torch.Tensor], average: bool, dst: int | None,
        timeout: float | datetime.timedelta | None,
    ) -> dict[Any, torch.Tensor]:
        self._check_usable()
        if not isinstance(input_dict, Mapping):
            raise TypeError(f"reduce_dict needs a dict of scalar tensors, got {type(input_dict).__name__}")
        if not isinstance(average, bool):
            raise TypeError(f"average must be a bool, got {type(average).__name__}")
        t = self._op_timeout(timeout)
        op = Op.REDUCE_DICT if dst is not None else Op.ALL_REDUCE_DICT
        problem = None
        try:
            names = sorted(input_dict.keys())
        except TypeError as e:
            names, problem = list(input_dict.keys()), f"keys can't be sorted: {e}"
        for k in names:
            v = input_dict[k]
            if not isinstance(v, torch.Tensor):
                problem = f"value of {k!r} is a {type(v).__name__}, not a scalar tensor"
                break
            if v.numel() != 1:
                problem = f"value of {k!r} has shape {tuple(v.shape)}, not a scalar"
                break
        if problem is None and len({input_dict[k].device for k in names}) > 1:
            problem = "values are on different devices"
        if self.world_size == 1:
            if problem:
                raise ValueError(f"reduce_dict: {problem}")
            return {k: input_dict[k] for k in names}
        # Every rank reduces in the same dtype whatever its values' dtypes (float64, exact for float32
        # and for integers below 2**53; complex128 when the dicts hold complex values), and the
        # digest that the first exchange compares covers the keys and that choice.
        work_dtype = _work_dtype(input_dict.values()) if problem is None else torch.float64
        self._run(op, -1 if dst is None else dst, None, t, serialize=False,
                  digest=_reduce_digest(names, work_dtype), invalid=problem,
                  on_digest_mismatch=lambda: self._key_mismatch(names, work_dtype, t))
        if not names:
            return {}
        with torch.no_grad():
            values = torch.stack([input_dict[k].detach().reshape(()).to(work_dtype) for k in names])
            orig = values.device
            work = values.to(self.device) if values.device != self.device else values.clone()
            st = self._stat(op)
            t0 = time.perf_counter()
            self._reduce_tensor(work, dst, t)
            st.transfer_s += time.perf_counter() - t0
            if dst is not None and self.rank != dst:
                return dict(input_dict)
            if average:
                work /= self.world_size
            work = work.to(orig)
        out = {}
        for i, k in enumerate(names):
            v, dt = work[i].reshape(input_dict[k].shape), input_dict[k].dtype
            # sums keep each value's dtype; averages of integers become the default float dtype
            keep = not average or dt.is_floating_point or dt.is_complex
            out[k] = v.to(dt if keep else torch.get_default_dtype())
        return out

    def _key_mismatch(self, names: list[Any], work_dtype: torch.dtype, timeout: float | None) -> None:
        infos = self._run(Op.KEYS, -1, ([repr(k) for k in names], str(work_dtype)), timeout)
        everyone = [keys for keys, _ in infos]
        kinds = [kind for _, kind in infos]
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
        raise CollectiveMismatchError(
            "reduce_dict: the ranks' dicts have different keys:\n" + "\n".join(lines),
            op="reduce_dict", ranks=[r for r, ks in enumerate(everyone) if set(ks) != set(union)],
        )

    # ------------------------------------------------------------------ the pipeline
    def _serialize_local(
        self, op: Op, root: int, obj: Any, rank: int | None = None
    ) -> tuple[list[list[memoryview]], int, str]:
        """Segments per part, plus a status and message when the rank can't take part."""
        rank = self.rank if rank is None else rank
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
            return [], _frame.SERIALIZE_FAILED, f"{type(e).__name__}: {e}"

    def _build_slot(
        self, op: Op, seq: int, root: int, digest: int, parts: list[list[memoryview]]
    ) -> tuple[bytearray, list[list[memoryview]]]:
        """The slot, and the parts as they travel (each packed into one segment if the table overflows)."""
        try:
            return _frame.encode(op, seq, root, digest, parts, self.slot_bytes), parts
        except ValueError:  # the segment table doesn't fit: one packed segment per part
            packed = [[memoryview(_frame.pack(p))] for p in parts]
        try:
            return _frame.encode(op, seq, root, digest, packed, self.slot_bytes, flags=_frame.PACKED), packed
        except ValueError:
            return _frame.encode_status(
                _frame.INVALID, op, seq, root,
                f"{len(parts)} parts don't fit a slot of {self.slot_bytes} bytes; raise slot_bytes",
                self.slot_bytes), []

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
        on_digest_mismatch: Callable[[], None] | None = None,
    ) -> list[Any]:
        """Run one collective; returns a list indexed by rank (entries this rank did not get: None)."""
        self._seq += 1
        seq = self._seq
        st = self._stat(op)
        st.calls += 1
        t0 = time.perf_counter()
        parts: list[list[memoryview]] = []
        status, message = _frame.OK, ""
        if invalid is not None:
            status, message = _frame.INVALID, invalid
        elif serialize:
            parts, status, message = self._serialize_local(op, root, obj)
            if status == _frame.OK and self.max_bytes is not None:
                total = sum(s.nbytes for p in parts for s in p)
                if total > self.max_bytes:
                    status, message = _frame.TOO_LARGE, f"payload of {total} bytes is over max_bytes={self.max_bytes}"
        if status == _frame.OK:
            slot, parts = self._build_slot(op, seq, root, digest, parts)
        else:
            slot = _frame.encode_status(status, op, seq, root, message, self.slot_bytes)
        mine = _frame.decode(slot)  # before the exchange: the code after it runs on a cold cache
        t1 = time.perf_counter()
        st.serialize_s += t1 - t0

        raw = self._allgather_slots(slot, timeout)
        st.bytes_sent += self.slot_bytes
        st.bytes_received += self.slot_bytes * (self.world_size - 1)
        size = self.slot_bytes
        slots = []
        for r in range(self.world_size):
            if r == self.rank:
                slots.append(mine)
                continue
            try:
                slots.append(_frame.decode(raw[r * size : (r + 1) * size]))
            except FrameError as e:
                raise FrameError(f"{op.label} #{seq}: slot from rank {r} is corrupt: {e}",
                                 op=op.label, ranks=[r]) from e
        self._agree(op, seq, root, slots)
        if on_digest_mismatch is not None and len({s.header.digest for s in slots}) > 1:
            on_digest_mismatch()
        if not serialize:
            st.transfer_s += time.perf_counter() - t1
            return []

        plan = self._plan(op, root, parts, slots)
        if plan.recv_buf is not None:
            sends = [t for _, t in plan.sends]
            send = sends[0] if len(sends) == 1 else torch.cat(sends) if sends else torch.empty(0, dtype=torch.uint8)
            self._alltoallv(send, plan.send_counts, plan.recv_buf, plan.recv_counts, timeout)
        elif plan.sends or plan.recvs:
            self._exchange(plan.sends, plan.recvs, timeout)
        st.bytes_sent += sum(plan.send_counts)
        st.bytes_received += sum(plan.recv_counts)
        t2 = time.perf_counter()
        st.transfer_s += t2 - t1

        results: list[Any] = [None] * self.world_size
        if op is _SCATTER:
            results[self.rank] = obj[self.rank] if self.rank == root else None
        elif op is not _BROADCAST or self.rank == root:
            results[self.rank] = obj
        token = _CUDA_TARGET.set(self._cuda_target)
        try:
            if sum(plan.recv_counts) >= _GC_PAUSE_BYTES:
                with _GCPause():
                    self._load_all(op, seq, plan, results)
            else:
                self._load_all(op, seq, plan, results)
        finally:
            _CUDA_TARGET.reset(token)
        st.deserialize_s += time.perf_counter() - t2
        return results

    def _load_all(self, op: Op, seq: int, plan: _Plan, results: list[Any]) -> None:
        for src, segs in plan.incoming.items():
            results[self.rank if op is _SCATTER else src] = self._load(op, seq, src, segs, plan.packed[src])

    def _load(self, op: Op, seq: int, src: int, segs: list[memoryview | torch.Tensor], packed: bool) -> Any:
        """Deserialize one rank's segments (inline views or received tensors)."""
        # Out-of-band buffers become the results' memory: those that came inline in the slot
        # are copied out of it (the slot buffer is the transport's, and may be read-only).
        views = [s if isinstance(s, memoryview) else memoryview(s.numpy()) for s in segs]  # type: ignore[arg-type]
        if packed:
            inline = isinstance(segs[0], memoryview)
            views = _frame.unpack(views[0])
            if inline:
                views[1:] = [memoryview(bytearray(v)) for v in views[1:]]
        else:
            views[1:] = [memoryview(bytearray(v)) if isinstance(s, memoryview) else v
                         for v, s in zip(views[1:], segs[1:], strict=True)]
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

    def _agree(self, op: Op, seq: int, root: int, slots: list[_frame.Slot]) -> None:
        """Raise the same error on every rank when ranks disagree or any rank failed."""
        calls = {(s.header.op, s.header.seq, s.header.root) for s in slots}
        if len(calls) > 1:
            rows = []
            for r, s in enumerate(slots):
                name = Op(s.header.op).label if s.header.op in Op._value2member_map_ else f"op {s.header.op}"
                where = f" root={s.header.root}" if s.header.root >= 0 else ""
                rows.append(f"  rank {r}: {name}{where} (call #{s.header.seq})")
            mine = (op, seq, root)
            odd = [r for r, s in enumerate(slots) if (s.header.op, s.header.seq, s.header.root) != mine]
            raise CollectiveMismatchError(
                "ranks called different collectives:\n" + "\n".join(rows), op=op.label, ranks=odd
            )
        failed = [(r, s) for r, s in enumerate(slots) if s.header.status != _frame.OK]
        if not failed:
            return
        lines = "\n".join(f"  rank {r}: {s.message}" for r, s in failed)
        ranks = [r for r, _ in failed]
        statuses = {s.header.status for _, s in failed}
        what = f"{op.label} #{seq} failed on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}:\n{lines}"
        if statuses == {_frame.TOO_LARGE}:
            raise PayloadTooLargeError(what, op=op.label, ranks=ranks)
        if statuses == {_frame.SERIALIZE_FAILED}:
            raise SerializationError(what, op=op.label, ranks=ranks)
        raise CollectiveError(what, op=op.label, ranks=ranks)

    @staticmethod
    def _route(op: Op, root: int, src: int, dst: int) -> int | None:
        """The index of the part that rank ``src`` sends to rank ``dst`` in ``op``, or None."""
        if src == dst:
            return None
        if op is _ALL_GATHER or op is _KEYS or op is _SETUP:
            return 0
        if op is _GATHER:
            return 0 if dst == root else None
        if op is _BROADCAST:
            return 0 if src == root else None
        if op is _SCATTER:
            return dst if src == root else None
        return None

    def _alltoall_fits(self, op: Op, root: int, slots: list[_frame.Slot]) -> bool:
        """Whether step 2 runs as one all-to-all (False too when nothing travels after the slots).

        Decided from the slots alone, so every rank decides the same. An all-to-all takes each
        rank's sends from one buffer and lands its receives in one buffer: free when a rank sends
        or receives one segment (the usual case with two ranks); otherwise the sender copies its
        segments together, and the receiver's results share one buffer (which lives as long as any
        of them), so both are allowed up to ``_alltoall_copy_bytes``.
        """
        if not any(s.later for s in slots):  # all came inline: the usual small collective
            return False
        world, most, copy = self.world_size, self._alltoall_max_bytes, self._alltoall_copy_bytes
        sent, received = [0] * world, [0] * world
        sent_pieces, received_pieces = [0] * world, [0] * world
        for src in range(world):
            theirs = slots[src].parts
            for dst in range(world):
                p = self._route(op, root, src, dst)
                if p is None or p >= len(theirs):
                    continue
                for size, inline in theirs[p]:
                    if inline is None and size:
                        sent[src] += size
                        received[dst] += size
                        sent_pieces[src] += 1
                        received_pieces[dst] += 1
        if not any(sent_pieces):
            return False
        return all(
            nbytes <= most and (pieces <= 1 or nbytes <= copy)
            for nbytes, pieces in zip(sent + received, sent_pieces + received_pieces, strict=True)
        )

    def _plan(self, op: Op, root: int, parts: list[list[memoryview]], slots: list[_frame.Slot]) -> _Plan:
        me, world = self.rank, self.world_size
        plan = _Plan(send_counts=[0] * world, recv_counts=[0] * world)
        # what I send: my segments that did not fit the slot, to each receiver of their part
        mine = slots[me].parts
        for dst in range(world) if slots[me].later else ():
            sent = self._route(op, root, me, dst)
            if sent is None:
                continue
            for (size, inline), seg in zip(mine[sent], parts[sent], strict=True):
                if inline is None and size:
                    plan.sends.append((dst, _byte_tensor(seg)))
                    plan.send_counts[dst] += size
        # what I receive: each source's part meant for me, into exact-size buffers (with an
        # all-to-all: views of one buffer, each source's segments in turn)
        wanted: list[tuple[int, list[tuple[int, memoryview | None]]]] = []
        for src in range(world):
            p = self._route(op, root, src, me)
            if p is None:
                continue
            theirs = slots[src].parts
            if p >= len(theirs):
                raise FrameError(f"rank {src} sent {len(theirs)} parts, part {p} missing", op=op.label, ranks=[src])
            for size, inline in theirs[p]:
                if inline is None:
                    if self.max_bytes is not None and size > self.max_bytes:
                        raise PayloadTooLargeError(
                            f"rank {src} announced {size} bytes, over max_bytes={self.max_bytes}",
                            op=op.label, ranks=[src])
                    plan.recv_counts[src] += size
            wanted.append((src, theirs[p]))
            plan.packed[src] = bool(slots[src].header.flags & _frame.PACKED)
        if self._alltoall_fits(op, root, slots):
            plan.recv_buf = torch.empty(sum(plan.recv_counts), dtype=torch.uint8)
        offset = 0
        for src, entries in wanted:
            segs: list[memoryview | torch.Tensor] = []
            for size, inline in entries:
                if inline is not None:
                    segs.append(inline)
                elif plan.recv_buf is not None:
                    segs.append(plan.recv_buf[offset : offset + size])
                    offset += size
                else:
                    buf = torch.empty(size, dtype=torch.uint8)
                    if size:
                        plan.recvs.append((src, buf))
                    segs.append(buf)
            plan.incoming[src] = segs
        return plan
