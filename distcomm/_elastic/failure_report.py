"""The failure report: when a call fails, what the job's store says of it (who reached the call, what
every rank is doing, whether another rank's transport lost a peer in it, whether the store's host
is gone), and the one error that names them."""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING, Literal, NoReturn

from .._agreement import states_table
from .._errors import CollectiveError, CollectiveTimeoutError, PeerError, clipped, transport_text
from .._launching.rendezvous import tcp_store
from . import liveness as _liveness
from .keepalive import keep_alive
from .liveness import HOSTS_LOST, alive
from .membership import shrink_begun

if TYPE_CHECKING:
    from .._torch import _TorchCommunicator

__all__ = ["ask_store", "fail", "host_lost", "host_posted_silent", "members_left", "membership_broke", "store_host",
           "store_host_pid", "store_says"]


def fail(comm: _TorchCommunicator, exc: BaseException, timeout: float | None) -> NoReturn:
    seq = comm._seq
    what = f"{comm._op_label} (call #{seq})"
    if comm._waits_broken:  # (this process broke them: its membership broke, so says the store)
        raise membership_broke(comm, what, comm._op_label) from exc
    text = transport_text(exc)
    low = text.lower()
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


def membership_broke(comm: _TorchCommunicator, what: str, op: str) -> PeerError:
    """The error of a call whose waits this process broke (``_TorchCommunicator._break_waits``)
    because its membership broke: a member's keep-alive stopped (that member is named), or members
    began to shrink it."""
    gone = host_lost(comm, HOSTS_LOST[0], what, op) if HOSTS_LOST else []
    if gone:
        (rank, pid), = gone
        comm._mark_broken(f"{what}: rank {rank} (pid {pid}) exited")
        return PeerError(f"{what}: lost a peer: rank {rank} (pid {pid}) on this machine exited", op=op, ranks=[rank])
    return members_left(comm, what, op)


def members_left(comm: _TorchCommunicator, what: str, op: str) -> PeerError:
    """The error of a call the other members left to agree on who is left (a rank was lost)."""
    comm._mark_broken(f"{what}: the other members left it")
    return PeerError(f"{what}: the other members have left this call to agree on who is left (a rank was lost); "
                     f"call shrink() to join them", op=op)


def host_posted_silent(comm: _TorchCommunicator) -> int | None:
    """The job rank a keep-alive posted silent in this communicator's membership, if any (a wait
    may learn that the others left to shrink before its own keep-alive read why)."""
    seat = comm._seat
    try:
        said = seat.job.read(f"{seat.epoch}/silent") if seat is not None else None
    except Exception:  # the store is gone: said elsewhere
        return None
    return int(said) if said and said.isdigit() else None


def host_lost(comm: _TorchCommunicator, job_rank: int, what: str, op: str) -> list[tuple[int, int]]:
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
    why = ("its host is down or cut off" if pid is None else
           f"its process (pid {pid}) lives on this machine but is stuck: a deadlock, or a call holding the GIL")
    seconds = _liveness.LOSS_SECONDS * (1 if pid is None else _liveness.WEDGED_TIMES)
    raise PeerError(f"{what}: lost a peer: rank {rank} (job rank {job_rank}) has not answered for {seconds:g} s "
                    f"(its keep-alive in the job's store stopped: {why})", op=op, ranks=[rank])


def store_says(comm: _TorchCommunicator, seen: dict[int, float], now: float, collective: bool) -> str:
    """What the job's store says of the call this rank still waits in, looked at once a second:
    "left" when the other members of this job communicator's membership have begun to agree on
    its survivors (a pair of ranks never connected, in a group that connects lazily, has no
    connection whose close would say so); "failed" when another rank's transport lost a peer in
    this collective (so the call can't complete, and its report waits for this rank's:
    a rank that no connection of the dead one reaches, in a large world, learns it here); else ""."""
    if now - seen.get(-1, 0.0) < 1.0:
        return ""
    seen[-1] = now
    if keep_alive.store_gone():  # (asked anyway, torch's client prints a page of warnings)
        return ""
    seat = comm._seat
    if seat is None:  # (only a job's communicator: its store is the one the keep-alive watches)
        return ""
    try:
        if shrink_begun(seat.job, seat.epoch):
            return "left"
        if collective and comm._reports is not None and comm._token and comm._reports.check([_failed_key(comm)]):
            return "failed"
    except Exception:  # noqa: S110 - the store is gone: said elsewhere
        pass
    return ""


def _failed_key(comm: _TorchCommunicator) -> str:
    """Where a rank whose transport failed in the current call says so (see ask_store)."""
    return f"distcomm/{comm._token}/{comm._seq}/failed"


def ask_store(comm: _TorchCommunicator, grace: float,
              lost: bool = False) -> tuple[list[int], dict[int, str]] | Literal["no store", "unreachable"]:
    """Write that this rank failed at this call, and what it is doing; wait ``grace`` for the
    others (no longer once every rank still missing is a process seen gone: it will never say).
    Return who reached this call, and what each rank that failed in any call reported;
    or why not: no store to ask (or set-up, before the ranks share a token), or it didn't answer.
    ``lost``: the transport lost a connection (its peer may be exiting)."""
    reports = comm._reports
    if reports is None or not comm._token:
        return "no store"
    if not _store_answers(comm, lost):
        return "unreachable"
    prefix = f"distcomm/{comm._token}/{comm._seq}/"
    states = f"distcomm/{comm._token}/state/"
    try:
        reports.set(states + str(comm._rank), comm._state())
        reports.set(prefix + str(comm._rank), "1")
        if lost:  # (the ranks still waiting in it learn it: store_says; a timeout is each rank's own)
            reports.set(_failed_key(comm), "1")
        deadline = time.monotonic() + grace
        while True:
            present = [r for r in range(comm._world) if reports.check([prefix + str(r)])]
            if time.monotonic() > deadline or all(_gone(comm, r) for r in range(comm._world) if r not in present):
                break
            time.sleep(0.05)
        said = {r: reports.read(states + str(r)) for r in range(comm._world)}
        told = {r: text.decode("utf-8", "replace") for r, text in said.items() if text is not None}
        return present, told
    except Exception:  # the store may be gone with the peer that hosted it
        return "unreachable"


def _gone(comm: _TorchCommunicator, rank: int) -> bool:
    """Whether ``rank``'s process is seen gone (on this machine)."""
    pid = comm._peer_pids.get(rank)
    return pid is not None and not alive(pid)


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
