"""An in-process world: N ranks as threads, exchanging bytes through shared mailboxes."""

from __future__ import annotations

import datetime
import functools
import gc
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from .._agreement import states_table
from .._calls import CallSpec
from .._communicator import Communicator
from .._context import use
from .._elastic.membership import Membership
from .._errors import CollectiveError, CollectiveTimeoutError, DistCommError, PeerError, RankFailedError, is_rank_loss
from .._mesh import ElasticMesh
from .._one_at_a_time import COLLECTIVES
from .._torch_tables import leave
from .._wire import frame as _frame
from ._threaded_job import Ended, Lost, ThreadedJob, refuse_sub
from ._torch_group import TorchGroup

__all__ = ["ThreadedCommunicator", "run_threaded"]

_R = TypeVar("_R")


class _World:
    """Rendezvous points and mailboxes shared by the ranks of one threaded world."""

    def __init__(self, size: int, parent: _World | None = None, job_ranks: tuple[int, ...] | None = None) -> None:
        self.size = size
        self.parent = parent  # a sub-world's ranks are released when the whole world fails
        self.job_ranks = tuple(range(size)) if job_ranks is None else job_ranks  # (a membership's world)
        self.lost: tuple[int, int] | None = None  # a rank lost (ThreadedJob): its rank here, its job rank
        self.subworlds: dict[int, dict[tuple[int, ...], _World]] = {}
        # A condition (and its lock) per rank: a send touches its receiver's only, so a world of a
        # thousand threads doesn't convoy on one lock; the rendezvous tables have a lock of their own.
        self.lock = threading.Lock()
        self.conds = [threading.Condition() for _ in range(size)]
        self.slots: dict[int, list[Any]] = {}  # each rank's slot (and a scatter root's per rank), by generation
        self.reduces: dict[int, list[Any]] = {}  # tensors per rank, by generation
        self.taken: dict[tuple[str, int], int] = {}
        self.mail: dict[tuple[int, ...], deque[bytes]] = {}  # by (sender, receiver), and tag for messages
        self.failed: tuple[int, BaseException] | None = None
        self.baton = threading.Lock()
        # exchanges a rank gave up on (it timed out): a late rank then fails as over a transport
        self.abandoned: set[tuple[str, int]] = set()
        self.cut: set[tuple[int, ...]] = set()  # (sender, receiver[, tag]) whose receiver gave up
        self.members: list[Communicator | None] = [None] * size  # each rank's communicator, for error messages

    def lose(self, job_rank: int) -> None:
        """Job rank ``job_rank`` is lost: every call on this world (and its sub-worlds) fails from now on."""
        self.lost = (self.job_ranks.index(job_rank), job_rank)
        self._wake_all()

    def _wake_all(self) -> None:
        for c in self.conds:
            with c:
                c.notify_all()

    def abort(self, rank: int, exc: BaseException) -> None:
        with self.lock:
            if self.failed is None:
                self.failed = (rank, exc)
        self._wake_all()

    def _check(self, me: int) -> None:
        failed, lost, world = self.failed, self.lost, self.parent
        while failed is None and lost is None and world is not None:
            failed, lost, world = world.failed, world.lost, world.parent
        if lost is not None:  # as over gloo once the membership broke: every call on its groups fails
            raise PeerError(f"rank {me}: lost a peer: rank {lost[0]} (job rank {lost[1]}) exited", ranks=[lost[0]])
        if failed is not None:
            r, exc = failed
            raise CollectiveError(
                f"rank {me}: collective abandoned because rank {r} failed: {type(exc).__name__}: {exc}", ranks=[r])

    def _wait(self, me: int, ready: Callable[[], bool], deadline: float | None, what: str,
              missing: Callable[[], list[int]]) -> None:
        """Wait, holding ``conds[me]``, until ready() (set by others before they notify ``conds[me]``)."""
        while not ready():
            self._check(me)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                gone = missing()
                raise CollectiveTimeoutError(
                    f"rank {me}: {what} timed out; rank{'s' if len(gone) > 1 else ''} "
                    f"{', '.join(map(str, gone))} never arrived", ranks=gone)
            self.conds[me].wait(timeout=0.5 if left is None else min(left, 0.5))

    def gather(self, table: dict[int, list[Any]], kind: str, gen: int, me: int,
               value: Any, deadline: float | None) -> list[Any]:
        with self.lock:
            self._check(me)
            if (kind, gen) in self.abandoned:
                raise CollectiveTimeoutError(
                    f"rank {me}: {kind} #{gen}: every rank reached it, but peers gave up (their timeout expired) "
                    f"before this rank arrived")
            entry = table.setdefault(gen, [None] * self.size)
            entry[me] = value
            arrived = table.setdefault(-gen - 1, [0])  # how many have arrived, beside the entry
            arrived[0] += 1
            last = arrived[0] == self.size
        if last:  # the last to arrive wakes the others, once
            self._wake_all()
        with self.conds[me]:
            try:
                self._wait(me, lambda: arrived[0] == self.size, deadline, f"{kind} #{gen}",
                           lambda: [r for r, v in enumerate(entry) if v is None])
            except CollectiveTimeoutError:
                with self.lock:
                    self.abandoned.add((kind, gen))
                raise
        with self.lock:
            key = (kind, gen)
            self.taken[key] = self.taken.get(key, 0) + 1
            if self.taken[key] == self.size:
                del table[gen], table[-gen - 1], self.taken[key]
        return entry

    def send(self, src: int, dst: int, data: bytes, tag: int | None = None) -> None:
        self._check(src)
        key = (src, dst) if tag is None else (src, dst, tag)  # a tag: a point-to-point message's
        if key in self.cut:
            raise PeerError(f"rank {src}: rank {dst} gave up receiving from it (its timeout expired)", ranks=[dst])
        cond = self.conds[dst]
        with cond:
            self.mail.setdefault(key, deque()).append(data)
            cond.notify_all()

    def recv(self, src: int, dst: int, deadline: float | None, tag: int | None = None) -> bytes:
        key = (src, dst) if tag is None else (src, dst, tag)
        with self.conds[dst]:
            box = self.mail.setdefault(key, deque())
            try:
                self._wait(dst, lambda: bool(box), deadline, f"receive from rank {src}", lambda: [src])
            except CollectiveTimeoutError:
                self.cut.add(key)
                raise
            return box.popleft()


class ThreadedCommunicator(Communicator):
    """One rank of an in-process world made by ``run_threaded``.

    It runs the same pipeline as GlooCommunicator (serialize, slot exchange, exact-size transfers,
    deserialize); only the transport differs: bytes are copied between threads, never shared.
    """

    def __init__(self, world: _World, rank: int, *, job: ThreadedJob | None = None, job_rank: int | None = None,
                 membership: Membership | None = None, replacement: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._world = world
        self._rank = rank
        self._job = job
        self._job_rank = rank if job_rank is None else job_rank
        self._membership = membership  # (None: a sub-communicator's, numbered as itself)
        self._replacement = replacement
        self._depth = 0  # public calls inside public calls (reduce_dict's key check): only the outer counts
        self._slot_gen = 0
        self._reduce_gen = 0
        self._holding = False
        self._local = (rank, world.size)  # one machine
        self._split_gen = 0
        # the job communicator this one was split from (itself for a job's), and each rank's rank
        # there: a torch group's global ranks
        self._root: ThreadedCommunicator = self
        self._root_ranks = tuple(range(world.size))
        self._torch_group: TorchGroup | None = None
        world.members[rank] = self

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world.size

    @property
    def group(self) -> TorchGroup:
        """A torch ProcessGroup over this communicator's own collectives (made once, in the rank's
        thread): DDP, FSDP and ``torch.distributed`` calls with ``group=comm.group`` run in the
        threaded world. A job communicator's group is its rank thread's default group."""
        if self._torch_group is None:
            self._check_usable()  # (a closed communicator's would stay in torch's tables)
            if self._root is not self:
                _ = self._root.group  # (the default group first: a sub-group's ranks map into it)
            self._torch_group = TorchGroup(self, self._root_ranks)
            self._torch_group.register(default=self._root is self)
        return self._torch_group

    def _shutdown(self) -> None:
        if self._torch_group is not None:
            self._torch_group.unregister()
        super()._shutdown()

    # ------------------------------------------------------------------ a job's membership
    @property
    def membership(self) -> Membership:
        return super().membership if self._membership is None else self._membership

    def shrink(self, *, timeout: float | datetime.timedelta | None = None) -> Communicator:
        refuse_sub(self, "shrink")
        if self._job is None:
            return self
        if TorchGroup.made:
            # A backward that failed leaves DDP's reducer expecting its hooks, and a process's first
            # DDP is held by garbage cycles (from its lazy import of torch._dynamo) until the
            # collector runs: alive when the next DDP's backward runs, its hooks fail that one
            # ("marked ready twice"). Collected here, the old DDP goes as soon as the caller drops it.
            gc.collect()
        world, membership = self._job.survivors(self._world, self.membership, self._mesh)
        if self._job_rank not in membership.job_ranks:
            return self._rejoin(timeout)
        return self._succeeded_by(world, membership, timeout)

    def admit(self, *, timeout: float | datetime.timedelta | None = None) -> Communicator:
        self._check_usable()
        if self._job is None or self._world.parent is not None:
            return self
        newcomers = self._job.newcomers(self.membership.job_ranks, self._mesh) if self._rank == 0 else None
        newcomers = self.broadcast(newcomers, timeout=timeout)  # (one broadcast, as in a real job)
        if not newcomers:
            return self
        world, membership = self._job.admitted(self, newcomers)
        return self._succeeded_by(world, membership, timeout)

    def _rejoin(self, timeout: float | datetime.timedelta | None) -> Communicator:
        """This rank's replica lost a rank: it waits, as a replacement does, until the members'
        ``admit()`` lets the replica in whole again; its state fell behind meanwhile. Where the members
        have all returned first, its thread ends (``Ended``), as the agent ends such a process."""
        assert self._job is not None
        self._holds_state = False
        self.close()  # (its membership broke: none of its own until let in)
        seconds = self._op_timeout(timeout)
        deadline = time.monotonic() + (3600.0 * 24 if seconds is None else seconds)
        new = self._job.wait_admitted(self._job_rank, deadline, rejoining=True)
        if new is not None:
            return self._took_over(new, timeout)
        if self._job.ended:
            raise Ended
        raise CollectiveTimeoutError(
            f"shrink: job rank {self._job_rank} waited {seconds:g} s for its replica to be whole again, and the "
            f"members' admit() never let it in", op="shrink", ranks=[self._job_rank])

    def _succeeded_by(self, world: _World, membership: Membership,
                      timeout: float | datetime.timedelta | None) -> Communicator:
        new = ThreadedCommunicator(world, membership.job_ranks.index(self._job_rank),
                                   **self._job_settings(self._job_rank, membership, replacement=self._replacement))
        new._holds_state = self._holds_state  # (the same process's state, in the next membership)
        self.close()
        return self._took_over(new, timeout)

    def _took_over(self, new: ThreadedCommunicator, timeout: float | datetime.timedelta | None) -> Communicator:
        """``new``, once it took over what this one had: ``use(self)`` follows it, and so does the
        job's mesh (FSDP's groups), as the first collective of the new membership, as a real one's."""
        self._successor = new
        new._mesh = self._mesh
        if new._mesh is None:
            return new
        _forget_groups(new._mesh)
        try:
            new._mesh.follow(new)
        except Exception as e:
            if not is_rank_loss(e):
                raise
            return new.shrink(timeout=timeout)  # (a rank lost as the membership began)
        return new

    def _job_settings(self, job_rank: int, membership: Membership, *, replacement: bool) -> dict[str, Any]:
        """What a communicator of the job's next membership takes over from this one."""
        return {**self._sub_settings(self._timeout), "job": self._job, "job_rank": job_rank,
                "membership": membership, "replacement": replacement}

    def _world_lost(self, job_rank: int) -> None:
        """Job rank ``job_rank`` is lost: every call on its membership's worlds fails from now on."""
        world = self._world
        while world.parent is not None:
            world = world.parent
        world.lose(job_rank)

    def _deadline(self, timeout: float | None) -> float | None:
        return None if timeout is None else time.monotonic() + timeout

    def _guard(self, fn: Callable[[], _R]) -> _R:
        """Wait in the world (without the baton), and mark this rank broken if the wait times out."""
        holding = self._holding
        if holding:
            self._holding = False
            self._world.baton.release()
        try:
            return fn()
        except PeerError as e:  # (a lost rank: ThreadedJob)
            self._mark_broken(str(e))
            raise PeerError(f"{self._op_label} (call #{self._seq}): {e}", op=self._op_label, ranks=e.ranks) from e
        except CollectiveTimeoutError as e:
            self._mark_broken(str(e))
            # what every rank is doing: the threads share memory, so each rank's state is read directly
            states = {r: m._state() for r, m in enumerate(self._world.members) if m is not None}
            raise CollectiveTimeoutError(f"{self._op_label} (call #{self._seq}): {e}\n"
                                         f"{states_table(states, self.world_size)}", op=self._op_label,
                                         ranks=e.ranks) from e
        finally:
            if holding:
                self._world.baton.acquire()
                self._holding = True

    def _run(self, spec: CallSpec) -> list[Any]:
        # A collective's own work runs holding the world's baton, which it passes on whenever it waits:
        # one rank computes at a time, so a thousand threads woken together by a rendezvous don't all
        # fight for the interpreter lock (which costs more than the work itself in large worlds).
        if self._holding:  # a collective run from within one (reduce_dict's key check)
            return super()._run(spec)
        self._world.baton.acquire()
        self._holding = True
        try:
            return super()._run(spec)
        finally:
            self._holding = False
            self._world.baton.release()

    def _allgather_slots(self, slot: bytearray, size: int, timeout: float | None,
                         own: Sequence[bytearray] = ()) -> memoryview:
        # One rendezvous at every world size: this transport's all-gather (gloo's is an all-to-all
        # in small worlds and Bruck's algorithm beyond; both deliver the same bytes). A scatter's
        # root in a small world leaves each rank's own slot (``own``), as gloo's all-to-all sends it.
        world, me = self.world_size, self._rank
        if own and world > _frame.SMALL_WORLD:
            raise ValueError(f"slots of each rank's own are sent in worlds of up to {_frame.SMALL_WORLD} ranks")
        self._count(size * (world - 1), size * (world - 1))
        value = (bytes(slot), [bytes(o) for o in own] if own else None)
        parts = self._rendezvous(self._world.slots, "slot exchange", value, timeout)
        return memoryview(b"".join(theirs[me] if theirs and r != me else s for r, (s, theirs) in enumerate(parts)))

    def _rendezvous(self, table: dict[int, list[Any]], kind: str, value: Any, timeout: float | None) -> list[Any]:
        self._slot_gen += 1
        gen, deadline = self._slot_gen, self._deadline(timeout)
        return self._guard(lambda: self._world.gather(table, kind, gen, self._rank, value, deadline))

    def _alltoallv(
        self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor, recv_counts: list[int],
        timeout: float | None,
    ) -> None:
        # Each rank leaves its chunks, cut per receiver, in one rendezvous and takes its own from each.
        data, chunks, at = memoryview(send.numpy()), [], 0  # type: ignore[arg-type]
        for n in send_counts:
            chunks.append(bytes(data[at : at + n]))
            at += n
        everyone = self._rendezvous(self._world.slots, "all-to-all", chunks, timeout)
        out, at, me = memoryview(recv.numpy()), 0, self._rank  # type: ignore[arg-type]
        for src, n in enumerate(recv_counts):
            got = everyone[src][me]
            if len(got) != n:
                raise CollectiveError(f"rank {me}: expected {n} bytes from rank {src}, got {len(got)}", ranks=[src])
            out[at : at + n] = got
            at += n

    def _exchange(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], timeout: float | None
    ) -> None:
        # Bytes are copied with memoryviews, not torch ops: a thousand threads calling torch at once
        # contend for its intra-op thread pool.
        deadline = self._deadline(timeout)
        for dst, t in sends:
            self._world.send(self._rank, dst, bytes(memoryview(t.numpy())))  # type: ignore[arg-type]
        for src, buf in recvs:
            got = self._guard(lambda src=src: self._world.recv(src, self._rank, deadline))  # type: ignore[misc]
            if len(got) != buf.numel():
                raise CollectiveError(
                    f"rank {self._rank}: expected {buf.numel()} bytes from rank {src}, got {len(got)}", ranks=[src])
            if got:
                memoryview(buf.numpy())[:] = got  # type: ignore[arg-type]

    def _send_message(self, dst: int, tag: int, parts: list[torch.Tensor], timeout: float | None) -> None:
        for p in parts:
            self._world.send(self._rank, dst, bytes(memoryview(p.numpy())), tag)  # type: ignore[arg-type]

    def _recv_message(self, src: int, tag: int, bufs: list[torch.Tensor], timeout: float | None) -> None:
        deadline = self._deadline(timeout)
        for buf in bufs:
            try:
                got = self._world.recv(src, self._rank, deadline, tag)
            except CollectiveTimeoutError as e:  # as over gloo: the pair's connection is gone
                self._mark_broken(f"recv from rank {src} (tag {tag}) timed out")
                raise CollectiveTimeoutError(f"recv from rank {src} (tag {tag}) timed out after {timeout}s: {e}",
                                             op="recv", ranks=[src]) from e
            if len(got) != buf.numel():
                raise CollectiveError(
                    f"rank {self._rank}: expected {buf.numel()} bytes from rank {src}, got {len(got)}", ranks=[src])
            if got:
                memoryview(buf.numpy())[:] = got  # type: ignore[arg-type]

    def _reduce_tensor(self, tensor: torch.Tensor, dst: int | None, timeout: float | None) -> None:
        self._reduce_gen += 1
        gen, deadline = self._reduce_gen, self._deadline(timeout)
        values = self._guard(lambda: self._world.gather(self._world.reduces, "reduce", gen, self._rank,
                                                        tensor.clone(), deadline))
        if dst is None or dst == self._rank:  # summed in rank order, like a transport's fixed order
            tensor.data.copy_(torch.stack(values).sum(0))  # (no version counter bumped, as gloo writes)

    def _gather_tensors(self, tensor: torch.Tensor, timeout: float | None) -> list[torch.Tensor]:
        self._reduce_gen += 1
        gen, deadline = self._reduce_gen, self._deadline(timeout)
        values: list[torch.Tensor] = self._guard(lambda: self._world.gather(
            self._world.reduces, "tensors", gen, self._rank, tensor.detach().clone(), deadline))
        return [v.to(tensor.device) for v in values]

    def _make_sub(self, groups: list[list[int]], mine: list[int] | None, timeout: float | None) -> Communicator | None:
        # Every rank of the world meets the same sub-worlds, keyed by this split's number and members.
        self._split_gen += 1
        world = self._world
        with world.lock:
            made = world.subworlds.setdefault(self._split_gen, {})
            for members in groups:
                made.setdefault(tuple(members), _World(len(members), parent=world))
        if mine is None:
            return None
        sub = ThreadedCommunicator(made[tuple(mine)], mine.index(self._rank), job=self._job, job_rank=self._job_rank,
                                   replacement=self._replacement, **self._sub_settings(timeout))
        sub._root, sub._root_ranks = self._root, tuple(self._root_ranks[r] for r in mine)
        return sub


def _forget_groups(mesh: ElasticMesh) -> None:
    """Take the mesh's groups out of torch's tables, for its ``follow`` to enter them again: the
    tables are the process's, shared by the rank threads, where a real process's shrink or admit
    destroyed its default group, and every group torch knew went with it."""
    for group in mesh.groups:
        if group in dist.distributed_c10d._world.pg_map:
            leave(group, group.group_name)


def _counted(name: str) -> Callable[..., Any]:
    """``name`` as a threaded rank calls it: where ``run_threaded(lose=...)`` loses a rank, on entering."""
    base = getattr(ThreadedCommunicator, name)

    @functools.wraps(base)
    def method(self: ThreadedCommunicator, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("async_op", False) is not False or self._job is None or not self._job.lose:
            return base(self, *args, **kwargs)  # (an async call counts when it runs: the worker calls this again)
        if self._depth == 0:
            self._job.entering(self)
        self._depth += 1
        try:
            return base(self, *args, **kwargs)
        finally:
            self._depth -= 1

    return method


for _name in (*COLLECTIVES, "admit", "sync_state", "check_identical"):
    setattr(ThreadedCommunicator, _name, _counted(_name))


def run_threaded(fn: Callable[[ThreadedCommunicator], _R], world_size: int, *, timeout: float = 60.0,
                 lose: Mapping[int, int] | None = None, replacements: int = 0, **comm_kwargs: Any) -> list[_R]:
    """Run ``fn(comm)`` for every rank of an in-process world, each in its own thread.

    Each thread also has its comm installed with ``use()``, so module-level helpers see that
    rank. Objects cross ranks through the real serialize / transfer / deserialize pipeline.

    Args:
        fn: the per-rank function; its return values come back in rank order.
        world_size: number of ranks.
        timeout: seconds for the whole world, and the default collective timeout.
        lose: ``{rank: n}``: that rank's thread is lost as it enters its n-th collective (as if its
            process were killed there): the others' calls raise PeerError, and their ``shrink()``
            returns a communicator of the survivors (``membership.lost`` names it); with a
            ``device_mesh`` of replicas, of the whole replicas alone (its peers wait to be let in).
        replacements: how many lost ranks run ``fn`` again, as a replacement that waits until the
            members' ``admit()`` lets it in (``membership.admitted`` names it). A lost rank's result
            is None, or its replacement's.
        comm_kwargs: passed to each ThreadedCommunicator (serializer=, max_bytes=, ...).

    Raises:
        RankFailedError: a rank raised (the first failing rank and its exception are named; the
            other ranks are released from their collectives at once), or ranks did not finish
            within ``timeout`` (they are named).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    job = ThreadedJob(_checked_losses(lose, world_size), _checked_count("replacements", replacements))
    comm_kwargs.setdefault("timeout", timeout)
    # In large worlds, threads woken together ask the interpreter lock to switch every 5 ms each;
    # a longer interval while the world runs keeps that from costing more than the work.
    interval = sys.getswitchinterval()
    if world_size >= _LARGE_WORLD:
        sys.setswitchinterval(max(interval, 0.05))
    try:
        return _run_world(fn, world_size, timeout, job, comm_kwargs)
    finally:
        sys.setswitchinterval(interval)


_LARGE_WORLD = 64


def _checked_losses(lose: Mapping[int, int] | None, world_size: int) -> dict[int, int]:
    if lose is None:
        return {}
    if not isinstance(lose, Mapping):
        raise TypeError(f"lose must be a dict of rank -> collective number, got {type(lose).__name__}")
    for r, n in lose.items():
        if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world_size:
            raise ValueError(f"lose: rank {r!r} is not a rank of a world of {world_size}")
        _checked_count(f"lose[{r}]", n, low=1)
    return dict(lose)


def _checked_count(name: str, n: Any, low: int = 0) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < low:
        raise ValueError(f"{name} must be an int >= {low}, got {n!r}")
    return n


def _run_world(fn: Callable[[ThreadedCommunicator], _R], world_size: int, timeout: float, job: ThreadedJob,
               comm_kwargs: dict[str, Any]) -> list[_R]:
    world = _World(world_size)
    comms = [ThreadedCommunicator(world, r, job=job, membership=Membership(tuple(range(world_size))), **comm_kwargs)
             for r in range(world_size)]
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException] = {}
    order: list[int] = []
    tracebacks: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    threads: list[threading.Thread] = []
    replaced = [0]

    def target(r: int, comm: ThreadedCommunicator | None) -> None:
        try:
            comm = comm or job.wait_admitted(r, deadline)  # (a replacement waits to be let in)
            if comm is not None:
                with use(comm):
                    results[r] = fn(comm)
        except Ended:  # (let go, as a lost rank: its result stays None, and no one is started for it)
            pass
        except Lost:
            with world.lock:  # (two ranks lost at once start no more replacements than asked)
                again = replaced[0] < job.replacements
                replaced[0] += again
            if again:
                start(r, None)
        except BaseException as e:
            tracebacks[r] = traceback.format_exc()  # before the error is visible to the main thread
            order.append(r)
            errors[r] = e
            world.abort(r, e)

    def start(r: int, comm: ThreadedCommunicator | None) -> None:
        name = f"distcomm-rank-{r}" if comm is not None else f"distcomm-rank-{r}-replacement"
        thread = threading.Thread(target=target, args=(r, comm), name=name, daemon=True)
        threads.append(thread)
        thread.start()

    for r in range(world_size):
        start(r, comms[r])
    failed_at: float | None = None
    while any(t.is_alive() for t in threads):
        now = time.monotonic()
        if now >= deadline:
            break
        if errors or (job.waiting and job.waiting == sum(t.is_alive() for t in threads)):
            job.end()  # the members have all finished, or one failed: those still waiting to come in are let go
        if errors:
            failed_at = failed_at or now
            if now - failed_at > 1.0:  # ranks busy outside collectives can't be released: don't wait
                break
        next(t for t in threads if t.is_alive()).join(0.05)
    hung = [int(t.name.split("-")[2]) for t in threads if t.is_alive()]
    if hung and not errors:
        world.abort(hung[0], TimeoutError(f"world timed out after {timeout}s"))
        raise RankFailedError(
            f"threaded world of {world_size} timed out after {timeout}s: rank{'s' if len(hung) > 1 else ''} "
            f"{', '.join(map(str, hung))} did not finish", rank=hung[0], errors=errors)
    if errors:
        # the root cause: the first rank whose error was not caused by another rank's failure
        ready = [r for r in order if r in errors]  # a thread may be between its two writes
        causes = [r for r in ready if not isinstance(errors[r], DistCommError)] or ready
        r = causes[0]
        exc = errors[r]
        others = "".join(f"\n  rank {o}: {type(errors[o]).__name__}: {errors[o]}" for o in sorted(errors) if o != r)
        others += "".join(f"\n  rank {o}: still running (left behind as a daemon thread)" for o in hung)
        raise RankFailedError(
            f"rank {r} raised {type(exc).__name__}: {exc}" + (f"\nother ranks:{others}" if others else ""),
            rank=r, exception=exc, remote_traceback=tracebacks[r], errors=errors) from exc
    for c in comms:
        c.close()
    return results
