"""Communicator: the front door. Identity, settings, lifecycle and stats, and one short method
per public collective that checks its arguments, takes the world-of-one shortcut and calls the
family that implements it:

- object collectives (all_gather, gather, broadcast, scatter, ...): ``_pipeline`` over ``_routes``;
- tensor collectives: ``_tensors``; dict and object reductions: ``_reductions``;
- all_to_all: ``_all_to_all``; sub-communicators and machines: ``_groups``.

Below the collectives sit the transport hooks (``_transport``, inherited), the handful of methods
through which every family moves bytes. A transport (GlooCommunicator, NcclCommunicator,
LocalCommunicator, the test doubles) subclasses Communicator and implements them; the test doubles
implement the same hooks, so unit tests run every family's real code.
"""

from __future__ import annotations

import abc
import datetime
import operator
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, ParamSpec, TypeVar, cast

import numpy as np
import torch

from ._agreement import where
from ._calls import CallSpec, Op, OpStats
from ._conveniences import ObjectConveniences
from ._elastic.membership import ElasticMethods, warn_late_first_call
from ._errors import CollectiveError, CommunicatorStateError
from ._groups import SubCommunicators, sub_settings
from ._handles import Handle, Queues, refuse_close
from ._one_at_a_time import COLLECTIVES, exclusive
from ._ops import ReduceOpLike, object_op, tensor_op
from ._reductions import dict_op, reduce_dict, reduce_objects
from ._tensors import (
    run_tensor_op,
)
from ._transfer.all_to_all import all_to_all, all_to_all_problem
from ._transfer.messages import PointToPoint
from ._transfer.pipeline import run
from ._transfer.transport import TransportHooks
from ._wire import frame as _frame
from ._wire.memory import seconds
from ._wire.serialization import Serializer, default_serializer

if TYPE_CHECKING:
    from ._mesh import ElasticMesh

__all__ = ["COLLECTIVES", "DEFAULT_TIMEOUT", "Communicator"]

DEFAULT_TIMEOUT = 600.0
"""Seconds a collective waits for its peers unless told otherwise."""

DEFAULT_SLOT_BYTES = 4096

_T = TypeVar("_T", bound="Communicator")
_P = ParamSpec("_P")
_R = TypeVar("_R")


def _fixed(name: str) -> property:
    """A setting every rank of a communicator must share: read-only, so that no rank changes it alone."""

    def refuse(self: Communicator, value: object) -> None:
        raise AttributeError(
            f"{name} is fixed when a communicator is made: every rank must use the same, and one rank changing "
            f"it alone would refuse or accept payloads its peers don't (make the communicator with {name}=...)")

    return property(operator.attrgetter(f"_{name}"), refuse, doc=f"The {name} given when it was made (fixed).")


_OTHER_SPELLINGS = {
    "get_rank": "rank", "get_world_size": "world_size", "get_local_rank": "local_rank", "get_local_size": "local_size",
    "get_local_process_group": "local_group", "is_main": "is_main_process",
    "all_gather_object": "all_gather(obj)", "gather_object": "gather(obj, dst)",
    "broadcast_object_list": "broadcast(obj, src)", "scatter_object_list": "scatter(objs, src)",
    "all_gather_into_tensor": "all_gather_tensor", "reduce_scatter": "reduce_scatter_tensor",
}
"""torch.distributed's and other libraries' names a user reaches for, and distcomm's spelling."""


class Communicator(ObjectConveniences, PointToPoint, SubCommunicators, ElasticMethods, TransportHooks):
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
    _world_of_one_shortcut = True

    # How the routes move bytes (``_routes``); tests turn these knobs to reach each path.
    _alltoall_copy_bytes = 1 << 20
    """A direct move runs as one all-to-all unless a rank would copy more than this many bytes to
    line up its sends (or land its receives), or any rank moves more than ``_alltoall_max_bytes``."""
    _alltoall_max_bytes = (1 << 31) - 1
    _TREE_CHUNK = 4 << 20
    _TREE_MAX_CHUNKS = 16
    _BCAST_ONE_BUFFER = 64 << 10
    """Broadcasts whose bytes after the slots are at most this many travel as one buffer, in one
    ``_broadcast_buffer`` call: a native broadcast where the transport has one (its tree runs in C++,
    and its root sends log2(world) copies, at most 640 KiB at 1,024 ranks). Larger ones go down
    ``tree_send``'s split tree, whose root sends one copy."""
    _TREE_GATHER_BYTES = 256 << 10
    """Gathers beyond SMALL_WORLD ranks whose segments add up to at most this many bytes travel up
    a binomial tree: the root posts log2(world) receives instead of one per rank (at 1,024 ranks:
    10, not 1,023), and no rank receives or forwards more than this many bytes (a dict of 8 floats
    from each of 1,024 ranks is about 200 KiB). Larger ones go straight from each rank to the root,
    each byte sent once, and the ranks that need nothing receive nothing but the slots."""
    _SCATTER_SLOT_MAX = 4 << 10
    """The most a scatter's per-rank slot holds beyond small worlds (also at most ``slot_bytes``)."""

    _REDUCIBLE_DTYPES: frozenset[torch.dtype] = frozenset({
        torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32, torch.int64,
        torch.bool})
    """The dtypes a reduction takes (gloo's, which the test doubles share); other dtypes are refused
    on every rank before anything moves. Broadcasts and gathers carry any dtype."""

    _closed_why = ""
    """Why it was closed, where the user didn't close it (a shrink or admit of its job's communicator)."""
    _successor: Communicator | None = None
    """The communicator a ``shrink()`` or ``admit()`` of this one made: ``use(comm)`` then follows it."""
    _let_in_at: float | None = None
    """When ``from_env()`` returned to a replacement the members let in: until its first call, they wait."""
    _loss_unraised: BaseException | None = None
    """A member's loss met as a replacement joined at a read of its rank or membership: its next call raises it."""
    _is_sub = False
    """Whether ``split``, ``dup`` or ``new_group`` made it (not the job's communicator)."""
    _mesh: ElasticMesh | None = None
    """The job's mesh (``device_mesh``), which every communicator of the job's later memberships follows."""
    _moves_bytes = True
    """Whether its transport moves raw bytes (the fake records each message as the object it holds:
    ``sync_state`` then sends tensors inside the header)."""
    _holds_state = True
    """Whether this rank holds the job's trained state: not a newcomer until ``sync_state`` hands it
    the members' (kept across shrink, admit and split: ``sync_state`` takes its source among these)."""

    serializer: Serializer = _fixed("serializer")  # type: ignore[assignment]
    max_bytes: int | None = _fixed("max_bytes")  # type: ignore[assignment]
    slot_bytes: int = _fixed("slot_bytes")  # type: ignore[assignment]
    receive_cuda_on: str = _fixed("receive_cuda_on")  # type: ignore[assignment]

    def __init__(
        self,
        *,
        timeout: float | datetime.timedelta | None = None,
        serializer: Serializer | None = None,
        max_bytes: int | None = None,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        receive_cuda_on: Literal["device", "cpu"] = "device",
    ) -> None:
        self._timeout = seconds(timeout, DEFAULT_TIMEOUT)
        if serializer is None:
            serializer = default_serializer()
        if not isinstance(serializer, Serializer):
            raise TypeError(f"serializer must be a distcomm.Serializer, got {type(serializer).__name__}")
        self._serializer = serializer
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"max_bytes must be a non-negative int or None, got {max_bytes!r}")
        self._max_bytes = max_bytes
        if not isinstance(slot_bytes, int) or slot_bytes < _frame.MIN_SLOT:
            raise ValueError(f"slot_bytes must be an int >= {_frame.MIN_SLOT}, got {slot_bytes!r}")
        self._slot_bytes = slot_bytes
        if receive_cuda_on not in ("device", "cpu"):
            raise ValueError(f"receive_cuda_on must be 'device' or 'cpu', got {receive_cuda_on!r}")
        self._receive_cuda_on = receive_cuda_on
        self._seq = 0
        self._pid = os.getpid()
        self._closed = False
        self._ending_on_error = False
        self._broken: str | None = None
        self._misused: str | None = None  # why every later collective fails on every rank (see _one_at_a_time)
        self._stats: dict[str, OpStats] = {}
        self._cur = OpStats()  # the counters of the collective in progress
        self._op_label = "setup"  # its name, for errors the transport raises
        self._call: CallSpec | None = None  # the object collective in progress (the fake's peers read it)
        # communicators over other groups that the module helpers' group= argument asked for
        self._children: dict[Any, Communicator] = {}
        self._local = (0, 1)  # (local rank, local size)
        # whether launch() or create_local_groups() said which ranks share a machine (the reference's
        # _LOCAL_PROCESS_GROUP exists only then)
        self._machines_declared = False
        self._launcher: str | None = None  # what started this process, where the communicator read it (from_env)
        self._busy = threading.Lock()  # held while a collective runs: one at a time, from one thread
        self._busy_thread = 0
        # where the user called the collective in progress (file, line), and the last one that returned
        self._site: tuple[str, int] = ("", 0)
        self._done: tuple[str, int, tuple[str, int]] | None = None
        self._raised: tuple[str, int | None, tuple[str, int], str] | None = None  # the last call, if it raised
        self._queues = Queues()  # non-blocking calls: the collectives' worker, point-to-point lanes (_handles)

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
    def launcher(self) -> str | None:
        """What started this process, as ``from_env`` or ``launch`` found it: "torchrun", "distcomm run",
        "slurm", "openmpi", "mpich", "mvapich", "pals", "lsf", "kubeflow", "env" (RANK / WORLD_SIZE set
        by hand or a job controller),
        "launch" (distcomm.launch started it) or "python" (none: a world of one); None where the
        communicator adopted a group or was made directly."""
        return self._launcher

    @property
    def group(self) -> Any:
        """The torch process group of this communicator's ranks (None where there is none)."""
        return None

    @property
    def local_group(self) -> Any:
        """The torch process group of the ranks on this machine (None where there is none)."""
        return None

    @property
    def is_main_process(self) -> bool:
        """True on rank 0 (a plain bool; the module helper ``distcomm.is_main_process()`` is the
        function of the classic spelling)."""
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        """The device this communicator's tensor collectives use (CPU unless NCCL)."""
        return torch.device("cpu")

    @property
    def timeout(self) -> float | None:
        """Default seconds a collective waits for its peers."""
        return self._timeout

    # ------------------------------------------------------------------ stats
    @property
    def stats(self) -> dict[str, OpStats]:
        """Counters per collective (calls, bytes, seconds per step): a snapshot."""
        return {k: OpStats(**vars(v)) for k, v in self._stats.items()}

    def reset_stats(self) -> None:
        """Zero the counters."""
        self._stats.clear()

    def _stat(self, op: Op) -> OpStats:
        st = self._stats.get(op.label)
        if st is None:
            st = self._stats[op.label] = OpStats()
        return st

    def _count(self, sent: int, received: int) -> None:
        """Add bytes moved to the counters of the collective in progress."""
        st = self._cur
        st.bytes_sent += sent
        st.bytes_received += received

    def __reduce__(self) -> Any:
        raise TypeError(
            f"a {type(self).__name__} can't be sent to another process or pickled: it holds this process's "
            f"connections. Pass what it computes instead, or create a communicator in each process (a "
            f"function sent to launch() or spawn() receives its own)")

    def __getattr__(self, name: str) -> Any:  # only for names it doesn't have
        spelling = _OTHER_SPELLINGS.get(name)
        hint = f": distcomm spells it comm.{spelling}" if spelling else ""
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}{hint}")

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("broken" if self._broken else "open")
        launcher = f", launcher={self._launcher}" if self._launcher else ""
        m = self.membership
        changed = ((f", lost={list(m.lost)}" if m.lost else "")
                   + (f", admitted={list(m.admitted)}" if m.admitted else ""))
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, {state}{launcher}{changed})"

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Release what this communicator created. Idempotent. Not collective by itself."""
        if self._closed:
            return
        if os.getpid() == self._pid:
            refuse_close(type(self).__name__, self._pending_calls())  # before anything is released
        self._closed = True
        if os.getpid() == self._pid:
            for child in self._children.values():
                child.close()
            self._children.clear()
            self._shutdown()

    def _pending_calls(self) -> list[Handle[Any]]:
        """Non-blocking calls still queued or running, here or on a sub-communicator it owns."""
        children = [c for c in self._children.values() if not c._closed]
        return self._queues.pending() + [h for c in children for h in c._pending_calls()]

    def __enter__(self: _T) -> _T:
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._ending_on_error = exc is not None  # (then nothing waits long for peers at close)
        if exc is not None and self._pending_calls():
            # closing under running calls would break them, and raising would hide the error that
            # ends the block: it stays open, and the error says so
            note = getattr(exc, "add_note", None)  # (Python 3.11 and later)
            if note is not None:
                note(f"distcomm: the {type(self).__name__} was left open: non-blocking calls are still pending")
            return
        self.close()

    def start(self, call: Callable[_P, _R], /, *args: _P.args, **kwargs: _P.kwargs) -> Handle[_R]:
        """``call(*args, async_op=True, **kwargs)``, typed: ``comm.start(comm.gather, obj)`` is a
        ``Handle[list[Any]]`` (type checkers can't add ``async_op`` to every signature's return
        type). ``call`` is one of this communicator's collectives."""
        name = getattr(call, "__name__", "")
        if getattr(call, "__self__", None) is not self or name not in COLLECTIVES:
            raise TypeError(f"start() takes a collective of this communicator (comm.gather, ...), got {call!r}")
        return cast("Handle[_R]", cast(Any, call)(*args, async_op=True, **kwargs))

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise CommunicatorStateError(
                f"{type(self).__name__} was created in process {self._pid} and can't be used in "
                f"forked process {os.getpid()}: create a communicator in each process"
            )
        if self._closed:
            raise CommunicatorStateError(f"{type(self).__name__} is closed{self._closed_why}")
        if self._loss_unraised is not None:  # (the loss that broke it, not yet told)
            loss, self._loss_unraised = self._loss_unraised, None
            raise loss
        if self._broken is not None:
            raise CommunicatorStateError(
                f"{type(self).__name__} can't be used after an earlier transport failure "
                f"({self._broken}); its ranks no longer agree on what was sent"
            )
        if self._let_in_at is not None:
            let_in_at, self._let_in_at = self._let_in_at, None
            warn_late_first_call(let_in_at)

    def _mark_broken(self, why: str) -> None:
        if self._broken is None:  # the first failure is the one worth naming
            self._broken = why

    def _state(self) -> str:
        """What this rank is doing, with the user's call sites, for other ranks' error messages."""
        raised = self._raised
        if self._busy.locked():
            now = f"in {self._op_label} #{self._seq} at {where(self._site)}"
        elif raised is not None:
            number = "(before its first exchange)" if raised[1] is None else f"#{raised[1]}"
            now = f"{raised[3]} in {raised[0]} {number} at {where(raised[2])}"
        else:
            now = "not in a collective"
        last = self._done
        return now + ("" if last is None else f" (last returned: {last[0]} #{last[1]} at {where(last[2])})")

    # ------------------------------------------------------------------ settings and arguments
    def _settings(self) -> dict[str, Any]:
        """The settings every rank of a communicator must share."""
        return {"slot_bytes": self.slot_bytes, "max_bytes": self.max_bytes,
                "serializer": type(self.serializer).__name__}

    def _sub_settings(self, timeout: float | None) -> dict[str, Any]:
        return sub_settings(self, timeout)

    @property
    def _slot_size(self) -> int:
        """The first exchange's slot: ``slot_bytes`` in small worlds, a bare header slot beyond."""
        return self.slot_bytes if self.world_size <= _frame.SMALL_WORLD else _frame.HEADER_SLOT

    def _op_timeout(self, timeout: float | datetime.timedelta | None) -> float | None:
        return seconds(timeout, self._timeout)

    def _check_root(self, name: str, root: int) -> None:
        if isinstance(root, bool) or not isinstance(root, (int, np.integer)):
            raise TypeError(f"{name} must be an int rank, got {type(root).__name__}")
        if not 0 <= root < self.world_size:
            raise ValueError(f"{name}={root} is out of range for world_size {self.world_size}")

    def _world_of_one_error(self, op: Op, problem: str) -> CollectiveError:
        """The error a world of one raises for a rank's bad input: what every rank raises in larger worlds."""
        return CollectiveError(f"{op.label} failed on rank 0:\n  rank 0: {problem}", op=op.label, ranks=[0])

    def _returns_at_once(self) -> bool:
        """Whether collectives return at once: a world of one that skips the pipeline."""
        return self.world_size == 1 and self._world_of_one_shortcut

    def _cuda_target(self) -> torch.device | None:
        """Where received CUDA tensors are rebuilt (None: on the CPU)."""
        if self.receive_cuda_on == "cpu":
            return None
        if self.device.type == "cuda":
            return self.device
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return torch.device("cuda", torch.cuda.current_device())
        return None

    def _run(self, spec: CallSpec) -> list[Any]:
        """Run one object collective through the pipeline (a transport may wrap it)."""
        return run(self, spec)

    # ------------------------------------------------------------------ object collectives
    def synchronize(self, timeout: float | datetime.timedelta | None = None) -> None:
        """Wait until every rank has called it (a barrier). Every rank must call it."""
        self._check_usable()
        t = self._op_timeout(timeout)
        if self._returns_at_once():
            return
        self._run(CallSpec(Op.SYNCHRONIZE, -1, None, t, serialize=False))
        if not self._agrees_by_reduction:  # (else the agreement's sum, on the device and read back, was one)
            self._device_barrier(t)

    def barrier(self, timeout: float | datetime.timedelta | None = None, *,
                async_op: bool = False) -> Handle[None] | None:
        """torch's and mmengine's name for ``synchronize``; with ``async_op=True``, its Handle (as
        torch's barrier returns its work)."""
        if async_op:
            return self.start(self.synchronize, timeout)
        self.synchronize(timeout)
        return None

    def all_gather(self, obj: Any, *, timeout: float | datetime.timedelta | None = None) -> list[Any]:
        """Collect one object from every rank, on every rank.

        Every rank must call it. Returns a list indexed by rank; this rank's entry is ``obj``
        itself. Objects travel over CPU (CUDA tensors inside are copied to CPU and rebuilt on the
        receiver's device).
        """
        self._check_usable()
        t = self._op_timeout(timeout)
        if self._returns_at_once():
            return [obj]
        return self._run(CallSpec(Op.ALL_GATHER, -1, obj, t))

    def gather(self, obj: Any, dst: int = 0, *, timeout: float | datetime.timedelta | None = None) -> list[Any]:
        """Collect one object from every rank on ``dst``.

        Every rank must call it. Returns the list indexed by rank on ``dst`` and ``[]`` elsewhere.
        Ranks other than dst send from their object's own memory and allocate nothing large.
        """
        self._check_usable()
        self._check_root("dst", dst)
        t = self._op_timeout(timeout)
        if self._returns_at_once():
            return [obj]
        out = self._run(CallSpec(Op.GATHER, int(dst), obj, t))
        return out if self.rank == dst else []

    def broadcast(self, obj: Any = None, src: int = 0, *, timeout: float | datetime.timedelta | None = None) -> Any:
        """Send ``obj`` from ``src`` to every rank; returns it everywhere (on src: obj itself).

        Every rank must call it; ``obj`` is read on ``src`` only.
        """
        self._check_usable()
        self._check_root("src", src)
        t = self._op_timeout(timeout)
        if self._returns_at_once():
            return obj
        out = self._run(CallSpec(Op.BROADCAST, int(src), obj, t))
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
        problem = None
        if self.rank == src:  # objs is not read off src (FakeCommunicator may)
            problem = _scatter_problem(objs, src, self.world_size)
            if self._returns_at_once():
                if problem:
                    raise self._world_of_one_error(Op.SCATTER, problem)
                assert objs is not None
                return objs[0]
        return self._run(CallSpec(Op.SCATTER, src, objs, t, problem=problem))[self.rank]

    def _refuse(self, op: Op, root: int, problem: str, timeout: float | datetime.timedelta | None = None) -> None:
        """Join the collective ``op`` (with ``root``) that the other ranks call, with this rank's input
        refused: every rank raises the same CollectiveError naming this rank and ``problem``. For the
        framework adapters (``distcomm.compat``), whose frameworks check some arguments on one rank."""
        self._check_usable()
        if self._returns_at_once():
            raise self._world_of_one_error(op, problem)
        self._run(CallSpec(op, root, None, self._op_timeout(timeout), problem=problem))
        raise AssertionError(f"{op.label}: a refused input passed the exchange")  # (the exchange raises)

    def shared_random_seed(self, *, timeout: float | datetime.timedelta | None = None) -> int:
        """An int in [0, 2**31) that is the same on every rank (drawn by rank 0 from numpy's RNG)."""
        self._check_usable()
        t = self._op_timeout(timeout)
        seed = int(np.random.randint(2**31))
        if self._returns_at_once():
            return seed
        return int(self._run(CallSpec(Op.SHARED_RANDOM_SEED, 0, seed, t))[0])

    def all_to_all(self, objs: Sequence[Any], *, timeout: float | datetime.timedelta | None = None) -> list[Any]:
        """Send ``objs[d]`` to rank d; returns the list of what each rank sent this one, by source.

        Every rank must call it with world_size objects. This rank's own entry is ``objs[rank]``
        itself. Each object travels from its sender straight to its receiver, out of band where large.
        """
        self._check_usable()
        t = self._op_timeout(timeout)
        problem = all_to_all_problem(objs, self.world_size)
        if self._returns_at_once():
            if problem:
                raise self._world_of_one_error(Op.ALL_TO_ALL, problem)
            return [objs[0]]
        return all_to_all(self, objs, problem, t)

    # ------------------------------------------------------------------ dict and object reductions
    def reduce_dict(
        self, input_dict: Mapping[Any, Any], average: bool = True, *, op: ReduceOpLike | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> dict[Any, Any]:
        """Sum (or average) a dict of tensors onto rank 0, element-wise, in one collective.

        Every rank must call it with the same keys, and each key's tensor with the same shape on
        every rank (any shape; scalars are the usual case). Values may also be Python numbers or
        numpy scalars (``loss.item()``), which come back as 0-d tensors. ``op`` ("sum", "mean",
        "max", "min"), where given, decides instead of ``average``. Rank 0 gets the reduced dict
        (keys sorted); other ranks get their input back unchanged. Key sets, shapes or ops that
        differ raise CollectiveMismatchError on every rank, naming the keys and ranks.
        """
        return reduce_dict(self, input_dict, dict_op(average, op), 0, timeout)

    def all_reduce_dict(
        self, input_dict: Mapping[Any, Any], average: bool = True, *, op: ReduceOpLike | None = None,
        timeout: float | datetime.timedelta | None = None,
    ) -> dict[Any, Any]:
        """Like reduce_dict, but every rank gets the reduced dict."""
        return reduce_dict(self, input_dict, dict_op(average, op), None, timeout)

    def reduce_object(self, obj: Any, op: str | Callable[[Any, Any], Any], dst: int = 0, *,
                      timeout: float | datetime.timedelta | None = None) -> Any:
        """Reduce every rank's object onto ``dst`` in rank order: ``op(op(obj_0, obj_1), obj_2)``...

        ``op``: a callable ``op(a, b)``, or "sum", "min", "max", "any", "all", "union" (sets and
        dicts). Returns the result on ``dst`` and None elsewhere. If ``op`` raises, every rank
        raises the same CollectiveError naming the rank whose object it failed on.
        """
        name, fn = object_op(op)
        self._check_root("dst", dst)
        return reduce_objects(self, Op.REDUCE_OBJECT, obj, name, fn, int(dst), timeout)

    def all_reduce_object(self, obj: Any, op: str | Callable[[Any, Any], Any], *,
                          timeout: float | datetime.timedelta | None = None) -> Any:
        """Like reduce_object, with the result on every rank ("did any rank see NaN?": op="any")."""
        name, fn = object_op(op)
        return reduce_objects(self, Op.ALL_REDUCE_OBJECT, obj, name, fn, 0, timeout)

    def scan(self, obj: Any, op: str | Callable[[Any, Any], Any], *,
             timeout: float | datetime.timedelta | None = None) -> Any:
        """Inclusive prefix reduction: rank r gets the reduction of ranks 0..r's objects, in rank order."""
        name, fn = object_op(op)
        return reduce_objects(self, Op.SCAN, obj, name, fn, 0, timeout)

    def exscan(self, obj: Any, op: str | Callable[[Any, Any], Any], *,
               timeout: float | datetime.timedelta | None = None) -> Any:
        """Exclusive prefix reduction: rank r gets the reduction of ranks 0..r-1's objects; rank 0 gets None."""
        name, fn = object_op(op)
        return reduce_objects(self, Op.EXSCAN, obj, name, fn, 0, timeout)

    # ------------------------------------------------------------------ tensor collectives
    # Every rank must pass a tensor of the same dtype and shape (all_gather_tensor: beyond the first
    # dimension). With check=True (the default) the ranks first compare them in one small exchange,
    # and every rank raises the same error, naming the ranks, instead of hanging or reducing
    # mismatched memory. check=False skips that exchange for hot loops: then nothing compares dtypes,
    # shapes, reduce ops or roots across ranks, and all_gather_tensor takes every rank's first
    # dimension to be this rank's. Only all_gather_tensor takes part in autograd.
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, check: bool = True,
                   timeout: float | datetime.timedelta | None = None) -> torch.Tensor:
        """Reduce ``tensor`` across ranks, in place on every rank; returns it.

        ``op``: "sum", "mean", "min", "max" or "prod". Every rank must call it.
        """
        reduce_op = tensor_op(op)
        if check is False and timeout is None:
            out = self._unchecked_fast_path(Op.ALL_REDUCE, -1, tensor, reduce_op)
            if out is not None:
                return out
        return run_tensor_op(self, Op.ALL_REDUCE, -1, tensor, reduce_op, check, timeout)

    def reduce(self, tensor: torch.Tensor, dst: int = 0, op: ReduceOpLike = "sum", *, check: bool = True,
               timeout: float | datetime.timedelta | None = None) -> torch.Tensor:
        """Reduce ``tensor`` across ranks onto ``dst``, in place there; returns it.

        Other ranks' tensors are left as they were. Every rank must call it.
        """
        self._check_root("dst", dst)
        return run_tensor_op(self, Op.REDUCE, int(dst), tensor, tensor_op(op), check, timeout)

    def broadcast_tensor(self, tensor: torch.Tensor, src: int = 0, *, check: bool = True,
                         timeout: float | datetime.timedelta | None = None) -> torch.Tensor:
        """Copy ``src``'s tensor into every rank's ``tensor`` (same dtype and shape); returns it."""
        self._check_root("src", src)
        if check is False and timeout is None:
            out = self._unchecked_fast_path(Op.BROADCAST_TENSOR, int(src), tensor, None)
            if out is not None:
                return out
        return run_tensor_op(self, Op.BROADCAST_TENSOR, int(src), tensor, None, check, timeout)

    def all_gather_tensor(self, tensor: torch.Tensor, *, check: bool = True,
                          timeout: float | datetime.timedelta | None = None) -> torch.Tensor:
        """Every rank's tensor concatenated along dim 0, in rank order, on every rank.

        The first dimension may differ between ranks (with check=True); the rest and the dtype must
        match. A 0-d tensor counts as one row. Differentiable: the gradient of the result is summed
        across ranks and each rank gets its own rows', so every rank must run the backward pass.
        """
        if check is False and timeout is None:
            out = self._unchecked_fast_path(Op.ALL_GATHER_TENSOR, -1, tensor, None)
            if out is not None:
                return out
        return run_tensor_op(self, Op.ALL_GATHER_TENSOR, -1, tensor, None, check, timeout)

    def reduce_scatter_tensor(self, tensor: torch.Tensor, op: ReduceOpLike = "sum", *, check: bool = True,
                              timeout: float | datetime.timedelta | None = None) -> torch.Tensor:
        """Reduce ``tensor`` (dim 0 of world_size x n) across ranks; rank r gets the r-th n-slice."""
        return run_tensor_op(self, Op.REDUCE_SCATTER_TENSOR, -1, tensor, tensor_op(op), check, timeout)

    # ------------------------------------------------------------------ machines
    def _set_machines(self, machines: list[list[int]]) -> None:
        """Take ``machines`` (the ranks of each machine, in order) as the local grouping."""
        mine = next(m for m in machines if self.rank in m)
        self._local = (mine.index(self.rank), len(mine))


def _scatter_problem(objs: Any, src: int, world: int) -> str | None:
    """What is wrong with scatter's list on its root (None: nothing); reported on every rank."""
    if objs is None or isinstance(objs, (str, bytes)) or not isinstance(objs, Sequence):
        return f"scatter on src {src} needs a sequence of {world} objects, got {type(objs).__name__}"
    if len(objs) != world:
        return f"scatter on src {src} got {len(objs)} objects for world_size {world}"
    return None


for _name in (*COLLECTIVES, "sync_state", "check_identical"):  # (the state calls run their own exchanges)
    setattr(Communicator, _name, exclusive(getattr(Communicator, _name)))
# not public, but one collective at a time like them: it takes part in the other ranks' collective
Communicator._refuse = exclusive(Communicator._refuse)  # type: ignore[method-assign]
