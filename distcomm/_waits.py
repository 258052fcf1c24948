"""Waiting on the torch transports' native work, and failing well: slices that look at Ctrl-C and
at the peers' processes between them, a waiter thread for point-to-point transfers, and the
failure report that asks the job's store who reached the call and what every rank is doing."""

from __future__ import annotations

import atexit
import datetime
import functools
import os
import queue
import secrets
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Literal, NoReturn

from . import _frame
from ._agreement import states_table
from ._errors import CollectiveError, CollectiveTimeoutError, DistCommError, PeerError, clipped, transport_text

if TYPE_CHECKING:
    from ._torch import _TorchCommunicator

__all__ = ["HOSTS_LOST", "LOSS_SECONDS", "SLICE", "alive", "tcp_store", "timedelta_of", "fail", "interrupted",
           "machine", "process_id", "store_host_pid", "wait", "wait_whole"]


@functools.lru_cache(maxsize=16)
def timedelta_of(seconds: float) -> datetime.timedelta:
    """Seconds as a timedelta, made once per value (the hot path's waits)."""
    return datetime.timedelta(seconds=seconds)


class _Waiters:
    """Threads that wait on transport work for a caller that watches (Ctrl-C, peers' liveness):
    kept between calls (starting a thread costs more than handing it a job); one that is stuck on a
    wait that never ends (its communicator is broken then) is simply not reused.

    A stuck one is waited for at exit (``settle``): its wait ends when the peer it waits on exits,
    and ending inside the interpreter's finalization, the thread would abort the process
    ("terminate called without an active exception") after all its work is done."""

    def __init__(self) -> None:
        self._idle: list[queue.SimpleQueue[Any]] = []
        self._busy: set[threading.Event] = set()
        self._failing = False
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], None]) -> tuple[threading.Event, list[BaseException]]:
        done, failed = threading.Event(), list[BaseException]()
        with self._lock:
            jobs = self._idle.pop() if self._idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(jobs,), name="distcomm-wait", daemon=True).start()
        with self._lock:
            self._busy.add(done)
        jobs.put((fn, done, failed))
        return done, failed

    def forget(self) -> None:
        self._idle = []
        self._busy = set()
        self._failing = False
        self._lock = threading.Lock()

    def let_go(self) -> None:
        """The process is failing (a rank of launch() or spawn() whose function raised): its exit
        doesn't wait for waits still running."""
        self._failing = True

    def settle(self, seconds: float) -> None:
        """Wait up to ``seconds`` for the waits still running (at exit: see the class); not when
        the program dies of an error or Ctrl-C (it fails either way, and is let go at once)."""
        if self._failing or getattr(sys, "last_value", None) is not None:
            return
        deadline = time.monotonic() + seconds
        with self._lock:
            busy = list(self._busy)
        for done in busy:
            done.wait(max(deadline - time.monotonic(), 0.0))

    def _serve(self, jobs: queue.SimpleQueue[Any]) -> None:
        while True:
            fn, done, failed = jobs.get()
            try:
                fn()
            except BaseException as e:
                failed.append(e)
            done.set()
            with self._lock:
                self._busy.discard(done)
                self._idle.append(jobs)


WAITERS = _Waiters()
if hasattr(os, "register_at_fork"):  # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=WAITERS.forget)
SETTLE_AT_EXIT = 5.0
"""The longest exit waits for waits left running (registered first, so it runs after every
communicator is closed at exit)."""
atexit.register(WAITERS.settle, SETTLE_AT_EXIT)


def process_id() -> tuple[str, int, int]:
    """(boot id, PID namespace, pid): two ranks with the same first two can see each other's pid."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux: no liveness checks
        return (f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}", 0, os.getpid())
    return (boot, namespace, os.getpid())


def readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read, or its other end closed (poll: select() refuses
    descriptors past 1023, which a process with many files open reaches)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def machine() -> str:
    """What tells this machine's processes (one pid namespace) from other machines'."""
    boot, namespace, _ = process_id()
    return f"{boot}-{namespace}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # exiting (its sockets about to close), or exited and not yet reaped by its parent
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return fields[0] != "Z" and not int(fields[6]) & _PF_EXITING
    except (OSError, IndexError, ValueError):
        return True


_PF_EXITING = 0x4  # the kernel's flag for a process inside exit(), in /proc/<pid>/stat


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


def wait_watched(comm: _TorchCommunicator, works: list[Any], timeout: float | None, peers: list[int]) -> None:
    progress = [0]  # the work the helper waits on now: the ones before it are done
    watch(comm, lambda: wait_whole(works, timeout, progress), timeout,
                lambda: dict.fromkeys(peers[progress[0]:]))


def watch(comm: _TorchCommunicator, fn: Callable[[], None], timeout: float | None,
          needed: Callable[[], Iterable[int]], what: str = "") -> None:
    """Run ``fn`` in a waiter thread while this one watches: Ctrl-C, the processes of the peers
    ``needed()`` names, and a helper that never finishes (bounded by the timeout). ``what``: the
    call, as errors name it (the current collective's by default)."""
    done, failed = WAITERS.run(fn)
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


HOSTS_LOST: list[int] = []
"""The job rank whose keep-alive beat stopped in this process's membership (see _keepalive)."""


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
        gone = _host_lost(comm, HOSTS_LOST[0], what, op)  # (a process this machine sees is named by its pid)
    said = "" if gone else _store_says(comm, seen, now, collective=not what.startswith(("send", "recv")))
    if said == "left":
        comm._mark_broken(f"{what}: the other members left it")
        raise PeerError(f"{what}: the other members have left this call to agree on who is left (a rank was lost); "
                        f"call shrink() to join them", op=op)
    if said == "failed":  # (its report, with the others')
        fail(comm, RuntimeError("connection closed: another rank lost a peer in this call"), comm._timeout)
    if gone:
        names = ", ".join(f"rank {r} (pid {pid})" for r, pid in gone)
        comm._mark_broken(f"{what}: {names} exited")
        raise PeerError(f"{what}: lost a peer: {names} on this machine exited while this rank still needed it "
                        f"(its connections may stay open in a process it forked, so the transport can't tell)",
                        op=op, ranks=[r for r, _ in gone])


def _store_says(comm: _TorchCommunicator, seen: dict[int, float], now: float, collective: bool) -> str:
    """What the job's store says of the call this rank still waits in, looked at once a second:
    "left" when the other members of this job communicator's membership have begun to agree on
    its survivors (a pair of ranks never connected, in a group that connects lazily, has no
    connection whose close would say so); "failed" when another rank's transport lost a peer in
    this collective (so the call can't complete, and its report waits for this rank's:
    a rank that no connection of the dead one reaches, in a large world, learns it here); else ""."""
    if now - seen.get(-1, 0.0) < 1.0:
        return ""
    seen[-1] = now
    from ._keepalive import keep_alive  # (they import this module)
    from ._membership import shrink_begun

    if keep_alive.store_gone():  # (asked anyway, torch's client prints a page of warnings)
        return ""
    seat = comm._seat
    if seat is None:  # (only a job's communicator: its store is the one the keep-alive watches)
        return ""
    try:
        if shrink_begun(seat.job, seat.epoch):
            return "left"
        if collective and comm._store is not None and comm._token and comm._store.check([_failed_key(comm)]):
            return "failed"
    except Exception:  # noqa: S110 - the store is gone: said elsewhere
        pass
    return ""


def _failed_key(comm: _TorchCommunicator) -> str:
    """Where a rank whose transport failed in the current call says so (see ask_store)."""
    return f"distcomm/{comm._token}/{comm._seq}/failed"


def _host_lost(comm: _TorchCommunicator, job_rank: int, what: str, op: str) -> list[tuple[int, int]]:
    """Raise PeerError for the member whose keep-alive stopped, unless it is no member (nothing to
    do: []) or a process this machine sees has ended (its rank and pid, for the plainer message)."""
    job_ranks = comm.membership.job_ranks
    if job_rank not in job_ranks:
        return []
    rank = job_ranks.index(job_rank)
    pid = comm._peer_pids.get(rank)
    if pid is not None and not alive(pid):
        return [(rank, pid)]
    comm._mark_broken(f"{what}: rank {rank}'s keep-alive stopped")
    raise PeerError(f"{what}: lost a peer: rank {rank} (job rank {job_rank}) has not answered for "
                    f"{LOSS_SECONDS:g} s (its keep-alive in the job's store stopped: its host is down or cut off)",
                    op=op, ranks=[rank])


LOSS_SECONDS = 30.0
"""A keep-alive beat that has not moved for this long is a lost rank (its host is down or cut off).
Sixty beats: a machine running many more ranks than cores starves a beat's thread for seconds (a
33-rank world on 2 cores left one silent for over 5 s), and a rank declared lost ends the job's
collectives, so a healthy one must never be."""


def ask_store(comm: _TorchCommunicator, grace: float,
              lost: bool = False) -> tuple[list[int], dict[int, str]] | Literal["no store", "unreachable"]:
    """Write that this rank failed at this call, and what it is doing; wait ``grace`` for the
    others (no longer once every rank still missing is a process seen gone: it will never say).
    Return who reached this call, and what each rank that failed in any call reported;
    or why not: no store to ask (or set-up, before the ranks share a token), or it didn't answer.
    ``lost``: the transport lost a connection (its peer may be exiting)."""
    if comm._store is None or not comm._token:
        return "no store"
    if not _store_answers(comm, lost):
        return "unreachable"
    prefix = f"distcomm/{comm._token}/{comm._seq}/"
    states = f"distcomm/{comm._token}/state/"
    try:
        comm._store.set(states + str(comm._rank), comm._state())
        comm._store.set(prefix + str(comm._rank), "1")
        if lost:  # (the ranks still waiting in it learn it: _store_says; a timeout is each rank's own)
            comm._store.set(_failed_key(comm), "1")
        deadline = time.monotonic() + grace
        while True:
            present = [r for r in range(comm._world) if comm._store.check([prefix + str(r)])]
            if time.monotonic() > deadline or all(_gone(comm, r) for r in range(comm._world) if r not in present):
                break
            time.sleep(0.05)
        told = {r: comm._store.get(states + str(r)).decode("utf-8", "replace")
                for r in range(comm._world) if comm._store.check([states + str(r)])}
        return present, told
    except Exception:  # the store may be gone with the peer that hosted it
        return "unreachable"


def _gone(comm: _TorchCommunicator, rank: int) -> bool:
    """Whether ``rank``'s process is seen gone (on this machine)."""
    pid = comm._peer_pids.get(rank)
    return pid is not None and not alive(pid)


def tcp_store(store: Any) -> Any:
    """The TCPStore under a store's prefixes, or None (another kind of store, or none)."""
    while store is not None and hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    return store if store is not None and type(store).__name__ == "TCPStore" else None


def _store_answers(comm: _TorchCommunicator, lost: bool) -> bool:
    """Whether the job's TCPStore still takes connections. torch's store client logs a warning with
    a dump of C++ stack frames for every call to a store that is gone (its host exited first), which
    would bury this rank's report; a plain connection to its port tells the same silently. A host
    on this machine is looked at first: one that is exiting may still take a connection, so where a
    connection was ``lost`` it is given a moment to be gone (not otherwise: the other ranks' grace
    for this rank's report is running)."""
    store = tcp_store(comm._store)
    if store is None:
        return True
    host = store_host(comm)
    pid = None if host is None or host == comm._rank else comm._peer_pids.get(host)
    if pid is not None:
        deadline = time.monotonic() + (0.25 if lost else 0.0)
        while alive(pid):
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        else:
            return False
    try:
        with socket.create_connection((store.host, store.port), timeout=1.0):
            return True
    except OSError:
        return False


def store_host_pid(comm: _TorchCommunicator) -> int | None:
    """The pid of the process that serves the job's store, where this machine can see it."""
    host = store_host(comm)
    return os.getpid() if host == comm._rank else comm._peer_pids.get(host) if host is not None else None


def store_host(comm: _TorchCommunicator) -> int | None:
    """The rank (in this group) whose process serves the job's TCPStore: global rank 0 (None where
    a launcher's own process serves it, as torchrun's agent does)."""
    if tcp_store(comm._store) is None or 0 not in comm._ranks or not comm._store_by_rank0:
        return None
    return comm._ranks.index(0)


def fail(comm: _TorchCommunicator, exc: BaseException, timeout: float | None) -> NoReturn:
    text = transport_text(exc)
    low = text.lower()
    seq = comm._seq
    what = f"{comm._op_label} (call #{seq})"
    comm._mark_broken(f"{what}: {clipped(text, 160)}")
    grace = 2.0 if timeout is None else min(2.0, max(0.5, timeout / 4))
    closed = "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low
    reported = ask_store(comm, grace, lost=closed)
    present, told = (None, {}) if isinstance(reported, str) else reported
    missing = [] if present is None else [r for r in range(comm._world) if r not in present]
    told[comm._rank] = comm._state()
    table = "\n" + states_table(told, comm._world)
    who = ""
    if missing:
        who = f"; rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} never reported reaching it"
    host = store_host(comm, ) if reported == "unreachable" else None
    if host is not None and host != comm._rank:  # the store that names missing ranks is gone: suspect its host
        missing = [host]
        who = f"; rank {host}, which hosts the job's store, is unreachable (it exited or its machine is down)"
    timed_out = "timed out" in low or "timeout" in low
    if timed_out and not ("closed by peer" in low and present is not None and not missing):
        raise CollectiveTimeoutError(
            f"{what} timed out after {timeout}s waiting for its peers{who} (transport: {text}){table}",
            ranks=missing) from exc
    if closed and present is not None and not missing:
        raise CollectiveTimeoutError(
            f"{what}: every rank reached it, but peers gave up (their timeout expired) before this "
            f"rank arrived (transport: {text}){table}") from exc
    if closed:
        raise PeerError(
            f"{what}: lost a peer (it exited or its connection closed){who} (transport: {text}){table}",
            ranks=missing) from exc
    raise CollectiveError(f"{what} failed in the transport{who}: {text}{table}", op=comm._op_label,
                          ranks=missing) from exc
