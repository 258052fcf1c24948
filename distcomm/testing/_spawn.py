"""spawn(): a real multi-process world on 127.0.0.1 for tests, results back in rank order."""

from __future__ import annotations

import atexit
import hashlib
import multiprocessing as mp
import multiprocessing.connection
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
import torch
import torch.distributed as dist

from .._context import use
from .._elastic.waits import WAITERS
from .._errors import DistCommError, RankFailedError
from .._launching.launch import describe, first_failure
from .._launching.launchers import remember_starting_environment
from .._launching.ports import free_port
from .._launching.start import start_world
from .._torch import GlooCommunicator, NcclCommunicator
from .._trust.key import KEY_VAR, new_key
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


def _die_with_parent() -> None:
    """End this process as soon as the process that called spawn() is gone (killed with SIGKILL,
    say): no orphan waits on its queue. multiprocessing's sentinel of the parent reads end-of-file
    when it dies, under either start method; PDEATHSIG would fire when the thread that started this
    process ends (spawn() may run in a helper thread that a kept world outlives)."""
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        mp.connection.wait([parent.sentinel])
        os._exit(1)

    threading.Thread(target=watch, name="distcomm-spawn-parent-watch", daemon=True).start()


_PRELOAD = ["torch", "torch.distributed", "numpy", "cloudpickle"]
"""What the forkserver imports once: the second and more of a rank's start. Each rank imports
distcomm itself (0.2 s), after it took the caller's sys.path, which Python 3.11's forkserver does
not use for its own imports."""


def _context() -> tuple[Any, bool]:
    """Where ranks come from, and whether they fork: from a forkserver that imported torch once (on
    Linux), so that a world starts in a fraction of a second; spawned afresh elsewhere (macOS
    forbids forking after some of its frameworks load) or with DISTCOMM_SPAWN_METHOD=spawn."""
    default = "forkserver" if sys.platform.startswith("linux") else "spawn"
    method = os.environ.get("DISTCOMM_SPAWN_METHOD", default)
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"DISTCOMM_SPAWN_METHOD must be 'forkserver' or 'spawn', got {method!r}")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # (for a forkserver not yet started in this process)
    return ctx, method == "forkserver"


class _Parent:
    """What a forked rank takes from the process that called spawn(), as a spawned one inherits it:
    the environment and stdout and stderr as they are at the call (a forkserver's child would have
    the server's), fresh random states, and its atexit handlers run at the end. ``env`` and
    ``stdio`` (this process's descriptors for the rank's 1 and 2) give it others instead."""

    def __init__(self, forked: bool, env: dict[str, str] | None = None, stdio: tuple[int, int] = (1, 2),
                 key: str | None = None) -> None:
        self.forked = forked
        self.env = dict(os.environ if env is None else env) if forked else {}
        self.fds: tuple[int, ...] = stdio
        self.stdio: tuple[Any, ...] = ()
        self.key = key  # the job's key, where the caller made one (its ranks' environment holds it)

    def __reduce__(self) -> tuple[Any, ...]:  # the descriptors go as the start method passes them
        stdio = tuple(multiprocessing.reduction.DupFd(fd) for fd in self.fds) if self.forked else ()
        return _Parent._rebuild, (self.forked, self.env, stdio, self.key)

    @staticmethod
    def _rebuild(forked: bool, env: dict[str, str], stdio: tuple[Any, ...], key: str | None) -> _Parent:
        parent = _Parent.__new__(_Parent)
        parent.forked, parent.env, parent.fds, parent.stdio = forked, env, (), stdio  # (the rank's 1 and 2 now)
        parent.key = key
        return parent

    def adopt(self) -> None:
        """In the rank, first: what a spawned process would have had, then a watch on the parent."""
        if self.forked:
            os.environ.clear()
            os.environ.update(self.env)
            remember_starting_environment()
            threads = os.environ.get("OMP_NUM_THREADS", "")
            if threads.isdigit() and int(threads) > 0:  # (torch read it when the server imported it)
                torch.set_num_threads(int(threads))
            np.random.seed()
            torch.seed()
            for target, passed in zip((1, 2), self.stdio, strict=True):
                fd = passed.detach()
                os.dup2(fd, target)
                os.close(fd)
        if self.key is not None:
            os.environ[KEY_VAR] = self.key
        _die_with_parent()

    def leave(self) -> None:
        """In the rank, last: a forkserver's child ends without running the atexit handlers (the
        rank's unsent small messages among them, see ``_transfer.messages``): run them here."""
        if self.forked:
            atexit._run_exitfuncs()


def _start(rank: int, world: int, url: str, backend: str, timeout: float, comm_kwargs: dict[str, Any]) -> Any:
    comm_kwargs.setdefault("timeout", timeout)
    cls = GlooCommunicator if backend == "gloo" else NcclCommunicator
    return start_world(cls, url, rank, world, rank, **comm_kwargs)


def _rank(parent: _Parent, body: Callable[..., None], *args: Any) -> None:
    """A rank's process: what it takes from the process that called spawn(), then ``body(*args)``."""
    parent.adopt()
    try:
        body(*args)
    finally:
        parent.leave()


def _spawn_worker(rank: int, world: int, url: str, payload: bytes, out: Any, backend: str, timeout: float) -> None:
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
                 kwargs_blob: bytes) -> None:
    """A rank of a reused world: one communicator, then one function per job until told to stop.

    After each job it reports its call count; the parent keeps the world only while every rank
    succeeded, with the same count and an intact communicator.
    """
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
        ctx, forked = _context()
        self.out = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(world)]
        url = f"tcp://127.0.0.1:{free_port()}"
        parent = _Parent(forked, key=new_key())  # one world, one key: for its ranks alone
        self.procs = [ctx.Process(target=_rank, name=f"distcomm-rank-{r}", daemon=True,
                                  args=(parent, _pool_worker, r, world, url, self.inboxes[r], self.out,
                                        backend, timeout, kwargs_blob))
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
    On Linux the processes fork from multiprocessing's forkserver, which imported torch once: a
    world starts in a fraction of a second, not the second or more per process that importing torch
    takes. Each takes this process's environment, stdout and stderr at the call, and fresh random
    states, as a spawned one would; but Python's string hashes are seeded alike in every rank, and
    variables read only at torch's import (OMP_NUM_THREADS is honoured) are the server's.
    DISTCOMM_SPAWN_METHOD=spawn spawns fresh interpreters instead.

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
    ctx, forked = _context()
    out = ctx.Queue()
    url = f"tcp://127.0.0.1:{free_port()}"
    payload = dumps_code((fn, comm_kwargs))
    parent = _Parent(forked, key=new_key())  # one job, one key: for its ranks alone
    procs = [ctx.Process(target=_rank, args=(parent, _spawn_worker, r, world_size, url, payload, out, backend,
                                             timeout), name=f"distcomm-rank-{r}", daemon=True)
             for r in range(world_size)]
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
