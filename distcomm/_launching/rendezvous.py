"""The rendezvous: the key-value store a job's processes meet at before their group exists.

distcomm makes the store itself rather than hand torch a URL, for three reasons:
- torch's ``tcp://`` and ``env://`` handlers change what they do when torchelastic's variables are
  set (they turn every rank into a client of the agent's store), so a URL that works under
  ``python`` hangs under torchrun;
- the ranks of a job meet in *rounds by rank*, the way torch elastic's dynamic rendezvous counts
  participants: each rank has one place in a round, a process that arrives again (a restarted one)
  takes its own place back instead of another rank's, and a round is complete when every rank of
  the world holds its place. The round number lives in the store, so the ranks of every node agree
  on it whatever each launcher's agent counted (torchrun's restart counts differ per node), and a
  second rendezvous in one process, or a restart, is simply the next round;
- every wait is bounded by the timeout and, when it runs out, names the ranks that never came.

The store is torch's own TCPStore (the one every torch job already trusts); only the keys are ours.
A store this process serves (rank 0's, where no launcher hosts one) is kept for the life of the
process: other ranks may still be reaching it for a later round, and survivors of a lost rank
(``Communicator.shrink``) agree on what happened there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import ipaddress
import os
import secrets
import socket
import threading
import time
import urllib.parse
from typing import Any

import torch

from .._elastic.liveness import machine, readable
from .._errors import CollectiveTimeoutError, CommunicatorStateError, DistCommError, PeerError
from .._trust.key import KEY_VAR, JobKey
from .._trust.records import Records

__all__ = ["TICKET", "Seat", "admitted_key", "admitted_seat", "beat_key", "beat_of", "meet", "moving", "parse_url",
           "meet_or_wait", "pid_key", "proof_key", "prove_to_members", "ranks_in", "refused_key", "rejoin",
           "seen_key", "serve_store", "tcp_store", "unreachable_here", "unresolved", "who_key", "Waiting"]

POLL_FIRST, POLL_LAST = 0.01, 0.5
"""Seconds between looks at the store while a process waits for its round: soon at first (ranks
started together meet within milliseconds), then less often (a newcomer may wait long to be let
in), but no less than ``poll_cap`` says."""

LOOKS_PER_SECOND = 2000
"""How often a job's waiting processes, all of its ranks at once, look at its store together once
their pauses have grown to ``poll_cap`` (each look is a few calls), up to 1,000 ranks; a larger job
waits ``POLL_LAST`` between looks, as before."""


def poll_cap(world: int) -> float:
    """The longest pause between the looks at the store of a process waiting to be let in (a later
    round: the job's first waits ``POLL_LAST``, its ranks started together). Once the members let
    it in, they wait for it in the new group's set-up, so that pause is their stall; it is short in
    all but large jobs, where every rank may be waiting at once and the pause keeps the store's load
    bounded (``LOOKS_PER_SECOND``). (Each look may meet a store whose host just ended, where torch's
    client prints pages of C++ frames: the first round's ranks look seldom.)"""
    return min(POLL_LAST, max(POLL_FIRST, world / LOOKS_PER_SECOND))


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://host:port`` (IPv6 hosts in brackets) as (host, port)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ValueError(f"dist_url must be tcp://host:port, got {url!r}")
    return parts.hostname, port


@dataclasses.dataclass(frozen=True)
class Seat:
    """Where a process sits in its job once it has met the others.

    ``job`` is the job's records (signed with its key, where it has one), ``epoch`` the prefix under which
    this membership's group keeps its keys, ``job_rank`` the place the launcher gave the process,
    ``members`` the job ranks of the group it joins (its rank there is their index), ``token``
    what tells this process from an earlier one of the same rank, and ``admitted`` the members let
    in by ``Communicator.admit`` rather than met in a round."""

    job: Records
    epoch: str
    job_rank: int
    members: tuple[int, ...]
    token: str
    where: str
    hosted: bool
    admitted: tuple[int, ...] = ()

    @property
    def store(self) -> Any:
        """The store the group of this membership keeps its keys in."""
        return _c10d().PrefixStore(self.epoch, self.job.raw)  # (torch's own keys: see _trust.handshake)

    @property
    def rank(self) -> int:
        return self.members.index(self.job_rank)


def meet(host: str, port: int, rank: int, world: int, seconds: float, *, scope: str = "",
         hosted: bool = True, what: str = "the rendezvous", key: JobKey | None = None) -> Seat:
    """Meet the other ranks of ``world`` at the store at ``host:port``; return this process's seat.
    As ``meet_or_wait``, for a process that is ready to be let in at once (it waits on until it is)."""
    seat = _meet(host, port, rank, world, seconds, scope=scope, hosted=hosted, what=what, key=key, ready=True)
    assert isinstance(seat, Seat)  # (only a process not ready yet is left waiting)
    return seat


def meet_or_wait(host: str, port: int, rank: int, world: int, seconds: float, *, scope: str = "",
                 hosted: bool = True, what: str = "the rendezvous", key: JobKey | None = None) -> Seat | Waiting:
    """Meet the other ranks of ``world`` at the store at ``host:port``; return this process's seat,
    or, for a replacement the members' ``admit()`` has seen waiting, a ``Waiting`` whose ``join``
    lets it in once it is ready (its script's start-up is then off the members' path).

    Rank 0 serves the store unless ``hosted`` is False (a launcher's process does). A process that
    finds the job already running (its round complete without it) waits to be let in by the
    members' ``admit()`` to see it (and refuse it, or leave it to join once ready), or for a round of
    every rank (a restart of the whole job). Its records are signed with ``key``, the job's (see ``_trust``).

    Raises:
        CollectiveTimeoutError: the store or some ranks didn't come within ``seconds``; names them.
        CommunicatorStateError: rank 0 could not listen on the port (another job holds it).
        ValueError: this process's world size or rank contradicts the job's (both named).
    """
    return _meet(host, port, rank, world, seconds, scope=scope, hosted=hosted, what=what, key=key, ready=False)


def _meet(host: str, port: int, rank: int, world: int, seconds: float, *, scope: str, hosted: bool, what: str,
          key: JobKey | None, ready: bool) -> Seat | Waiting:
    deadline = time.monotonic() + seconds
    where = f"{what} at {host}:{port}"
    served = hosted and rank == 0 and port not in _SERVED
    token = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(8)}"
    try:
        raw = _connect(host, port, rank, world, seconds, hosted, where)
    except CommunicatorStateError:
        if served:  # another rank 0 of this job may hold the port: name it where it can be found
            _name_rank_0(host, port, scope, token, where, key)
        raise
    watch = _StoreWatch(host, port, hosted=hosted, serving=served)
    try:
        job = Records(_c10d().PrefixStore(f"distcomm/{scope}", raw), key, f"distcomm/{scope}/")
        number = _take_place(job, rank, world, token, where)
        job.set(f"round-{number}/{pid_key(rank, token)}", f"{machine()}:{os.getpid()}")  # (see pid_key)
        seat = _await_round(job, number, rank, world, token, deadline, seconds, where, watch, ready=ready)
        if seat is None:  # seen by the members: it joins them once ready
            return Waiting(job, number, rank, world, token, where, hosted, (host, port, served))
        return dataclasses.replace(seat, hosted=hosted)
    except BaseException as e:
        error = e
    finally:
        watch.close()
    # A failed rendezvous lets go of the port it opened: nothing may hold the store, and the
    # error's traceback (its frames hold it) goes.
    raw = job = None  # type: ignore[assignment]
    if served:
        _SERVED.pop(port, None)
    error.__context__ = None
    raise error.with_traceback(None)


def _name_rank_0(host: str, port: int, scope: str, token: str, where: str, key: JobKey | None) -> None:
    """Raise ValueError naming both processes where the store at ``host:port`` is this job's, and
    a rank 0 of it serves there (two processes started as rank 0); else return."""
    try:
        raw = _c10d().TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=2))
        job = Records(_c10d().PrefixStore(f"distcomm/{scope}", raw), key, f"distcomm/{scope}/")
        number = int(job.add("round", 0))
        holder = (job.read(f"round-{number}/rank/0") or b"").decode()
    except Exception:  # not a store, or not this job's: the port is simply taken
        return
    if holder:
        raise ValueError(f"{where}: two processes were started as rank 0: {holder} serves the job's store there, and "
                         f"this one ({token}) came too; start each rank once") from None


def _take_place(job: Records, rank: int, world: int, token: str, where: str) -> int:
    """This rank's place in the open round (a new one, or its earlier process's); the round's number.

    Refused, naming both processes and both sizes: a world size other than the round's (or, for a
    replacement, other than the running job's). A process whose place another takes (a restart, or
    two processes started as one rank) is told at its next look (``_wait_for_round``)."""
    number = int(job.add("round", 0))
    _check_keyed(job, number, where)
    while True:
        rnd = job.under(f"round-{number}")
        _check_world(job, rnd, number, world, token, where)
        held = rnd.compare_set(f"rank/{rank}", "", token).decode()
        if held == token:  # a place of its own: the last rank to take one completes the round
            if rnd.add("count", 1) >= world:
                _complete(job, rnd, world, token)
            return number
        if rnd.check(["complete"]):  # an earlier process of this rank met the others: a later round
            number += 1
            continue
        rnd.set(f"rank/{rank}", token)  # a restarted process takes its own place back (one still waiting is told)
        return number


def _complete(job: Records, rnd: Records, world: int, token: str) -> None:
    """Call the round complete where every rank holds its place; the first to call it moves the
    job on to the next round. The store counts the places, but anyone can move a count: the
    places themselves (signed records) are what is checked."""
    if all(rnd.read(f"rank/{r}") for r in range(world)) and rnd.compare_set("complete", "", token).decode() == token:
        job.add("round", 1)


_KEYED = "keyed"
"""A plain mark, set by the ranks of a job's first round: whether the job has a key. It decides nothing (an
outsider may write it); it lets a process started without the key say why it can't come in."""


def _check_keyed(job: Records, number: int, where: str) -> None:
    """Mark a job with a key as such at its start; refuse to join one without holding its key."""
    if number == 0 and job.key is not None:
        job.raw.compare_set(_KEYED, "", "1")
    elif number > 0 and job.key is None and job.raw.check([_KEYED]):
        raise ValueError(f"{where}: this job has a key, and this process was started without it: give it the "
                         f"job's key as its other processes have it ({KEY_VAR}: docs/trust-model.md)")


def _check_world(job: Records, rnd: Records, number: int, world: int, token: str, where: str) -> None:
    """Refuse a world size other than the round's, naming the process that set it; and, for a
    replacement (the round before is complete and its members beat on), other than the job's,
    before it writes its own anywhere."""
    earlier = job.under(f"round-{number - 1}") if number else None
    running = int(earlier.read("world") or 0) if earlier is not None and earlier.check(["complete"]) else 0
    if running and running != world and moving(job, [beat_key(r) for r in range(running)]):
        raise ValueError(f"{where}: this process ({token}) says the job has {world} ranks, but the members of "
                             f"the running job: {running}; start every rank with the same world size")
    said = rnd.compare_set("world", "", f"{world}").decode()
    if said == str(world):
        rnd.compare_set("world/by", "", token)
        return
    by = rnd.get("world/by").decode() if rnd.check(["world/by"]) else "the ranks already there"
    raise ValueError(f"{where}: this process ({token}) says the job has {world} ranks, but {by}: {said}; start "
                     f"every rank with the same world size")


def tcp_store(store: Any) -> Any:
    """The TCPStore under a store's prefixes, or None (another kind of store, or none)."""
    while store is not None and hasattr(store, "underlying_store"):  # PrefixStore
        store = store.underlying_store
    return store if store is not None and type(store).__name__ == "TCPStore" else None


def moving(job: Records, beats: list[str], seconds: float = 1.2) -> bool:
    """Whether any of the keep-alive beats at ``beats`` moves on within ``seconds``."""
    before = [_count(job, b) for b in beats]
    time.sleep(seconds)
    return any(_count(job, b) > n for b, n in zip(beats, before, strict=True))


def beat_key(job_rank: int) -> str:
    """Where the keep-alive of ``job_rank``'s process beats: a signed count that only goes up (a
    record replayed from earlier doesn't look like a beat)."""
    return f"alive/{job_rank}"


def beat_of(job: Records, job_rank: int) -> int:
    """The last beat of ``job_rank``'s keep-alive (0: none, or none signed with the job's key)."""
    return _count(job, beat_key(job_rank))


def _count(job: Records, name: str) -> int:
    value = job.read(name)
    return int(value) if value and value.isdigit() else 0


def _wait_for_round(job: Records, number: int, rank: int, world: int, token: str, deadline: float,
                    seconds: float, where: str, watch: _StoreWatch) -> Seat:
    """Wait until round ``number`` is complete, or the members let this rank in; ``watch`` is looked at
    before each look at the store (torch's client prints a page of C++ frames for a call to a store
    that is gone)."""
    seat = _await_round(job, number, rank, world, token, deadline, seconds, where, watch, ready=True)
    assert seat is not None  # (only a process not ready yet is left waiting)
    return seat


def _await_round(job: Records, number: int, rank: int, world: int, token: str, deadline: float,
                 seconds: float, where: str, watch: _StoreWatch, *, ready: bool) -> Seat | None:
    """``_wait_for_round``; where not ``ready``, this process proves no key (the members let in
    only those that did) and the wait also ends, with None, once the members have seen it."""
    rnd = job.under(f"round-{number}")
    looked = ("complete", admitted_key(rank, token), refused_key(rank, token)) + (() if ready else
                                                                                  (seen_key(rank, token),))
    found: list[str] = []
    holder = token
    proved = b""
    pause = POLL_FIRST
    try:  # looked at, not waited on: a timed-out wait fills the output with torch's C++ warnings
        while True:
            if watch.gone():
                raise watch.went_away(rank, where)
            found = [k for k in looked if rnd.check([k])]
            if ready and number and rnd.key is not None:
                proved = prove_to_members(job, rnd, rank, token, proved)
            holder = (rnd.read(f"rank/{rank}") or b"").decode()  # (another process in this place: told at once)
            if found or time.monotonic() > deadline or holder not in (token, ""):
                break
            time.sleep(pause)
            pause = min(pause * 1.5, poll_cap(world) if number else POLL_LAST)
    except DistCommError:
        raise
    except Exception:
        raise _missing(rnd, rank, world, seconds, where, watch) from None
    if holder not in (token, "") and admitted_key(rank, token) not in found:
        raise ValueError(f"{where}: two processes were started as rank {rank}: {holder} took this rank's place "
                         f"while this one ({token}) waited; start each rank once")
    if refused_key(rank, token) in found:
        raise ValueError(f"{where}: {rnd.get(refused_key(rank, token)).decode()}")
    if admitted_key(rank, token) in found:
        return admitted_seat(job, rnd.get(admitted_key(rank, token)).decode(), rank, token, where)
    if not found:
        raise _missing(rnd, rank, world, seconds, where, watch)
    if "complete" not in found:  # seen by the members, not let in: it joins them once ready
        return None
    return Seat(job, f"round-{number}", rank, tuple(range(world)), token, where, True)


@dataclasses.dataclass(frozen=True)
class Waiting:
    """A replacement the members' ``admit()`` has seen waiting in round ``number`` (as ``rank`` of
    ``world``, the process ``token``), not let in: it proves the job's key, which is what the members
    let in on, only in ``join``. ``address``: the store's host and port, and whether this process
    serves it."""

    job: Records
    number: int
    rank: int
    world: int
    token: str
    where: str
    hosted: bool
    address: tuple[str, int, bool]

    def join(self, seconds: float) -> Seat:
        """Prove the key and wait, within ``seconds``, until the members' next ``admit()`` lets this
        process in (or its round completes: a restart of the whole job); its seat. Raises as ``meet``."""
        host, port, serving = self.address
        watch = _StoreWatch(host, port, hosted=self.hosted, serving=serving)
        try:
            seat = _wait_for_round(self.job, self.number, self.rank, self.world, self.token,
                                   time.monotonic() + seconds, seconds, self.where, watch)
        finally:
            watch.close()
        return dataclasses.replace(seat, hosted=self.hosted)


def seen_key(rank: int, token: str) -> str:
    """The key, in a round, that says the members' ``admit()`` saw the process ``token`` waiting as
    ``rank`` and would let it in once it proves the key: its ``from_env()`` returns then."""
    return f"seen/{rank}/{token}"


def admitted_key(rank: int, token: str) -> str:
    """The key, in a round, that lets the process ``token`` in as ``rank`` (its value: the epoch).
    Keyed by process: a later replacement of the same rank waits for its own."""
    return f"admitted/{rank}/{token}"


TICKET = "ticket"
"""Where the members' rank 0 publishes the ticket of their membership (``_trust.handshake``): a
digest of every member's fresh nonce, new with each membership."""


def proof_key(rank: int, token: str) -> str:
    """Where, in a round, the process ``token`` waiting as ``rank`` proves it holds the job's key: a
    membership's ticket, signed. The members let it in only over a ticket of their own: a proof
    copied from an earlier job (same key, same names) names a membership they never were."""
    return f"proof/{rank}/{token}"


def prove_to_members(job: Records, rnd: Records, rank: int, token: str, proved: bytes) -> bytes:
    """Prove the key over the members' latest ticket, where it is new (``proved``: the last one
    proven over); the ticket proven over."""
    ticket = job.read(TICKET) or b""
    if ticket and ticket != proved:
        rnd.set(proof_key(rank, token), ticket)
    return ticket


def refused_key(rank: int, token: str) -> str:
    """The key, in a round, that refuses the process ``token`` (its value: why)."""
    return f"refused/{rank}/{token}"


def pid_key(rank: int, token: str) -> str:
    """The key, in a round, where the process ``token`` says where it runs (``<machine>:<pid>``): the
    members that admit it watch its pid while its group forms."""
    return f"pid/{rank}/{token}"


def who_key(epoch: str, job_rank: int) -> str:
    """Where the process of ``job_rank`` in membership ``epoch`` says who it is (its token: host and pid)."""
    return f"{epoch}/who/{job_rank}"


def admitted_seat(job: Records, epoch: str, rank: int, token: str, where: str, *, hosted: bool = True) -> Seat:
    """The seat of a process in the membership ``epoch`` that an ``admit()`` made."""
    members, admitted = ranks_in(job.get(f"{epoch}/members")), ranks_in(job.get(f"{epoch}/admitted"))
    return Seat(job, epoch, rank, members, token, where, hosted, admitted)


def ranks_in(text: bytes) -> tuple[int, ...]:
    """Job ranks as the store keeps them: "0,2,3"."""
    return tuple(int(r) for r in text.decode().split(",") if r)


def _missing(rnd: Records, rank: int, world: int, seconds: float, where: str, watch: _StoreWatch) -> DistCommError:
    """What the wait for the other ranks ran into: who never arrived, or the store went away."""
    try:
        missing = [r for r in range(world) if not rnd.check([f"rank/{r}"])]
    except Exception:
        return watch.went_away(rank, where)
    return CollectiveTimeoutError(
        f"{where} did not complete within {seconds:g} s: rank {rank} waited for rank(s) {_ranks(missing)} of "
        f"{world}, which never arrived (not started, or started with other variables"
        f"{', or with another job key' if rnd.key else ''})", op="rendezvous", ranks=missing)


class _StoreWatch:
    """A plain connection to the store's port: the store never sends on it, so it becomes readable
    only when the process serving it goes away. None where this process serves it, or where it can't
    be made (the store's own errors say). ``hosted``: rank 0 serves the store (else a launcher's
    process, or one apart)."""

    def __init__(self, host: str, port: int, *, hosted: bool, serving: bool) -> None:
        self.hosted = hosted
        self.sock: socket.socket | None = None
        if not serving:
            with contextlib.suppress(OSError):
                self.sock = socket.create_connection((host, port), timeout=5.0)

    def gone(self) -> bool:
        return self.sock is not None and readable(self.sock)

    def went_away(self, rank: int, where: str) -> PeerError:
        server = "its host (rank 0)" if self.hosted else "the process serving it (the launcher's, or one apart)"
        return PeerError(f"{where} went away while rank {rank} waited for the other ranks: {server} ended or "
                         f"lost its connection", op="rendezvous", ranks=[0] if self.hosted else [])

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()


_SERVED: dict[int, Any] = {}
"""The stores this process serves, by port: kept for the life of the process (see the module's doc)."""


def _connect(host: str, port: int, rank: int, world: int, seconds: float, hosted: bool, where: str) -> Any:
    """A store client within ``seconds``; rank 0's is also the server, unless a launcher serves it."""
    if hosted and rank == 0:
        if port not in _SERVED:
            _SERVED[port] = _serve(host, port, world, seconds, where)
        return _SERVED[port]
    deadline = time.monotonic() + seconds
    _reach(host, port, rank, seconds, hosted, where)
    return _client(host, port, world, max(deadline - time.monotonic(), 1.0), rank, hosted, where)


def serve_store(url: str, world: int, seconds: float) -> Any:
    """Serve the job's store at ``url`` from this process (which is none of the job's ranks: the
    store then outlives any of them). Kept as long as the caller holds it."""
    host, port = parse_url(url)
    return _serve(host, port, world, seconds, f"the job's store at {host}:{port}")


def _serve(host: str, port: int, world: int, seconds: float, where: str) -> Any:
    try:
        return _c10d().TCPStore(host, port, world, True, datetime.timedelta(seconds=seconds), wait_for_workers=False)
    except Exception as e:
        raise CommunicatorStateError(
            f"rank 0 could not open {where} ({_first_line(e)}); the port may be held by another job: "
            f"set MASTER_PORT to a free port on every rank") from None


def _reach(host: str, port: int, rank: int, seconds: float, hosted: bool, where: str) -> None:
    """Wait until something accepts connections at ``host:port``; or say why nothing did.

    A plain connection first, so that the reason is this machine's: a name that doesn't resolve is
    refused at once; a refused connection (the host not started yet) or one that gets no answer (a
    firewall dropping packets) is tried again until ``seconds`` are over."""
    deadline = time.monotonic() + seconds
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise CommunicatorStateError(f"{where}: {unresolved(host)}") from None
    host_role = "its host (rank 0)" if hosted else "the launcher's store"
    reason = ""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise CollectiveTimeoutError(f"{where} did not complete within {seconds:g} s: rank {rank} could not "
                                         f"reach {host_role}: {reason}", op="rendezvous", ranks=[0])
        family, kind, proto, _, address = addresses[0]
        with socket.socket(family, kind, proto) as s:
            s.settimeout(min(left, 5.0))
            try:
                s.connect(address)
                return
            except ConnectionRefusedError:
                reason = ("nothing listens there (connection refused): rank 0 has not started, or MASTER_ADDR / "
                          "MASTER_PORT differ between ranks")
            except TimeoutError:
                reason = ("no answer (a firewall may drop the packets, or the address is not this network's): "
                          "check MASTER_ADDR and that the port is open between the machines")
            except OSError as e:
                reason = f"{e.strerror or e} (check MASTER_ADDR and the network between the machines)"
        time.sleep(min(0.2, max(deadline - time.monotonic(), 0)))


def _client(host: str, port: int, world: int, seconds: float, rank: int, hosted: bool, where: str) -> Any:
    """torch's store client, made on a helper thread: it waits for the server's answer without a
    limit, so a port where something else listens would hold it forever; given up on, with the
    thread, when the time is over."""
    made: list[Any] = []

    def make() -> None:
        try:
            made.append(_c10d().TCPStore(host, port, world, False, datetime.timedelta(seconds=seconds),
                                         wait_for_workers=False))
        except BaseException as e:
            made.append(e)

    helper = threading.Thread(target=make, name="distcomm-rendezvous", daemon=True)
    helper.start()
    helper.join(seconds + 5.0)  # the client's own connect gives up at ``seconds``; the answer may lag
    if made and not isinstance(made[0], BaseException):
        return made[0]
    reason = (f"{type(made[0]).__name__}: {_first_line(made[0])}" if made else
              "something listens there but doesn't answer as a rendezvous store: set MASTER_PORT to the port "
              "rank 0 serves")
    host_role = "its host (rank 0)" if hosted else "the launcher's store"
    raise CollectiveTimeoutError(
        f"{where} did not complete within {seconds:g} s: rank {rank} could not reach {host_role} ({reason})",
        op="rendezvous", ranks=[0])


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


def _c10d() -> Any:
    return torch._C._distributed_c10d


def unresolved(host: str) -> str:
    """Why ``host`` names no address here, or "" where it resolves."""
    try:
        socket.getaddrinfo(host.strip("[]"), None)
        return ""
    except OSError as e:
        return (f"the host name {host!r} does not resolve on this machine ({e.strerror or e}); set MASTER_ADDR to a "
                f"name or address every rank can resolve")


def unreachable_here(master: str) -> str:
    """Why peers on other machines could not reach this process over gloo, or "".

    Without GLOO_SOCKET_IFNAME, gloo advertises the address this host's name resolves to; where
    that is a loopback address (Debian maps the host name to 127.0.1.1) or nothing, peers on other
    machines are handed an address they can't connect to, and each connection waits for the timeout.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME") or _is_loopback(master):
        return ""
    name = socket.gethostname()
    try:
        advertised = socket.gethostbyname(name)
    except OSError:
        advertised = ""
    if advertised and not _is_loopback(advertised):
        return ""
    toward = _address_toward(master)
    return (f"this host's name {name!r} resolves to {advertised or 'no address'}, which peers on other machines "
            f"can't reach: gloo would hand them that address. Set GLOO_SOCKET_IFNAME to the interface that "
            f"reaches {master}" + (f" (the one with address {toward}: see `ip -o addr`)" if toward else ""))


def _is_loopback(host: str) -> bool:
    try:  # an address: IPv6's ::1 too (the name lookup below knows IPv4 only)
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        return host == "localhost" or socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def _address_toward(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP socket's connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return ""


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")


def rejoin(seat: Seat, world: int, seconds: float) -> Seat:
    """Wait as a replacement does, until the members' ``admit()`` lets this process in again: a
    member that the others' shrink left out while it lived (its replica lost a rank: see
    ``_mesh``). A place of its own in the open round under a new token, proven with the job's key
    over the members' ticket, as any newcomer's. Meanwhile it says so under ``rejoin_key`` (a
    launcher's agent ends such a process once the job is over)."""
    token = f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(8)}"
    number = _take_place(seat.job, seat.job_rank, world, token, seat.where)
    here = f"{machine()}:{os.getpid()}"
    seat.job.set(f"round-{number}/{pid_key(seat.job_rank, token)}", here)
    seat.job.set(rejoin_key(seat.job_rank), here)
    watch = _StoreWatch("", 0, hosted=seat.hosted, serving=True)  # (its shrink saw the store there)
    try:
        new = _wait_for_round(seat.job, number, seat.job_rank, world, token, time.monotonic() + seconds, seconds,
                              seat.where, watch)
    finally:
        seat.job.set(rejoin_key(seat.job_rank), "")
    return dataclasses.replace(new, hosted=seat.hosted)


def rejoin_key(job_rank: int) -> str:
    """Where a member left out by a shrink says, while it waits to be let in again, where it runs
    (``<machine>:<pid>``; empty once it is in, or gave up)."""
    return f"rejoining/{job_rank}"
