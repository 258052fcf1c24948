"""Waiting on the torch transports' native work: slices that look at Ctrl-C and at the peers
between them (their processes, their keep-alives, the members that left the call), and waiter
threads for point-to-point transfers. A wait that fails ends in the failure report
(``_failure_report.fail``)."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._errors import CollectiveTimeoutError, DistCommError, PeerError
from .._wire import frame as _frame
from .failure_report import fail, host_lost, host_posted_silent, members_left, store_says
from .liveness import HOSTS_LOST, alive

if TYPE_CHECKING:
    from .._torch import _TorchCommunicator

__all__ = ["SLICE", "WAITERS", "break_groups", "check_peers", "interrupted", "timedelta_of", "wait", "wait_watched",
           "wait_whole"]


@functools.lru_cache(maxsize=16)
def timedelta_of(seconds: float) -> datetime.timedelta:
    """Seconds as a timedelta, made once per value (the hot path's waits)."""
    return datetime.timedelta(seconds=seconds)


class _Waiters:
    """Threads that wait on transport work for a caller that watches (Ctrl-C, peers' liveness):
    kept between calls (starting a thread costs more than handing it a job); one that is stuck on a
    wait that never ends (its communicator is broken then) is simply not reused.

    A stuck one is ended at exit (``settle``): its wait would end when the peer it waits on exits,
    and ending inside the interpreter's finalization, the thread would abort the process
    ("terminate called without an active exception") after all its work is done. Two ranks whose
    stuck waits wait on each other would each wait for the other's exit."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[Any]] = []
        self._busy: dict[threading.Event, list[Any]] = {}  # a job's end -> the works it waits on
        self._failing = False
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], None], works: list[Any]) -> tuple[threading.Event, list[BaseException]]:
        """Run ``fn``, a wait on point-to-point ``works``, in a waiter thread."""
        done, failed = threading.Event(), list[BaseException]()
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="distcomm-wait", daemon=True).start()
        with self._lock:
            self._busy[done] = works
        jobs.put((fn, done, failed))
        return done, failed

    def forget(self) -> None:
        self._idle = []
        self._busy = {}
        self._failing = False
        self._lock = threading.Lock()

    def let_go(self) -> None:
        """The process is failing (a rank of launch() or spawn() whose function raised): its exit
        doesn't wait for waits still running."""
        self._failing = True

    def settle(self, seconds: float) -> None:
        """At exit, end the waits still running (see the class) within ``seconds``: those that
        don't end within a moment are broken, as a point-to-point wait that times out breaks its
        group's connections (the peers' waits on this process end too). Not when the program dies
        of an error or Ctrl-C (it fails either way, and is let go at once)."""
        if self._failing or getattr(sys, "last_value", None) is not None:
            return
        start = time.monotonic()
        with self._lock:
            busy = dict(self._busy)
        for done in busy:
            done.wait(max(start + SETTLE_GRACE - time.monotonic(), 0.0))
        for done, works in busy.items():
            if not done.is_set():
                _break(works)
        for done in busy:
            done.wait(max(start + seconds - time.monotonic(), 0.0))

    def _serve(self, jobs: queue.SimpleQueue[Any]) -> None:
        while True:
            fn, done, failed = jobs.get()
            try:
                fn()
            except BaseException as e:
                failed.append(e)
            done.set()
            with self._lock:
                self._busy.pop(done, None)
                self._idle.append(jobs)


def _break(works: list[Any]) -> None:
    """End every wait on ``works``' group: a wait on one of them that times out at once closes the
    group's connections (gloo's point-to-point waits do), and the waits on them fail."""
    for w in works:
        with contextlib.suppress(Exception):
            w.wait(timedelta_of(0.001))


def break_groups(groups: Iterable[Any]) -> None:
    """Fail every wait in this process on ``groups``' connections, now: torch's own included (DDP's,
    a user's), which look at nothing but their connections and would otherwise wait for a live
    member that left the call until their timeout. A gloo wait that times out closes its group's
    connections in this process (a receive posted for it, waited on for a moment); an NCCL group's
    communicator is aborted, group by group, gloo's first (never torch's abort of the whole world,
    which would tear down the default group under the caller). Other processes' connections stay
    open: each member breaks its own."""
    named = []
    for group in groups:
        with contextlib.suppress(Exception):  # (a group already torn down: nothing to end)
            if group.size() > 1:
                named.append((dist.get_backend(group), group))
    for backend, group in sorted(named, key=lambda bg: bg[0] != "gloo"):
        with contextlib.suppress(Exception):  # (a group already broken: nothing to end)
            if backend == "gloo":
                posted = group.recv([torch.empty(1)], (group.rank() + 1) % group.size(), _BREAK_TAG)
                posted.wait(timedelta_of(0.001))
            else:
                group._get_backend(torch.device("cuda")).abort()


_BREAK_TAG = 0x7D15_B4EA
"""The tag of the receive that breaks a group: no send ever matches it."""


WAITERS = _Waiters()
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=WAITERS.forget)
SETTLE_AT_EXIT = 5.0
"""The longest exit waits for waits left running (registered first, so it runs after every
communicator is closed at exit); after ``SETTLE_GRACE`` they are broken."""
SETTLE_GRACE = 0.2
atexit.register(WAITERS.settle, SETTLE_AT_EXIT)


# Waits longer than a slice look, between slices, at Ctrl-C and at the peers' processes. A
# collective's work can be waited on again after a wait times out; a point-to-point one can't (a
# timed-out wait closes gloo's connection), so large point-to-point transfers are waited on by a
# helper thread while this one watches, and small ones (which finish at once) in one piece.
# A peer whose process is gone fails the wait only if the wait still needs it DEAD_GRACE seconds
# later: a peer that did its part and exited (the end of a job) is no failure.
SLICE = 1.0
DEAD_GRACE = 5.0
WATCHED_P2P_BYTES = 1 << 20


def wait(comm: _TorchCommunicator, works: list[Any], timeout: float | None, p2p_peers: list[int] | None = None,
          p2p_bytes: int = 0, start: float | None = None) -> None:
    """Wait for ``works``; ``p2p_peers``: point-to-point works, and the peer of each.

    Point-to-point waits are handed to a helper thread when they can last: large transfers, any
    in worlds beyond 4 ranks (where a peer that is late or gone leaves this rank waiting in them),
    and any in a job's communicator (whose members may leave a call to shrink); small ones in
    small worlds of other communicators finish at once, and the hand-off (about 50 us) would cost more.
    ``start``: when the caller began waiting (its first slice ran out), for sliced waits."""
    try:
        if not comm._sliced_waits or (
                p2p_peers is not None and p2p_bytes < WATCHED_P2P_BYTES
                and comm._world <= _frame.SMALL_WORLD and comm._seat is None):
            wait_whole(works, timeout)
        elif p2p_peers is not None:
            wait_watched(comm, works, timeout, p2p_peers)
        else:
            wait_sliced(comm, works, timeout, start)
    except DistCommError:
        raise
    except Exception as e:
        fail(comm, e, timeout)
    except BaseException as e:
        interrupted(comm, e)
        raise


def wait_whole(works: list[Any], timeout: float | None, progress: list[int] | None = None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    for i, w in enumerate(works):
        if progress is not None:
            progress[0] = i
        if deadline is None:
            w.wait()
        elif len(works) == 1:
            w.wait(timedelta_of(timeout))
        else:
            w.wait(datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))


def wait_sliced(comm: _TorchCommunicator, works: list[Any], timeout: float | None, start: float | None = None) -> None:
    deadline = None if timeout is None else (time.monotonic() if start is None else start) + timeout
    seen: dict[int, float] = {}
    if start is not None:  # a first slice already ran out
        check_peers(comm, comm._peer_pids, seen)
    for w in works:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            step = SLICE if left is None or left > SLICE else max(left, 0.001)
            try:
                w.wait(timedelta_of(step))
                break
            except RuntimeError as e:  # a slice ran out ("Operation timed out!"), or the transport failed
                if (left is not None and left <= SLICE) or "timed out" not in str(e).lower():
                    raise
            check_peers(comm, comm._peer_pids, seen)


def wait_watched(comm: _TorchCommunicator, works: list[Any], timeout: float | None, peers: list[int],
                 what: str = "") -> None:
    """Wait for point-to-point ``works`` in a waiter thread while this one watches: Ctrl-C, the
    processes of the peers still needed (``peers[i]``: the peer of ``works[i]``), and a helper
    that never finishes (bounded by the timeout). ``what``: the call, as errors name it (the
    current collective's by default)."""
    progress = [0]  # the work the helper waits on now: the ones before it are done

    def needed() -> Iterable[int]:
        return dict.fromkeys(peers[progress[0]:])

    done, failed = WAITERS.run(lambda: wait_whole(works, timeout, progress), works)
    start, seen = time.monotonic(), dict[int, float]()
    while not done.wait(SLICE):
        check_peers(comm, needed(), seen, what)
        if timeout is not None and time.monotonic() - start > timeout + DEAD_GRACE:
            peers = list(needed()) if what else []  # (a point-to-point call's peer; a collective's are unknown)
            op, what = (what.split()[0], what) if what else (comm._op_label, _call(comm))
            comm._mark_broken(f"{what}: the transport didn't finish")
            raise CollectiveTimeoutError(f"{what} timed out after {timeout}s (the transport didn't finish)", op=op,
                                         ranks=peers)
    if failed:
        raise failed[0]


def _call(comm: _TorchCommunicator) -> str:
    """The collective ``comm`` is in, as errors name it."""
    return f"{comm._op_label} (call #{comm._seq})"


def interrupted(comm: _TorchCommunicator, e: BaseException) -> None:
    """Ctrl-C (any BaseException) while waiting: the peers still expect this call's messages."""
    comm._mark_broken(f"{comm._op_label} (call #{comm._seq}) was interrupted ({type(e).__name__}) while "
                      f"waiting for its peers")


def check_peers(comm: _TorchCommunicator, needed: Iterable[int], seen: dict[int, float], what: str = "") -> None:
    """Raise PeerError for a peer this wait needs whose process has been gone for DEAD_GRACE, for
    any member whose keep-alive stopped (its host is down or cut off: nothing resets its
    connections), and when the other members have left to agree on who is left. ``what``: the
    call, as errors name it (the current collective's by default)."""
    now = time.monotonic()
    gone = []
    for r in needed:
        pid = comm._peer_pids.get(r)
        if pid is not None and not alive(pid):
            if now - seen.setdefault(r, now) >= DEAD_GRACE:
                gone.append((r, pid))
    op, what = (what.split()[0], what) if what else (comm._op_label, _call(comm))
    if HOSTS_LOST and not gone:
        gone = host_lost(comm, HOSTS_LOST[0], what, op)  # (a process this machine sees is named by its pid)
    said = "" if gone else store_says(comm, seen, now, collective=not what.startswith(("send", "recv")))
    if said == "left":
        silent = host_posted_silent(comm)  # (the others left because a host went silent: name it, as they do)
        if silent is not None:
            host_lost(comm, silent, what, op)
        raise members_left(comm, what, op)
    if said == "failed":  # (its report, with the others')
        fail(comm, RuntimeError("connection closed: another rank lost a peer in this call"), comm._timeout)
    if gone:
        names = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone)
        comm._mark_broken(f"{what}: {names} exited")
        raise PeerError(f"{what}: lost a peer: {names} on this machine exited while this rank still needed it "
                        f"(its connections may stay open in a process it forked, so the transport can't tell)",
                        op=op, ranks=[r for r, _ in gone])
