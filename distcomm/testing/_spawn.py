"""spawn(): a real multi-process world on 127.0.0.1 for tests, results back in rank order."""

from __future__ import annotations

import atexit
import hashlib
import multiprocessing as mp
import multiprocessing.reduction
import os
import pickle
import queue as queue_mod
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import cloudpickle
import numpy as np
import torch.distributed as dist

from .._context import use
from .._elastic.waits import WAITERS
from .._errors import DistCommError, RankFailedError
from .._launching.launch import describe, first_failure
from .._launching.launchers import remember_starting_environment
from .._launching.ports import free_port
from .._launching.start import start_world
from .._torch import GlooCommunicator, NcclCommunicator
from .._wire.serialization import dumps_code

__all__ = ["spawn"]

_R = TypeVar("_R")
_Got = tuple[bool, bytes | None, str, float]  # a rank's (ok, result or exception, text, when it failed)

# Seconds a kept world's processes get to exit on their own when it is closed (at exit too) before
# they are terminated, then killed: their torch teardown alone takes 1-3 s on a busy machine.
_GRACE = 1.0


def _failure(e: BaseException) -> _Got:
    tb = traceback.format_exc()
    try:
        blob: bytes | None = cloudpickle.dumps(e)
        cloudpickle.loads(blob)  # an exception whose __init__ can't be replayed doesn't come back
    except Exception:
        blob = None
    return False, blob, f"{describe(e)}\n{tb}", time.time()


def _die_with(parent: int) -> None:
    """End this process soon after ``parent`` is gone (killed with SIGKILL, say): no orphan waits on
    its queue. A thread that polls, not PDEATHSIG, which fires when the thread that started this
    process ends (spawn() may run in a helper thread that a kept world outlives); the pid itself,
    not this process's parent, which is the forkserver where there is one."""
    def watch() -> None:
        while True:
            try:
                os.kill(parent, 0)
            except (ProcessLookupError, PermissionError):  # (the latter: another user's process, its pid reused)
                os._exit(1)
            time.sleep(1.0)

    threading.Thread(target=watch, name="distcomm-spawn-parent-watch", daemon=True).start()


class _Parent:
    """What a rank takes from the process that called spawn(): its pid, environment and stdout and
    stderr. A spawned process inherits them; a forkserver's child would have the server's, from
    when it started, so they travel with the rank's arguments and the rank takes them first."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.env = dict(os.environ)
        self.stdio: tuple[Any, ...] = ()

    def __reduce__(self) -> tuple[Any, ...]:  # the descriptors go as the start method passes them
        return _Parent._rebuild, (self.pid, self.env, (multiprocessing.reduction.DupFd(1),
                                                       multiprocessing.reduction.DupFd(2)))

    @staticmethod
    def _rebuild(pid: int, env: dict[str, str], stdio: tuple[Any, ...]) -> _Parent:
        parent = _Parent.__new__(_Parent)
        parent.pid, parent.env, parent.stdio = pid, env, stdio
        return parent

    def adopt(self) -> None:
        """In the rank: its parent's environment (as the one it started with) and output, numpy's
        random state of its own (a fresh process seeds it anew), then a watch on the parent."""
        os.environ.clear()
        os.environ.update(self.env)
        remember_starting_environment()
        np.random.seed()
        for target, passed in zip((1, 2), self.stdio, strict=True):
            fd = passed.detach()
            os.dup2(fd, target)
            os.close(fd)
        _die_with(self.pid)


def _context() -> Any:
    """Where processes come from: a forkserver that imported torch and distcomm once, so that a rank
    starts in a fork, not in the second or more each fresh interpreter takes to import torch; spawn
    where there is no forkserver. (Its preload is set once, before it starts; a forkserver this
    process already runs is used as it is.)"""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    return ctx


def _start(rank: int, world: int, url: str, backend: str, timeout: float, comm_kwargs: dict[str, Any]) -> Any:
    comm_kwargs.setdefault("timeout", timeout)
    cls = GlooCommunicator if backend == "gloo" else NcclCommunicator
    return start_world(cls, url, rank, world, rank, **comm_kwargs)


def _spawn_worker(rank: int, world: int, url: str, payload: bytes, out: Any, backend: str, timeout: float,
                  parent: _Parent) -> None:
    parent.adopt()
    reported = False
    try:
        fn, comm_kwargs = cloudpickle.loads(payload)
        comm = _start(rank, world, url, backend, timeout, comm_kwargs)
        with comm, use(comm):
            try:
                result = fn(comm)
            except BaseException as e:  # reported before the communicator closes: before its peers fail for it
                WAITERS.let_go()
                out.put((rank, 0, *_failure(e), -1))
                reported = True
                return
        out.put((rank, 0, True, cloudpickle.dumps(result), "", 0.0, 0))
    except BaseException as e:
        WAITERS.let_go()
        if not reported:
            out.put((rank, 0, *_failure(e), -1))


def _pool_worker(rank: int, world: int, url: str, inbox: Any, out: Any, backend: str, timeout: float,
                 kwargs_blob: bytes, parent: _Parent) -> None:
    """A rank of a reused world: one communicator, then one function per job until told to stop.

    After each job it reports its call count; the parent keeps the world only while every rank
    succeeded, with the same count and an intact communicator.
    """
    parent.adopt()
    try:
        comm = _start(rank, world, url, backend, timeout, cloudpickle.loads(kwargs_blob))
    except BaseException as e:
        out.put((rank, -1, *_failure(e), -1))
        return
    own = set(vars(comm))

    def state() -> tuple[Any, ...]:  # what a function may change that a fresh world wouldn't have
        groups = len(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else -1  # its own groups too
        return (comm.max_bytes, id(comm.serializer), comm.slot_bytes, comm.receive_cuda_on, comm._local,
                comm._local_group, len(comm._children), len(comm._owned), groups, comm._misused,
                len(comm._queues.pending()))  # calls left pending (async_op, isend)

    fresh = state()
    with comm, use(comm):
        while True:
            job = inbox.get()
            if job is None:
                return
            job_id, seconds, payload = job
            comm.reset_stats()
            comm._timeout = seconds  # this call's timeout, as a fresh world would have it
            try:
                result = cloudpickle.loads(payload)(comm)
                got: _Got = (True, cloudpickle.dumps(result), "", 0.0)
            except BaseException as e:
                got = _failure(e)
            for name in set(vars(comm)) - own:  # settings a function changed on its communicator
                delattr(comm, name)
            intact = got[0] and comm._broken is None and not comm._closed and state() == fresh
            out.put((rank, job_id, *got, comm._seq if intact else -1))
            if not intact:
                return


class _World:
    """Processes of a reused world, kept between spawn(..., reuse=True) calls with the same settings."""

    def __init__(self, world: int, backend: str, timeout: float, kwargs_blob: bytes) -> None:
        ctx = _context()
        self.out = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        url = f"tcp://127.0.0.1:{free_port()}"
        self.procs = [ctx.Process(target=_pool_worker, name=f"distcomm-rank-{r}", daemon=True,
                                  args=(r, world, url, self.inboxes[r], self.out, backend, timeout, kwargs_blob,
                                        _Parent()))
                      for r in range(world)]
        for p in self.procs:
            p.start()
        self.jobs = 0

    def run(self, payload: bytes, timeout: float) -> tuple[dict[int, _Got], bool]:
        self.jobs += 1
        for q in self.inboxes:
            q.put((self.jobs, timeout, payload))
        got, seqs = _collect(self.procs, self.out, timeout, self.jobs)
        intact = len(got) == len(self.procs) and all(g[0] for g in got.values()) and len(set(seqs.values())) == 1 \
            and min(seqs.values()) >= 0
        return got, intact

    def close(self) -> None:
        _close([self])


def _close(worlds: list[_World], grace: float = _GRACE) -> None:
    """Stop the worlds' processes, all at once: told to stop, then terminated after ``grace`` seconds,
    then killed; a second or two in all however many worlds there are."""
    for w in worlds:
        for q in w.inboxes:
            try:
                q.put(None)
            except Exception:  # noqa: S110 - best effort on teardown
                pass
    procs = [p for w in worlds for p in w.procs]
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.0))
    for stop in ("terminate", "kill"):
        alive = [p for p in procs if p.is_alive()]
        for p in alive:
            getattr(p, stop)()
        deadline = time.monotonic() + 0.5
        for p in alive:
            p.join(max(deadline - time.monotonic(), 0.0))
    for w in worlds:
        for q in [*w.inboxes, w.out]:
            q.cancel_join_thread()  # a dead process's inbox must not hold this one's exit
            q.close()


_WORLDS: dict[tuple[int, str, bytes, bytes], _World] = {}
_KEPT = 8
# Variables that change from test to test without changing what a world's processes would be
_NOT_INHERITED = frozenset({"PYTEST_CURRENT_TEST", "DISTCOMM_SPAWN_REUSE"})


def _inherited() -> bytes:
    """A digest of what a fresh world's processes inherit from this one and a kept world's have from
    when they started: the environment (DISTCOMM_SERIALIZER, TORCH_*, GLOO_*, NCCL_*, ... and what
    the function itself reads), the working directory and sys.path. A change makes a fresh world."""
    env = sorted((k, v) for k, v in os.environ.items() if k not in _NOT_INHERITED)
    return hashlib.blake2b(pickle.dumps((env, os.getcwd(), list(sys.path))), digest_size=16).digest()


@atexit.register
def _close_worlds() -> None:
    worlds = list(_WORLDS.values())
    _WORLDS.clear()
    _close(worlds)


def _collect(procs: list[Any], out: Any, timeout: float, job: int) -> tuple[dict[int, _Got], dict[int, int]]:
    """Each rank's (ok, blob, text, when) for ``job`` (or its start-up failure), until all report, die or
    time out."""
    got: dict[int, _Got] = {}
    seqs: dict[int, int] = {}
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(procs) and time.monotonic() < deadline:
        try:
            rank, job_id, ok, blob, text, when, seq = out.get(timeout=0.1)
            if job_id in (job, -1):
                got[rank], seqs[rank] = (ok, blob, text, when), seq
            continue
        except queue_mod.Empty:
            pass
        now = time.monotonic()
        for r, p in enumerate(procs):
            if r not in got and not p.is_alive():
                if now - dead_since.setdefault(r, now) > 1.0:
                    got[r], seqs[r] = (False, None, f"process exited with code {p.exitcode} before returning",
                                       time.time()), -1
    return got, seqs


def spawn(fn: Callable[[Any], _R], world_size: int, *, backend: str = "gloo", timeout: float = 120.0,
          return_exceptions: bool = False, reuse: bool | None = None, **comm_kwargs: Any) -> list[Any]:
    """Run ``fn(comm)`` in ``world_size`` real processes over torch.distributed on 127.0.0.1.

    Each process initializes a process group on a free local port, builds a GlooCommunicator (or
    NcclCommunicator with backend="nccl"), installs it with ``use()`` and calls ``fn(comm)``.
    ``fn`` may be a lambda or closure (cloudpickle); its return values come back in rank order.
    The processes fork from multiprocessing's forkserver, which imported torch and distcomm once
    (spawned afresh where there is none): a world starts in a fraction of a second, not the second
    or more per process that importing torch takes. Each takes this process's environment, stdout
    and stderr as a spawned one would.

    Args:
        fn: the per-rank function.
        world_size: number of processes.
        backend: "gloo" or "nccl".
        timeout: seconds for the whole world; also the communicators' collective timeout.
        return_exceptions: put each failed rank's RankFailedError in the result list instead of
            raising.
        reuse: keep the processes and their communicators for the next ``spawn(..., reuse=True)``
            with the same world size, backend and settings, in the same environment (environment
            variables such as DISTCOMM_SERIALIZER, working directory, sys.path: a change makes a
            fresh world, as without ``reuse``); a test suite then pays for starting them once.
            A world is kept only while every rank returns normally with its communicator intact
            and in step; attributes ``fn`` sets on the communicator and its stats are reset
            between calls. Otherwise, a fresh world as without ``reuse``. The eight most recently
            used worlds are kept, and stopped at exit within a second or two. Default: the
            environment variable DISTCOMM_SPAWN_REUSE=1 turns it on (for a whole test suite).
        comm_kwargs: passed to each communicator (serializer=, max_bytes=, ...).

    Raises:
        RankFailedError: a rank raised (its exception and remote traceback are attached), died,
            or did not finish within ``timeout`` (it is named and killed).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    if reuse is None:
        reuse = os.environ.get("DISTCOMM_SPAWN_REUSE", "") == "1"
    if reuse:
        key = (world_size, backend, cloudpickle.dumps(comm_kwargs), _inherited())
        world = _WORLDS.pop(key, None) or _World(world_size, backend, timeout, key[2])
        got, intact = world.run(dumps_code(fn), timeout)
        if intact:
            _WORLDS[key] = world  # the most recently used last
            while len(_WORLDS) > _KEPT:  # each kept world holds its processes' memory
                _WORLDS.pop(next(iter(_WORLDS))).close()
        else:
            world.close()
        return _results(got, world_size, timeout, return_exceptions)
    ctx = _context()
    out = ctx.Queue()
    url = f"tcp://127.0.0.1:{free_port()}"
    payload = dumps_code((fn, comm_kwargs))
    procs = [ctx.Process(target=_spawn_worker, args=(r, world_size, url, payload, out, backend, timeout, _Parent()),
                         name=f"distcomm-rank-{r}", daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    try:
        got, _ = _collect(procs, out, timeout, 0)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        out.close()
    return _results(got, world_size, timeout, return_exceptions)


def _results(got: dict[int, _Got], world_size: int, timeout: float, return_exceptions: bool) -> list[Any]:
    errors: dict[int, RankFailedError] = {}
    when: dict[int, float] = {}
    results: list[Any] = [None] * world_size
    for r in range(world_size):
        if r not in got:
            errors[r] = RankFailedError(f"rank {r} did not finish within {timeout}s and was killed", rank=r)
            when[r] = time.time()
            continue
        ok, blob, text, when[r] = got[r]
        try:
            value = cloudpickle.loads(blob) if blob is not None else None
        except Exception as load_error:  # a result or exception that pickles but doesn't load here
            if ok:
                ok, text = False, f"{type(load_error).__name__}: rank {r}'s result can't be loaded here: {load_error}"
            value = None
        if ok:
            results[r] = value
        else:
            exc = value if isinstance(value, BaseException) else None
            first = text.split("\n")[0]
            errors[r] = RankFailedError(f"rank {r}: {first}", rank=r, exception=exc, remote_traceback=text)
    if errors and return_exceptions:
        for r, e in errors.items():
            results[r] = e
        return results
    if errors:
        # the first failure heads the message: of the ranks that raised something else than a DistCommError
        # (a lost peer, a timeout: consequences), died or hung, the earliest; else the lowest rank
        r = first_failure({o: (isinstance(e.exception, DistCommError), when[o]) for o, e in errors.items()})
        main = errors[r]
        others = "".join(f"\n  {e}" for o, e in sorted(errors.items()) if o != r)
        raise RankFailedError(
            f"{main}" + (f"\nother ranks:{others}" if others else "") + f"\n--- rank {r} traceback ---\n"
            f"{main.remote_traceback}",
            rank=r, exception=main.exception, remote_traceback=main.remote_traceback,
            errors={o: e.exception or e for o, e in errors.items()})
    return results
