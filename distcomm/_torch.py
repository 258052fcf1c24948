"""Communicators over torch.distributed: GlooCommunicator (CPU) and NcclCommunicator (CUDA)."""

from __future__ import annotations

import datetime
import functools
import math
import os
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, Literal, NamedTuple, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from . import _frame
from ._communicator import (
    DEFAULT_SLOT_BYTES,
    DEFAULT_TIMEOUT,
    Communicator,
    Op,
    _Alike,
    _exclusive,
    _seconds,
    _states_table,
)
from ._errors import (
    CollectiveError,
    CollectiveTimeoutError,
    CommunicatorStateError,
    DistCommError,
    FrameError,
    PeerError,
)
from ._serialization import Serializer

__all__ = ["GlooCommunicator", "NcclCommunicator"]

_SETTLE_SECONDS = 0.02
"""How long close() lets the transport's threads finish releasing the last ops."""

_HOW_TO_START = (
    "torch.distributed is not initialized. Start it with {cls}.from_env() (under torchrun), "
    "with distcomm.launch(main, num_processes_per_machine=N), or with "
    "torch.distributed.init_process_group(...) before creating a {cls}"
)


def _c10d() -> Any:
    return torch._C._distributed_c10d


@functools.lru_cache(maxsize=16)
def _timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _td(seconds: float | None) -> datetime.timedelta | None:
    return None if seconds is None else datetime.timedelta(seconds=seconds)


class _Waiters:
    """Threads that wait on transport work for a caller that watches (Ctrl-C, peers' liveness):
    kept between calls (starting a thread costs more than handing it a job); one that is stuck on a
    wait that never ends (its communicator is broken then) is simply not reused."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[Any]] = []
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], None]) -> tuple[threading.Event, list[BaseException]]:
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="distcomm-wait", daemon=True).start()
        done, failed = threading.Event(), list[BaseException]()
        jobs.put((fn, done, failed))
        return done, failed

    def forget(self) -> None:
        self._idle = []
        self._lock = threading.Lock()

    def _serve(self, jobs: queue.SimpleQueue[Any]) -> None:
        while True:
            fn, done, failed = jobs.get()
            try:
                fn()
            except BaseException as e:
                failed.append(e)
            done.set()
            with self._lock:
                self._idle.append(jobs)


_WAITERS = _Waiters()
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=_WAITERS.forget)


_I64 = struct.Struct("<q")

SUMMARY_CARRY = 376
"""The bytes of a broadcast's payload from rank 0 that the header exchange's summary carries in a
world on one machine (``_summary_size``): a broadcast from rank 0 of up to this many bytes after
its slot (a seed, a dict of a few dozen numbers, a short list of names) takes the exchange's two
native calls and no third. Every exchange's summary has room for them, at any op (its size can't
depend on what the ranks agree on before they have agreed): at a slot of 64 bytes, a summary of 512."""

SUMMARY_CARRY_ACROSS = 64
"""``SUMMARY_CARRY`` in a world across machines (a seed, a flag, a step count, a short name): there
the summary crosses the network on every call, each of the blocks' first ranks sending it to each
of its children, so it stays short (a barrier's busiest rank then sends 1.8x torch's on the wire at
8 hosts, against 1.7x with no room at all and 2.6x with the room of one machine)."""


def _summary_size(size: int, carry: int) -> int:
    """The header exchange's summary for slots of ``size`` bytes: the odd rank + 1, the common
    slot, the odd slot (``_summarize``), then ``carry`` bytes of a broadcast's payload."""
    return 8 + 2 * size + carry


def _summarize(table: bytes | bytearray | memoryview, world: int, size: int, out: memoryview) -> int:
    """Write into ``out`` (8 + 2 * size bytes or more) the short form of a table of ``world`` slots
    when all but at most one are alike: the odd rank + 1 (0: none), the common slot, the odd slot
    (zeros: none); else -1. Bytes of ``out`` beyond those are left as they are.
    Returns the odd rank (-1: none; -2: the slots differ more).

    In bytes comparisons (memcmp) of the table against itself shifted by one slot: slots a..b-1
    are alike when the bytes of slots a..b-2 equal those of slots a+1..b-1. One comparison for a
    table with no odd slot, two with slot 0 odd (a broadcast from rank 0), a binary search of
    log2(world) prefixes for another odd slot. A ``bytes`` or ``bytearray`` table of exactly
    ``world`` slots is read in place, with nothing allocated; anything else is copied once."""
    data = table if isinstance(table, (bytes, bytearray)) and len(table) == world * size else \
        bytes(table[: world * size])
    if len(data) != world * size:
        raise ValueError(f"a table of {world} slots of {size} bytes needs {world * size} bytes, got {len(data)}")
    rows = memoryview(data)

    def alike(a: int, b: int) -> bool:  # slots a..b-1 are all the same
        return b - a <= 1 or data.startswith(rows[(a + 1) * size : b * size], a * size)

    odd, common = -1, 0
    # (the two common cases inline: every slot alike; every slot but slot 0, a broadcast from rank 0)
    if world > 1 and not data.startswith(rows[size:], 0):
        if world >= 3 and data.startswith(rows[2 * size :], size):
            odd, common = 0, 1
        else:  # the first slot unlike slot 0, then whether every slot after it is slot 0 again
            lo, hi = 1, world - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if alike(0, mid + 1):
                    lo = mid + 1
                else:
                    hi = mid
            rest = lo + 1
            back = rest == world or (alike(rest, world) and data.startswith(rows[:size], rest * size))
            odd = lo if back else -2
    _I64.pack_into(out, 0, odd + 1 if odd >= -1 else -1)
    if odd == -2:
        return odd
    out[8 : 8 + size] = rows[common * size : (common + 1) * size]
    # no odd slot: zeros, not the slot of an earlier call's summary (``out`` is reused from call to call)
    out[8 + size : 8 + 2 * size] = rows[odd * size : (odd + 1) * size] if odd >= 0 else bytes(size)
    return odd


def _expand(summary: memoryview, world: int, size: int) -> memoryview:
    """The table of ``world`` slots that a summary (``_summarize``'s, not -1) stands for: the common
    slot repeated, the odd one in its place. One allocation, filled by repeated memcpy."""
    odd = _I64.unpack_from(summary, 0)[0] - 1
    if not -1 <= odd < world:
        raise FrameError(f"the header exchange's summary names rank {odd} as the odd one, in a world of {world}")
    table = bytearray(summary[8 : 8 + size]) * world
    if odd >= 0:
        table[odd * size : (odd + 1) * size] = summary[8 + size : 8 + 2 * size]
    return memoryview(table)


_MACHINE_BLOCK_MAX = 64


def _header_blocks(world: int, machines: list[list[int]]) -> list[list[int]]:
    """The blocks of the header exchange (``_TorchCommunicator._gather_headers``): each block's
    first rank gathers its block's slots, and rank 0 gathers those blocks' tables from their first
    ranks. The machines, when each holds two ranks or more (and at most ``_MACHINE_BLOCK_MAX``): the
    first level then stays inside each machine, and one machine is one block (a gather on rank 0);
    else (machines of one rank, or too large) rank 0 alone, and the other ranks in runs of
    ceil(sqrt(world - 1)) consecutive ranks: no rank handles more than about 2 sqrt(world)
    messages, and rank 0, which every table reaches, takes only the runs' tables (one message per
    run, not a run of its own as well)."""
    if world <= _frame.SMALL_WORLD:
        return [list(range(world))]
    if min(len(m) for m in machines) >= 2 and max(len(m) for m in machines) <= _MACHINE_BLOCK_MAX \
            and machines[0][0] == 0:
        return [list(m) for m in machines]
    b = math.isqrt(world - 2) + 1
    return [[0]] + [list(range(i, min(i + b, world))) for i in range(1, world, b)]


def _table_index(blocks: list[list[int]], world: int) -> np.ndarray[Any, Any] | None:
    """Where each rank's slot lies in the tables rank 0 gathers from the blocks' first ranks (block
    by block, each as long as the longest block): index[r] is rank r's row. None when those tables
    are the table itself (blocks of consecutive ranks, in order, all of one length), so they can
    land in it as they are."""
    per = max(len(b) for b in blocks)
    if all(b == list(range(i * per, (i + 1) * per)) for i, b in enumerate(blocks)) and len(blocks) * per == world:
        return None
    index = np.empty(world, dtype=np.intp)
    for i, b in enumerate(blocks):
        index[b] = np.arange(i * per, i * per + len(b))
    return index


_Call = tuple[Callable[..., Any], tuple[Any, ...], str, int, int]
"""A native call of the header exchange: its post, its arguments but the options, the kind of
its options, the bytes it sends and receives on this rank."""


class _Calls:
    """A run of the header exchange's native calls (``_post_calls``), made once per layout: with
    the bytes they move on this rank, and each one's post and arguments with the options of the
    last timeout they ran with (a deadline's shrinking timeout makes them again, from the cache of
    options)."""

    __slots__ = ("calls", "posts", "received", "sent", "timeout")

    def __init__(self, calls: list[_Call]) -> None:
        self.calls = calls
        self.sent, self.received = sum(c[3] for c in calls), sum(c[4] for c in calls)
        self.timeout: float | None = None
        self.posts: list[tuple[Callable[..., Any], tuple[Any, ...]]] | None = None


class _HeaderBufs(NamedTuple):
    """One rank's buffers for the header exchange (``_TorchCommunicator._make_header_bufs``)."""

    table: bytearray | None  # rank 0: the table's memory
    out: torch.Tensor  # the table (every rank's slot, in rank order); rank 0's over ``table``
    view: memoryview  # of ``out``
    mine: torch.Tensor  # this rank's row of ``out``: what it sends in its block
    held: torch.Tensor  # what it sends up to rank 0 (a block's first rank: its block's slots)
    up: _Calls  # the native calls up: in the block, then among the blocks' first ranks
    take: tuple[Any, Any, Any] | None  # rank 0, where the blocks' tables aren't laid out as the table:
    # np.take's (blocks' tables, index, the table), as numpy arrays over the buffers
    down: _Calls  # the summary's way down: to the blocks' first ranks, then within each block
    down_table: _Calls  # the table's, the same way, when the summary says it follows
    summary: torch.Tensor
    sview: memoryview  # of ``summary``
    carry: memoryview  # the summary's room for a broadcast's payload from rank 0 (_summary_carry bytes)


@functools.lru_cache(maxsize=4096)
def _binomial_children(m: int, v: int) -> int:
    """How many ranks gloo's binomial broadcast in a group of ``m`` has rank ``v`` (from the root)
    send to: v + 2**k for every 2**k > v."""
    return sum(1 for k in range(m.bit_length()) if 2**k > v and v + 2**k < m)


def _process_id() -> tuple[str, int, int]:
    """(boot id, PID namespace, pid): two ranks with the same first two can see each other's pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux: no liveness checks
        return (f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}", 0, os.getpid())
    return (boot, namespace, os.getpid())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # exited, not yet reaped by its parent
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


_REUSABLE_NAMES: set[str] = set()
"""Names of live groups this process made with use_local_synchronization, whose names torch may
give again once they are destroyed (see ``_TorchCommunicator._forget_keys``)."""


def _machine_key(machine: str | int | None) -> str:
    if isinstance(machine, str) and machine.startswith(("given:", "torchrun-node:", "host:")):
        return machine  # a key already made (a sub-communicator's, from its parent)
    if machine is not None:
        return f"given:{machine}"
    if "TORCHELASTIC_RUN_ID" in os.environ and "GROUP_RANK" in os.environ:
        return f"torchrun-node:{os.environ['GROUP_RANK']}"
    return f"host:{socket.gethostname()}"


class _TorchCommunicator(Communicator):
    """Shared plumbing of the torch.distributed communicators."""

    def __init__(
        self,
        group: Any = None,
        *,
        timeout: float | datetime.timedelta | None = None,
        serializer: Serializer | None = None,
        max_bytes: int | None = None,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        receive_cuda_on: Literal["device", "cpu"] = "device",
        machine: str | int | None = None,
        _owns_default: bool = False,
    ) -> None:
        super().__init__(timeout=timeout, serializer=serializer, max_bytes=max_bytes, slot_bytes=slot_bytes,
                         receive_cuda_on=receive_cuda_on)
        if not dist.is_available():
            raise CommunicatorStateError("this torch build has no torch.distributed")
        if not dist.is_initialized():
            raise CommunicatorStateError(_HOW_TO_START.format(cls=type(self).__name__))
        default = dist.distributed_c10d._get_default_group()
        self._group: Any = default if group is None else group
        self._is_world = self._group is default
        self._owns_default = _owns_default
        self._owned: list[Any] = []
        rank = dist.get_rank(self._group)
        if rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the given group")
        self._rank = rank
        self._world = dist.get_world_size(self._group)
        self._ranks = list(dist.get_process_group_ranks(self._group))
        self._check_backend(dist.get_backend(self._group))
        self._opts_cache: tuple[float | None, Any] | None = None
        self._opts_made: dict[tuple[str, float | None, str | None, int | None], Any] = {}
        self._slot_bufs: tuple[torch.Tensor, memoryview, torch.Tensor, memoryview] | None = None
        self._obj_group: Any = self._object_group()
        try:
            self._store: Any = dist.distributed_c10d._get_default_store()
        except Exception:  # a store is only used to name missing ranks after a failure
            self._store = None
        self._token = ""
        self._peer_pids: dict[int, int] = {}  # same-machine peers' pids, from set-up
        self._local_group: Any = self._group
        # the header exchange's blocks, this rank's block and the groups it gathers and broadcasts
        # in (see _gather_headers); until set-up has made them, one block: the whole group
        self._blocks: list[list[int]] = [list(range(self._world))]
        self._block: list[int] = self._blocks[0]
        self._place = (0, self._rank)  # (this rank's block, its place in it)
        self._block_group: Any = self._obj_group
        self._leader_group: Any = None
        self._table_index: np.ndarray[Any, Any] | None = None  # see _table_index
        self._header_bufs: dict[int, _HeaderBufs] = {}  # per slot size, for this layout (_make_header_bufs)
        self._carry: memoryview | None = None  # see _carried
        self._summary_carry = SUMMARY_CARRY_ACROSS  # until set-up knows the machines (every rank alike)
        self._machine_key = _machine_key(machine)
        self._seq = -1  # set-up is call #0: the user's calls count from 1, as in the test doubles
        try:  # as a collective: other ranks' error messages then say this rank is in set-up, and where
            _exclusive(type(self)._setup)(self, self._machine_key)
        except BaseException:
            self._shutdown()
            raise
        self._done = None  # "last returned" names the user's collectives, not set-up

    # ------------------------------------------------------------------ set-up
    def _check_backend(self, backend: str) -> None:
        raise NotImplementedError

    def _object_group(self) -> Any:
        return self._group

    def _local_backend(self) -> str | None:
        return None

    def _new_group(self, ranks: list[int], backend: str | None) -> Any:
        g = dist.new_group(
            [self._ranks[r] for r in ranks], backend=backend, timeout=_td(self._timeout),
            use_local_synchronization=not self._is_world,
        )
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            self._owned.append(g)
            if not self._is_world:
                _REUSABLE_NAMES.add(g.group_name)
        return g

    def _forget_keys(self, names: list[str]) -> None:
        """Delete the store keys of the groups ``names``, destroyed: torch names a group made with
        use_local_synchronization from its ranks and its members' count of groups, which destroying
        it brings back down, so the next group of those ranks gets the same name; its members would
        then read the closed group's addresses from the store ("Connection refused") instead of
        each other's. Each member deletes the keys when it closes, before it can take part in the
        exchange that makes the next group of that name. Best effort: a store that can't be reached
        at teardown (the job is ending) leaves them."""
        if not names or self._store is None:
            return
        try:
            keys = [k for k in self._store.list_keys() if k.startswith(tuple(f"{n}/" for n in names))]
            for k in keys:
                self._store.delete_key(k)
        except Exception:  # noqa: S110 - best effort on teardown
            pass

    def _setup(self, machine: str) -> None:
        # Set-up's slot has one size whatever the settings, so ranks whose settings differ still
        # meet in the same exchange, and every rank then refuses the difference alike.
        token = secrets.token_hex(8)
        infos = self._run(Op.SETUP, -1, (machine, token, self._settings(), _process_id()), self._timeout,
                          slot_size=_frame.HEADER_SLOT)
        self._stats.pop(Op.SETUP.label, None)  # the user never called it
        self._check_settings([info[2] for info in infos])
        self._token = infos[0][1]
        # peers whose process this rank can see (same kernel, same PID namespace): a long wait checks
        # that they still exist, since a dead peer's connections stay open while a process it forked
        # (a data loader's worker) holds them, and the transport then notices nothing
        here = _process_id()[:2]
        self._peer_pids = {r: info[3][2] for r, info in enumerate(infos)
                           if r != self._rank and tuple(info[3][:2]) == here}
        keys = [info[0] for info in infos]
        self._set_machines([[r for r, k in enumerate(keys) if k == key] for key in dict.fromkeys(keys)])

    def _set_machines(self, machines: list[list[int]]) -> None:
        super()._set_machines(machines)
        for members in machines:  # every rank creates every machine's group, in the same order
            group = self._group if len(machines) == 1 else self._new_group(members, self._local_backend())
            if self._rank in members:
                self._local_group = group
        # the summary's room, just before the buffers that hold it are made again
        self._summary_carry = SUMMARY_CARRY if len(machines) == 1 else SUMMARY_CARRY_ACROSS
        self._set_header_blocks(_header_blocks(self._world, machines),
                                machines if self._obj_group is self._group else None)

    def _set_header_blocks(self, blocks: list[list[int]], machines: list[list[int]] | None) -> None:
        """Make the groups of the header exchange's ``blocks`` (every rank makes every group, in the
        same order); ``machines``: where blocks that are machines may use the machine groups."""
        self._blocks = blocks
        self._table_index = _table_index(blocks, self._world)
        self._header_bufs = {}
        self._place = next((i, b.index(self._rank)) for i, b in enumerate(blocks) if self._rank in b)
        self._block = blocks[self._place[0]]
        if len(blocks) == 1:
            self._block_group, self._leader_group = self._obj_group, None
            return
        # Every rank joins the same number of new groups, one per level: torch names a group made
        # with use_local_synchronization (a sub-communicator's, or the user's own) from the count of
        # groups each member is in, so members whose counts differ would never meet. Hence a group
        # for a block of one rank too, and at the second level one group for the blocks' j-th ranks
        # for every j (the first ranks' is the one the exchange uses; on machines, the others are
        # the "rails" of local rank j).
        self._block_group = None
        for block in blocks:
            group = (self._local_group if machines is not None and blocks == machines
                     else self._new_group(block, "gloo"))
            if self._rank in block:
                self._block_group = group
        self._leader_group = None
        for j in range(max(len(b) for b in blocks)):
            group = self._new_group([b[j] for b in blocks if len(b) > j], "gloo")
            if j == 0 and self._place[1] == 0:
                self._leader_group = group

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def group(self) -> Any:
        """The torch process group this communicator's tensor collectives use."""
        return self._group

    @property
    def local_group(self) -> Any:
        """The process group of the ranks on this machine."""
        return self._local_group

    def _shutdown(self) -> None:
        # A gloo worker drops its reference to a finished op's tensors after the op completes, and
        # that needs the GIL. Release the GIL for a moment so that it can, now: at interpreter exit
        # it would abort the process ("terminate called without an active exception").
        time.sleep(_SETTLE_SECONDS)
        reused = []
        for g in reversed(self._owned):
            name = getattr(g, "group_name", None)
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: S110 - best effort on teardown
                pass
            if name in _REUSABLE_NAMES:
                _REUSABLE_NAMES.discard(name)
                reused.append(name)
        self._forget_keys(reused)
        destroyed = bool(self._owned)
        self._owned.clear()
        if self._owns_default:
            from ._context import clear_default

            clear_default(self)
        if self._owns_default and dist.is_initialized():
            destroyed = True
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: S110 - best effort on teardown
                pass
        if destroyed:  # let go of them, so that they are torn down now where nothing else holds them
            self._group = self._obj_group = self._local_group = self._store = None
            self._block_group = self._leader_group = None
            self._header_bufs, self._carry = {}, None  # its native calls are the groups' bound methods

    # ------------------------------------------------------------------ transport
    # Waits longer than a slice look, between slices, at Ctrl-C and at the peers' processes. A
    # collective's work can be waited on again after a wait times out; a point-to-point one can't (a
    # timed-out wait closes gloo's connection), so large point-to-point transfers are waited on by a
    # helper thread while this one watches, and small ones (which finish at once) in one piece.
    # A peer whose process is gone fails the wait only if the wait still needs it DEAD_GRACE seconds
    # later: a peer that did its part and exited (the end of a job) is no failure.
    _SLICE = 1.0
    _DEAD_GRACE = 5.0
    _WATCHED_P2P_BYTES = 1 << 20
    _sliced_waits = True  # NCCL: no (a timed-out wait may abort its communicator)

    def _wait(self, works: list[Any], timeout: float | None, p2p_peers: list[int] | None = None,
              p2p_bytes: int = 0, start: float | None = None) -> None:
        """Wait for ``works``; ``p2p_peers``: point-to-point works, and the peer of each.

        Point-to-point waits are handed to a helper thread when they can last: large transfers, and
        any in worlds beyond 4 ranks (where a peer that is late or gone leaves this rank waiting in
        them); small ones in small worlds finish at once, and the hand-off would cost more.
        ``start``: when the caller began waiting (its first slice ran out), for sliced waits."""
        try:
            if not self._sliced_waits or (
                    p2p_peers is not None and p2p_bytes < self._WATCHED_P2P_BYTES
                    and self._world <= _frame.SMALL_WORLD):
                self._wait_whole(works, timeout)
            elif p2p_peers is not None:
                self._wait_watched(works, timeout, p2p_peers)
            else:
                self._wait_sliced(works, timeout, start)
        except DistCommError:
            raise
        except Exception as e:
            self._fail(e, timeout)
        except BaseException as e:
            self._interrupted(e)
            raise

    @staticmethod
    def _wait_whole(works: list[Any], timeout: float | None, progress: list[int] | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for i, w in enumerate(works):
            if progress is not None:
                progress[0] = i
            if deadline is None:
                w.wait()
            elif len(works) == 1:
                w.wait(_timedelta(timeout))
            else:
                w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))

    def _wait_sliced(self, works: list[Any], timeout: float | None, start: float | None = None) -> None:
        deadline = None if timeout is None else (time.monotonic() if start is None else start) + timeout
        seen: dict[int, float] = {}
        if start is not None:  # a first slice already ran out
            self._check_peers(self._peer_pids, seen)
        for w in works:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                step = self._SLICE if left is None or left > self._SLICE else max(left, 0.001)
                try:
                    w.wait(_timedelta(step))
                    break
                except RuntimeError as e:  # a slice ran out ("Operation timed out!"), or the transport failed
                    if (left is not None and left <= self._SLICE) or "timed out" not in str(e).lower():
                        raise
                self._check_peers(self._peer_pids, seen)

    def _wait_watched(self, works: list[Any], timeout: float | None, peers: list[int]) -> None:
        progress = [0]  # the work the helper waits on now: the ones before it are done
        self._watch(lambda: self._wait_whole(works, timeout, progress), timeout,
                    lambda: dict.fromkeys(peers[progress[0]:]))

    def _watch(self, fn: Callable[[], None], timeout: float | None, needed: Callable[[], Iterable[int]]) -> None:
        """Run ``fn`` in a waiter thread while this one watches: Ctrl-C, the processes of the peers
        ``needed()`` names, and a helper that never finishes (bounded by the timeout)."""
        done, failed = _WAITERS.run(fn)
        start, seen = time.monotonic(), dict[int, float]()
        while not done.wait(self._SLICE):
            self._check_peers(needed(), seen)
            if timeout is not None and time.monotonic() - start > timeout + self._DEAD_GRACE:
                self._mark_broken(f"{self._op_label} (call #{self._seq}): the transport didn't finish")
                raise CollectiveTimeoutError(f"{self._op_label} (call #{self._seq}) timed out after {timeout}s "
                                             f"(the transport didn't finish)", op=self._op_label)
        if failed:
            raise failed[0]

    def _interrupted(self, e: BaseException) -> None:
        """Ctrl-C (any BaseException) while waiting: the peers still expect this call's messages."""
        self._mark_broken(f"{self._op_label} (call #{self._seq}) was interrupted ({type(e).__name__}) while "
                          f"waiting for its peers")

    def _check_peers(self, needed: Iterable[int], seen: dict[int, float]) -> None:
        """Raise PeerError for a peer this wait needs whose process has been gone for DEAD_GRACE."""
        now = time.monotonic()
        gone = []
        for r in needed:
            pid = self._peer_pids.get(r)
            if pid is not None and not _alive(pid):
                if now - seen.setdefault(r, now) >= self._DEAD_GRACE:
                    gone.append((r, pid))
        if gone:
            what = f"{self._op_label} (call #{self._seq})"
            names = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone)
            self._mark_broken(f"{what}: {names} exited")
            raise PeerError(f"{what}: lost a peer: {names} on this machine exited while this rank still needed it "
                            f"(its connections may stay open in a process it forked, so the transport can't tell)",
                            op=self._op_label, ranks=[r for r, _ in gone])

    def _alltoall_opts(self, timeout: float | None) -> Any:
        cached = self._opts_cache
        if cached is None or cached[0] != timeout:
            opts = _c10d().AllToAllOptions()
            if timeout is not None:
                opts.timeout = datetime.timedelta(seconds=timeout)
            cached = self._opts_cache = (timeout, opts)
        return cached[1]

    def _exchange_slots(self, slot: bytearray, size: int, timeout: float | None,
                        carry: Sequence[memoryview] = (), own: Sequence[bytearray] = ()) -> tuple[memoryview, _Alike]:
        self._carry = None
        if self._world > _frame.SMALL_WORLD:
            return self._gather_headers(slot, size, timeout, carry)
        return super()._exchange_slots(slot, size, timeout, carry, own)

    def _carried(self, root: int, total: int) -> memoryview | None:
        # rank 0 wrote them into the summary when it was the root and the odd slot (every other
        # slot alike: the broadcast's common case) and they fit: what every rank can tell from the
        # summary and the root's slot
        carry = self._carry
        return carry[:total] if carry is not None and root == 0 and 0 < total <= carry.nbytes else None

    def _gather_headers(self, slot: bytearray, size: int, timeout: float | None,
                        carry: Sequence[memoryview] = ()) -> tuple[memoryview, _Alike]:
        """Every rank's slot, in native collectives over the blocks of ``_header_blocks``, in two levels.

        Up: each block's first rank gathers its block's slots (one message from each rank), and rank 0
        gathers those tables from the blocks' first ranks. Down: rank 0 broadcasts a short summary
        when every slot but at most one is the same (agreement-only calls, broadcast, scatter: the
        common slot and the odd one), or else the whole table after the summary that says so: to the
        blocks' first ranks, each of which broadcasts it in its block (gloo's binomial trees).
        When rank 0 is a broadcast's root and its slot the odd one, the summary also carries the
        segments that follow its slot (``carry``), where they fit (``SUMMARY_CARRY``; across
        machines ``SUMMARY_CARRY_ACROSS``).
        A rank alone in its block, or that leads none, makes two native calls (three with the table);
        one that leads a block of several, four (six). With one block (set-up, small worlds) it is a
        gather and a broadcast."""
        world, me, block = self._world, self._rank, self._block
        b = self._header_bufs.get(size)
        if b is None:
            b = self._header_bufs[size] = self._make_header_bufs(size)
        b.view[me * size : (me + 1) * size] = slot
        if self._leader_group is not None and block == [me]:  # it leads a block of its own
            b.held[:size] = b.mine
        # rank 0, a broadcast's root: its payload into the summary's room now, before any native
        # call (nothing of the user's runs between them); read only where the summary then says so
        n = sum(seg.nbytes for seg in carry) if b.table is not None else 0
        if 0 < n <= b.carry.nbytes:
            pos = 0
            for seg in carry:
                b.carry[pos : pos + seg.nbytes] = _frame.flat(seg)
                pos += seg.nbytes
        self._post_calls(b.up, timeout)
        if b.take is not None:  # rank 0: one pass in C over the blocks' tables, not a step per block
            src, index, dst = b.take
            np.take(src, index, axis=0, out=dst)
        sview = b.sview
        if b.table is not None:  # rank 0
            _summarize(b.table, world, size, sview)
        self._post_calls(b.down, timeout)
        odd = _I64.unpack_from(sview, 0)[0] - 1
        self._carry = b.carry if odd == 0 else None
        # what the summary says of the table, for the pipeline's agreement (``_frame.agreed``)
        alike = None if odd == -2 else (odd, bytes(sview[8 : 8 + size]))
        if odd == -2:
            self._post_calls(b.down_table, timeout)
        elif me != 0:  # the table the summary stands for (this rank's own slot is in it, as rank 0 got it)
            return _expand(sview, world, size), alike
        return b.view, alike

    def _post_calls(self, run: _Calls, timeout: float | None) -> None:
        posts = run.posts
        if posts is None or run.timeout != timeout:
            posts = run.posts = [(post, (*args, self._opts(kind, timeout, root=0)))
                                 for post, args, kind, _, _ in run.calls]
            run.timeout = timeout
        self._count(run.sent, run.received)
        for post, args in posts:
            self._native(post, args, timeout)

    def _make_header_bufs(self, size: int) -> _HeaderBufs:
        """The header exchange's buffers for slots of ``size`` bytes in this rank's place in the
        blocks, the views the native gathers fill and each native call's arguments: made once,
        reused by every call (as the small worlds' all-to-all reuses its buffers), so that a call
        makes no view per block or per rank. What the pipeline reads of the table it deserializes,
        and so copies, before the collective returns; a transport failure breaks the communicator,
        so no abandoned collective writes into them under a later call."""
        world, me, blocks, block = self._world, self._rank, self._blocks, self._block
        i, pos = self._place
        # rank 0's table is a bytearray: its summary compares it as bytes, in place (no copy). It is
        # never resized (torch.frombuffer holds a reference to it, not an export).
        table = bytearray(world * size) if me == 0 else None
        out = torch.empty(world * size, dtype=torch.uint8) if table is None else \
            torch.frombuffer(table, dtype=torch.uint8)
        mine = out[me * size : (me + 1) * size]
        leaders = self._leader_group if block[0] == me else None
        wide = max(len(b) for b in blocks) * size
        held = torch.zeros(wide, dtype=torch.uint8) if leaders is not None else mine  # what this rank sends up
        up: list[_Call] = []
        if len(block) > 1:
            into = held if leaders is not None else out
            outs = [[into[j * size : (j + 1) * size] for j in range(len(block))]] if pos == 0 else []
            up.append((self._block_group.gather, (outs, [mine]), "GatherOptions",
                       0 if pos == 0 else size, (len(block) - 1) * size if pos == 0 else 0))
        take = None
        if leaders is not None:
            outs = []
            if me == 0:  # the blocks' tables land in the table itself where they are laid out as it is
                index = self._table_index
                into = out if index is None else torch.empty(len(blocks) * wide, dtype=torch.uint8)
                outs = [[into[j * wide : (j + 1) * wide] for j in range(len(blocks))]]
                if index is not None:
                    take = (into.numpy().reshape(-1, size), index, out.numpy().reshape(world, size))
            up.append((leaders.gather, (outs, [held]), "GatherOptions",
                       0 if me == 0 else wide, (len(blocks) - 1) * wide if me == 0 else 0))
        # odd rank + 1 (0: none; -1: the table follows), the common slot, the odd one, the room for a broadcast
        summary = torch.zeros(_summary_size(size, self._summary_carry), dtype=torch.uint8)

        def down(buf: torch.Tensor) -> _Calls:  # rank 0's buf to the blocks' first ranks, then in each block
            n = buf.numel()
            return _Calls([(group.broadcast, ([buf],), "BroadcastOptions", _binomial_children(members, v) * n,
                            0 if v == 0 else n)
                           for group, members, v in ((leaders, len(blocks), i), (self._block_group, len(block), pos))
                           if group is not None and members > 1])

        sview = memoryview(summary.numpy())  # type: ignore[arg-type]
        return _HeaderBufs(table, out, memoryview(out.numpy()), mine, held, _Calls(up),  # type: ignore[arg-type]
                           take, down(summary), down(out), summary, sview, sview[8 + 2 * size :])

    def _scatter_slots(self, root: int, subs: list[bytearray], size: int, timeout: float | None) -> torch.Tensor | None:
        # beyond small worlds in one native scatter: the root's sends are posted in C++, not a
        # Python post and wait per rank
        if self._world <= _frame.SMALL_WORLD:
            return super()._scatter_slots(root, subs, size, timeout)
        me = self._rank
        buf = torch.empty(size, dtype=torch.uint8)
        ins = [[torch.frombuffer(s, dtype=torch.uint8) for s in subs]] if me == root else []
        if me == root:
            self._count((self._world - 1) * size, 0)
        else:
            self._count(0, size)
        self._native(self._obj_group.scatter, ([buf], ins, self._opts("ScatterOptions", timeout, root=root)), timeout)
        return None if me == root else buf

    def _allgather_small(self, slot: bytearray, size: int, timeout: float | None,
                         own: Sequence[bytearray] = ()) -> memoryview:
        # An all-to-all of the slot repeated once per rank (small worlds only): gloo runs it as
        # direct pairwise exchanges on the tensors' own memory, which on loopback takes about two
        # thirds of the time of its all-gather (a ring behind flatten-and-copy steps).
        # The buffers are reused from call to call: what the pipeline reads from the output
        # (inline segments) is deserialized, and so copied, before the collective returns.
        bufs = self._slot_bufs
        if bufs is None or bufs[0].numel() != self._world * size:
            n = self._world * size
            send, out = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
            bufs = self._slot_bufs = (send, memoryview(send.numpy()), out, memoryview(out.numpy()))  # type: ignore[arg-type]
        send, send_view, out, out_view = bufs
        me = self._rank
        for r in range(self._world):  # a scatter's root: each rank's own slot (its part)
            send_view[r * size : (r + 1) * size] = own[r] if own and r != me else slot
        try:
            work = self._obj_group.alltoall_base(out, send, [], [], self._alltoall_opts(timeout))
        except Exception as e:
            self._fail(e, timeout)
        self._wait([work], timeout)
        return out_view

    def _exchange(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], timeout: float | None
    ) -> None:
        g = self._obj_group
        try:
            works = [g.recv([t], src, 0) for src, t in recvs]
            works += [g.send([t], dst, 0) for dst, t in sends]
        except Exception as e:
            self._fail(e, timeout)
        self._wait(works, timeout, [src for src, _ in recvs] + [dst for dst, _ in sends],
                   sum(t.numel() for _, t in recvs) + sum(t.numel() for _, t in sends))

    def _alltoallv(
        self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor, recv_counts: list[int],
        timeout: float | None,
    ) -> None:
        try:
            work = self._obj_group.alltoall_base(recv, send, recv_counts, send_counts, self._alltoall_opts(timeout))
        except Exception as e:
            self._fail(e, timeout)
        self._wait([work], timeout)

    def _broadcast_buffer(self, buf: torch.Tensor, root: int, timeout: float | None) -> None:
        self._broadcast_in(self._obj_group, self._world, (self._rank - root) % self._world, buf, timeout, root)

    def _broadcast_in(self, group: Any, members: int, v: int, buf: torch.Tensor, timeout: float | None,
                      root: int = 0) -> None:
        """gloo's broadcast of ``buf`` in ``group`` (of ``members`` ranks, this one ``v`` from the
        root): one post, a binomial tree in C++, counted as such (``_binomial_children``)."""
        n = buf.numel()
        self._count(_binomial_children(members, v) * n, 0 if v == 0 else n)
        self._native(group.broadcast, ([buf], self._opts("BroadcastOptions", timeout, root=root)), timeout)

    def _reduce_tensor(self, tensor: torch.Tensor, dst: int | None, timeout: float | None) -> None:
        self._tensor_reduce(tensor, dst, "sum", timeout)

    # ------------------------------------------------------------------ tensor transport: the native collectives
    _REDUCE_OPS: ClassVar[dict[str, str]] = {"sum": "SUM", "mean": "SUM", "min": "MIN", "max": "MAX", "prod": "PRODUCT"}

    def _device_problem(self, tensor: torch.Tensor) -> str | None:
        if not tensor.is_cpu:
            return (f"{type(self).__name__} takes CPU tensors, this one is on {tensor.device} "
                    f"(NcclCommunicator moves CUDA tensors)")
        return None

    def _opts(self, kind: str, timeout: float | None, op: str | None = None, root: int | None = None) -> Any:
        """A native collective's options, made once per combination (torch copies them per call)."""
        key = (kind, timeout, op, root)
        opts = self._opts_made.get(key)
        if opts is None:
            c = _c10d()
            opts = getattr(c, kind)()
            if timeout is not None:
                opts.timeout = datetime.timedelta(seconds=timeout)
            if op is not None:
                opts.reduceOp = getattr(c.ReduceOp, self._REDUCE_OPS[op])
            if root is not None:
                opts.rootRank = root
            if kind == "BroadcastOptions":
                opts.rootTensor = 0
            if len(self._opts_made) > 256:
                self._opts_made.clear()
            self._opts_made[key] = opts
        return opts

    def _native(self, post: Callable[..., Any], args: tuple[Any, ...], timeout: float | None) -> None:
        """Post one native collective, ``post(*args)``, and wait for it."""
        try:
            work = post(*args)
        except Exception as e:
            self._fail(e, timeout)
        self._wait_one(work, timeout)

    def _wait_one(self, work: Any, timeout: float | None) -> None:
        """``_wait([work], timeout)`` for one native collective, with its common case (done within
        the first slice) in one timed wait: the tensor collectives' hot path runs few lines."""
        if not self._sliced_waits or (timeout is not None and timeout <= self._SLICE):
            self._wait([work], timeout)
            return
        start = time.monotonic()
        try:
            work.wait(_timedelta(self._SLICE))
            return
        except Exception as e:  # the slice ran out ("Operation timed out!"), or the transport failed
            if not isinstance(e, RuntimeError) or "timed out" not in str(e).lower():
                self._fail(e, timeout)
        except BaseException as e:  # Ctrl-C
            self._interrupted(e)
            raise
        self._wait([work], timeout, start=start)

    _lane_device = torch.device("cpu")  # the device whose tensors the lane takes (NCCL: its own)

    def _lane(self, op: Op, root: int, tensor: torch.Tensor, rop: str | None) -> torch.Tensor | None:
        # _tensor_op's check=False path for the common case, inlined into one call: each Python call
        # between a training loop and the native collective costs it microseconds with cold caches
        # (measured on gloo: this cut what a call adds to torch.distributed's own by half or more).
        # Anything uncommon (not a plain contiguous tensor, autograd, a reduction the dtype can't
        # take, another device, a closed or broken communicator) returns None: _tensor_op then runs,
        # and words the error; it also materializes conjugate views, whose memory isn't their value, and
        # moves complex tensors as real pairs.
        if (type(tensor) is not torch.Tensor or tensor.requires_grad or not tensor.is_contiguous()
                or tensor.is_complex() or tensor.is_neg() or tensor.device != self._lane_device or self._world == 1
                or self._closed or self._broken is not None or os.getpid() != self._pid):
            return None
        if rop == "mean" and not tensor.is_floating_point():  # (min and max refuse only complex: above)
            return None
        st = self._stats.get(op.label) or self._stat(op)  # (_stat's lookup, without its call)
        st.calls += 1
        self._cur = st
        self._op_label = op.label
        t = self._timeout
        t0 = time.perf_counter()
        world = self._world
        nbytes = tensor.numel() * tensor.element_size()
        if op is Op.ALL_GATHER_TENSOR:
            x = tensor if tensor.dim() else tensor.reshape(1)
            moved = nbytes * (world - 1)  # a ring's share: everyone else's rows, each way
            st.bytes_sent += moved
            st.bytes_received += moved
            out = x.new_empty((x.shape[0] * world, *x.shape[1:]))
            self._native(self._group._allgather_base, (out, x, self._opts("AllgatherOptions", t)), t)
        elif op is Op.ALL_REDUCE:
            assert rop is not None
            moved = 2 * (world - 1) * nbytes // world
            st.bytes_sent += moved
            st.bytes_received += moved
            self._native(self._group.allreduce, ([tensor], self._opts("AllreduceOptions", t, rop)), t)
            if rop == "mean":
                tensor.div_(world)
            out = tensor
        else:
            if self._rank == root:
                st.bytes_sent += nbytes
            else:
                st.bytes_received += nbytes
            self._native(self._group.broadcast, ([tensor], self._opts("BroadcastOptions", t, root=root)), t)
            out = tensor
        st.transfer_s += time.perf_counter() - t0
        return out

    def _tensor_reduce(self, tensor: torch.Tensor, dst: int | None, op: str, timeout: float | None) -> None:
        g = self._group
        if tensor.is_complex():  # a sum (the only complex reduction) of (re, im) pairs: NCCL has no complex types
            tensor = torch.view_as_real(tensor)
        if dst is None:
            self._native(g.allreduce, ([tensor], self._opts("AllreduceOptions", timeout, op)), timeout)
        else:
            self._native(g.reduce, ([tensor], self._opts("ReduceOptions", timeout, op, dst)), timeout)

    def _tensor_broadcast(self, tensor: torch.Tensor, src: int, timeout: float | None) -> None:
        opts = self._opts("BroadcastOptions", timeout, root=src)
        work = torch.view_as_real(tensor) if tensor.is_complex() else tensor  # moved as its (re, im) pairs
        self._native(self._group.broadcast, ([work], opts), timeout)

    def _tensor_all_gather(self, out: torch.Tensor, tensor: torch.Tensor, rows: list[int],
                           timeout: float | None) -> None:
        if tensor.is_complex():  # moved as (re, im) pairs: gloo's all-gather refuses complex types
            out, tensor = torch.view_as_real(out), torch.view_as_real(tensor)
        g, opts = self._group, self._opts("AllgatherOptions", timeout)
        if rows.count(rows[0]) == len(rows):
            self._native(g._allgather_base, (out, tensor, opts), timeout)
            return
        pieces = list(torch.split(out, rows))
        if self._uneven_allgather:
            self._native(g.allgather, ([pieces], [tensor], opts), timeout)
            return
        # gloo's all-gather wants equal sizes: each rank's rows go straight to every peer instead
        me = self._rank
        pieces[me].copy_(tensor)
        peers = [r for r in range(self._world) if r != me]
        try:
            works = [g.recv([pieces[r]], r, 1) for r in peers if rows[r]]
            works += [g.send([tensor], r, 1) for r in peers] if rows[me] else []
        except Exception as e:
            self._fail(e, timeout)
        self._wait(works, timeout, [r for r in peers if rows[r]] + (peers if rows[me] else []),
                   out.numel() * out.element_size())

    _uneven_allgather = False  # NCCL's all-gather takes outputs of different sizes

    def _tensor_reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: str, timeout: float | None) -> None:
        opts = self._opts("ReduceScatterOptions", timeout, op)
        if tensor.is_complex():  # as in _tensor_reduce
            out, tensor = torch.view_as_real(out), torch.view_as_real(tensor)
        self._native(self._group._reduce_scatter_base, (out, tensor, opts), timeout)

    # ------------------------------------------------------------------ sub-communicators
    def _make_sub(self, groups: list[list[int]], mine: list[int] | None, timeout: float | None) -> Communicator | None:
        backend = str(dist.get_backend(self._group))
        made = [self._new_group(members, backend) for members in groups]  # every rank, every group, in order
        if mine is None:
            return None
        group = made[groups.index(mine)]
        sub = type(self)(group, machine=self._machine_key, **self._sub_kwargs(timeout))
        self._owned.remove(group)  # the sub-communicator destroys its group when it closes
        sub._owned.insert(0, group)
        return sub

    def _sub_kwargs(self, timeout: float | None) -> dict[str, Any]:
        return self._sub_settings(timeout)

    # ------------------------------------------------------------------ failures
    def _reported(self, grace: float) -> tuple[list[int], dict[int, str]] | Literal["no store", "unreachable"]:
        """Write that this rank failed at this call, and what it is doing; wait ``grace`` for the
        others. Return who reached this call, and what each rank that failed in any call reported;
        or why not: no store to ask (or set-up, before the ranks share a token), or it didn't answer."""
        if self._store is None or not self._token:
            return "no store"
        prefix = f"distcomm/{self._token}/{self._seq}/"
        states = f"distcomm/{self._token}/state/"
        try:
            self._store.set(states + str(self._rank), self._state())
            self._store.set(prefix + str(self._rank), "1")
            deadline = time.monotonic() + grace
            while True:
                present = [r for r in range(self._world) if self._store.check([prefix + str(r)])]
                if len(present) == self._world or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            told = {r: self._store.get(states + str(r)).decode("utf-8", "replace")
                    for r in range(self._world) if self._store.check([states + str(r)])}
            return present, told
        except Exception:  # the store may be gone with the peer that hosted it
            return "unreachable"

    def _store_host(self) -> int | None:
        """The rank (in this group) whose process serves the job's TCPStore: global rank 0."""
        store = self._store
        while store is not None and hasattr(store, "underlying_store"):  # PrefixStore
            store = store.underlying_store
        if store is None or type(store).__name__ != "TCPStore" or 0 not in self._ranks:
            return None
        return self._ranks.index(0)

    def _fail(self, exc: BaseException, timeout: float | None) -> NoReturn:
        text = str(exc).split("\n")[0]
        low = text.lower()
        seq = self._seq
        what = f"{self._op_label} (call #{seq})"
        self._mark_broken(f"{what}: {text[:160]}")
        grace = 2.0 if timeout is None else min(2.0, max(0.5, timeout / 4))
        reported = self._reported(grace)
        present, told = (None, {}) if isinstance(reported, str) else reported
        missing = [] if present is None else [r for r in range(self._world) if r not in present]
        told[self._rank] = self._state()
        table = "\n" + _states_table(told, self._world)
        who = ""
        if missing:
            who = f"; rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never reported reaching it"
        host = self._store_host() if reported == "unreachable" else None
        if host is not None and host != self._rank:  # the store that names missing ranks is gone: suspect its host
            missing = [host]
            who = f"; rank {host}, which hosts the job's store, is unreachable (it exited or its machine is down)"
        timed_out = "timed out" in low or "timeout" in low
        closed = "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low
        if timed_out and not ("closed by peer" in low and present is not None and not missing):
            raise CollectiveTimeoutError(
                f"{what} timed out after {timeout}s waiting for its peers{who} (transport: {text[:200]}){table}",
                ranks=missing) from exc
        if closed and present is not None and not missing:
            raise CollectiveTimeoutError(
                f"{what}: every rank reached it, but peers gave up (their timeout expired) before this "
                f"rank arrived (transport: {text[:200]}){table}") from exc
        if closed:
            raise PeerError(
                f"{what}: lost a peer (it exited or its connection closed){who} (transport: {text[:200]}){table}",
                ranks=missing) from exc
        raise CollectiveError(f"{what} failed in the transport{who}: {text[:300]}{table}", op=self._op_label,
                              ranks=missing) from exc

    # ------------------------------------------------------------------ construction from the environment
    @classmethod
    def from_env(cls, *, timeout: float | datetime.timedelta | None = None, **kwargs: Any) -> Any:
        """Initialize torch.distributed from the torchrun variables and return a communicator.

        Reads RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (and LOCAL_RANK for the device). The
        communicator owns the default process group: ``close()`` destroys it.
        """
        missing = [v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise CommunicatorStateError(
                f"{cls.__name__}.from_env() needs the torchrun variables; {', '.join(missing)} not set. "
                f"Run under torchrun, or use distcomm.launch()")
        if dist.is_initialized():
            raise CommunicatorStateError(
                f"torch.distributed is already initialized; use {cls.__name__}() to adopt its default group")
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except ValueError as e:
            raise CommunicatorStateError(f"RANK/WORLD_SIZE must be integers: {e}") from e
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return start_world(cls, "env://", rank, world, local_rank, timeout=timeout, **kwargs)


class GlooCommunicator(_TorchCommunicator):
    """A communicator over a gloo process group (CPU).

    Args:
        group: the process group; None adopts the default group of an initialized
            torch.distributed (see ``from_env`` and ``distcomm.launch`` to start one).
        machine: a name for this process's machine, used to compute local ranks; default: the
            torchrun node rank under torchrun, else the host name.
        timeout, serializer, max_bytes, slot_bytes, receive_cuda_on: see ``Communicator``.

    Construction is collective: every rank of the group must create its communicator, in the
    same order; it creates one group per machine, eagerly.
    """

    def _check_backend(self, backend: str) -> None:
        if "gloo" not in str(backend):
            raise ValueError(
                f"GlooCommunicator needs a gloo process group, this one's backend is {backend!r}; "
                f"use NcclCommunicator for NCCL")



class NcclCommunicator(_TorchCommunicator):
    """A communicator whose tensor collectives run over NCCL on this rank's CUDA device.

    Object collectives go over a gloo side group that the communicator creates and owns, so
    objects never stage through GPU memory. The device is bound explicitly: ``device=None``
    takes ``cuda:<local_rank % device_count>``.

    Args:
        group: an NCCL process group; None adopts the default group.
        device: the CUDA device for tensor collectives (an index, a string or a torch.device).
        machine, timeout, serializer, max_bytes, slot_bytes, receive_cuda_on: see GlooCommunicator.
    """

    def __init__(self, group: Any = None, *, device: int | str | torch.device | None = None, **kwargs: Any) -> None:
        if not torch.cuda.is_available():
            raise CommunicatorStateError(
                "NcclCommunicator needs CUDA and NCCL, and this machine has no CUDA device "
                "(torch.cuda.is_available() is False); use GlooCommunicator on CPU")
        if not dist.is_available() or not dist.is_nccl_available():
            raise CommunicatorStateError("NcclCommunicator needs NCCL, and this torch build has none")
        self._requested_device = device
        self._device = torch.device("cuda", 0)
        super().__init__(group, **kwargs)

    def _check_backend(self, backend: str) -> None:
        if "nccl" not in str(backend):
            raise ValueError(
                f"NcclCommunicator needs an NCCL process group, this one's backend is {backend!r}; "
                f"use GlooCommunicator for gloo")

    def _object_group(self) -> Any:
        return self._new_group(list(range(self._world)), "gloo")

    def _local_backend(self) -> str | None:
        return "nccl"

    _uneven_allgather = True
    _sliced_waits = False

    def _device_problem(self, tensor: torch.Tensor) -> str | None:
        if tensor.device != self._device:
            return f"tensor is on {tensor.device}, this NcclCommunicator's device is {self._device}"
        return None

    def _sub_kwargs(self, timeout: float | None) -> dict[str, Any]:
        return {**self._sub_settings(timeout), "device": self._device}

    def _setup(self, machine: str) -> None:
        super()._setup(machine)
        dev = self._requested_device
        count = torch.cuda.device_count()
        if dev is None:
            device = torch.device("cuda", self.local_rank % count)
        else:
            device = torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
            if device.type != "cuda":
                raise ValueError(f"NcclCommunicator needs a CUDA device, got {device}")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if device.index >= count:
                raise ValueError(f"device {device} does not exist: this machine has {count} CUDA devices")
        torch.cuda.set_device(device)
        self._device = self._lane_device = device

    @property
    def device(self) -> torch.device:
        return self._device

    def _device_barrier(self, timeout: float | None) -> None:
        try:
            dist.barrier(group=self._group, device_ids=[self._device.index])
        except Exception as e:
            self._fail(e, timeout)


def start_world(
    cls: type[_TorchCommunicator], init_method: str, rank: int, world: int, local_rank: int, *,
    timeout: float | datetime.timedelta | None = None, **kwargs: Any,
) -> Any:
    """Initialize torch.distributed's default group and return a ``cls`` communicator that owns it.

    The one place that starts a job's group: used by ``from_env`` (torchrun), ``launch`` and
    ``distcomm.testing.spawn``. For NCCL it binds ``cuda:<local_rank % device_count>`` first.
    If the communicator can't be built, the group is destroyed again. The communicator becomes
    the process-wide default (``distcomm.current()`` in every thread) until it is closed.
    """
    from ._context import set_default

    seconds = _seconds(timeout, DEFAULT_TIMEOUT)
    assert seconds is not None
    td = datetime.timedelta(seconds=seconds)
    if issubclass(cls, NcclCommunicator):
        if not torch.cuda.is_available():
            raise CommunicatorStateError(
                "NcclCommunicator needs CUDA and NCCL, and this machine has no CUDA device; "
                "use GlooCommunicator on CPU")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=world, timeout=td,
                                device_id=device)
        kwargs.setdefault("device", device)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world, timeout=td)
    try:
        comm = cls(None, timeout=timeout, _owns_default=True, **kwargs)
        set_default(comm)  # every thread of the process sees it
        return comm
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
