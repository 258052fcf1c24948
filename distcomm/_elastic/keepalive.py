"""The keep-alive: how a rank on a host that went silent is found lost, and how each process
finds that the job's store went away.

A lost host resets no connections, so nothing in the transport says it is gone; its beat in the
job's store stops instead. Each process moves its own beat and watches one other member's, so the
store sees a few calls per rank per beat at any world size.
"""

from __future__ import annotations

import atexit
import dataclasses
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .._launching.rendezvous import Seat, beat_key, tcp_store
from .liveness import HOSTS_LOST, alive, lost_by_silence, readable

__all__ = ["BEAT_SECONDS", "broken_key", "keep_alive"]

BEAT_SECONDS = 0.5
"""How often a process's keep-alive beat moves in the job's store."""


@dataclasses.dataclass
class _Beat:
    """What the keep-alive thread does for one membership: beat as ``job_rank``, watch ``successor``."""

    store: Any  # the job's records, on a client of its own
    epoch: str
    job_rank: int
    successor: int | None  # the next member, whose beat this process watches (None: alone)
    watch: socket.socket | None  # a connection to the store's port that only its end makes readable
    host_pid: int | None  # the store's host, where this machine sees it
    seen: tuple[int, float] = (-1, 0.0)  # the successor's beat count, and when it last moved on
    pids: dict[int, int] = dataclasses.field(default_factory=dict)  # members' pids on this machine, by job rank
    broken: bool = False  # whether the membership was found broken
    on_broken: Callable[[], None] | None = None  # what that breaks (once)

    def gone(self) -> bool:
        """Whether the store has gone away, found without asking it."""
        if self.host_pid is not None and not alive(self.host_pid):
            return True
        return self.watch is not None and readable(self.watch)

    def ask(self, name: str, *args: Any) -> Any:
        """The store's answer to one call, looked before: torch's client prints a page of C++ stack
        frames for each call to a store that is gone (only a call already in flight when its host
        goes can still print one)."""
        if self.gone():
            raise _StoreGone
        return getattr(self.store, name)(*args)


class _StoreGone(Exception):
    pass


_last_beat = [0]


def _beat(beat: _Beat) -> None:
    """Move this process's beat on: a signed count that only goes up, across memberships and
    processes of one rank (milliseconds of the clock, at least one more than the last), so that a
    beat replayed from earlier never looks like a new one."""
    _last_beat[0] = max(_last_beat[0] + 1, time.time_ns() // 1_000_000)
    beat.ask("set", beat_key(beat.job_rank), str(_last_beat[0]))


class _KeepAlive:
    """One thread per process that moves its beat (``beat_key``) in the job's store every beat, on a
    connection of its own (a collective's wait never delays it), and watches the next member's
    beat: one that stops for ``LOSS_SECONDS`` (a lost host, whose connections nothing resets) is
    posted for the membership, and every process's waits then fail at their next slice, naming it.
    Each rank watches one other, so the store sees a few calls per rank per beat at any world size.

    It also watches whether the store is still there, without asking it: a plain connection to the
    store's port, over which the store never sends anything, becomes readable when its host goes
    away; and a host on this machine is looked at by its pid."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._beat: _Beat | None = None
        self._thread: threading.Thread | None = None
        self._ending = threading.Event()

    def follow(self, seat: Seat) -> None:
        """Beat for ``seat`` from now on. Called before the membership's group is built, so that its
        first calls to the store come before the last step of start-up (after which rank 0, which
        may host the store, can be gone at once: a crash on a job's first line)."""
        beat = _follow(seat)
        with self._lock:
            self._stop()
            HOSTS_LOST.clear()
            self._beat = beat
            if beat is not None and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._run, name="distcomm-keepalive", daemon=True)
                self._thread.start()
                atexit.register(self._end)

    def stop(self) -> None:
        """Beat for no membership (the thread stays, idle, until the next ``follow``)."""
        with self._lock:
            self._stop()

    def unwatch(self) -> None:
        """Beat on, but watch no other member (a membership whose group never formed: its members
        are agreeing on the next, and one that stops beating meanwhile is not lost)."""
        with self._lock:
            if self._beat is not None:
                self._beat.successor = None

    def on_broken(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` (from the keep-alive's thread) once this membership is found broken: a member
        began to shrink it, or a member's beat stopped. Torch's own waits on the membership's groups
        (DDP's, a user's) look at nothing but their connections; ``fn`` breaks those."""
        with self._lock:
            if self._beat is not None:
                self._beat.on_broken = fn

    def watch_host(self, pid: int | None, members: dict[int, int]) -> None:
        """The pid of the store's host, and the members' (by job rank), where this machine sees them
        (known once the group is built): a member whose process lives here is never lost by a
        stopped beat alone (a call that holds the GIL for long stops its keep-alive thread)."""
        with self._lock:
            if self._beat is not None:
                self._beat.host_pid = pid
                self._beat.pids = dict(members)

    def _end(self) -> None:
        """At exit, before the interpreter stops its daemon threads: one stopped inside a store call
        is unwound through torch's C++ code, which aborts the process ("terminate called without an
        active exception") after all its work is done."""
        self._ending.set()
        if self._thread is not None:
            self._thread.join(BEAT_SECONDS + 5.0)

    def store_gone(self) -> bool:
        """Whether the store this process beats in has gone away (False when it isn't watched)."""
        with self._lock:
            beat = self._beat
        return beat is not None and beat.gone()

    def _stop(self) -> None:
        if self._beat is not None and self._beat.watch is not None:
            self._beat.watch.close()
        self._beat = None

    def _run(self) -> None:
        while not self._ending.wait(BEAT_SECONDS):  # (the first beat is follow's)
            with self._lock:
                beat = self._beat
            if beat is not None:
                try:
                    _once(beat)
                except _StoreGone:
                    with self._lock:
                        if self._beat is beat:
                            self._stop()
                except Exception:  # noqa: S110 - gone between the look and the beat: the next look says
                    pass


def _follow(seat: Seat) -> _Beat | None:
    """The beat for ``seat``, on a client of its own; None where the store is gone already (a
    client made then would retry its connection, printing torch's warnings, for the store's timeout)."""
    server = tcp_store(seat.job)
    members = seat.members
    successor = members[(members.index(seat.job_rank) + 1) % len(members)] if len(members) > 1 else None
    try:
        watch = None if server is None else socket.create_connection((server.host, server.port), timeout=5.0)
    except OSError:
        return None
    beat = _Beat(None, seat.epoch, seat.job_rank, successor, watch, None, (-1, time.monotonic()))
    try:
        if beat.gone():
            raise _StoreGone
        beat.store = seat.job.clone()
        _beat(beat)
    except Exception:
        if watch is not None:
            watch.close()
        return None
    return beat


def broken_key(epoch: str) -> str:
    """The key that says membership ``epoch`` is broken: set by a member that begins to shrink it,
    and after ``{epoch}/silent`` by the member that found a beat stopped."""
    return f"{epoch}/broken"


def _once(beat: _Beat) -> None:
    """One beat: move this process's, look at the successor's, and at whether the membership broke."""
    _beat(beat)
    successor = beat.successor  # (read once: unwatch() may clear it meanwhile)
    if successor is not None:
        now = time.monotonic()
        said = beat.ask("read", beat_key(successor))  # (None while it has not beaten yet)
        value = int(said) if said and said.isdigit() else 0
        if value > beat.seen[0]:
            beat.seen = (value, now)
        elif lost_by_silence(beat.pids.get(successor), now - beat.seen[1]):
            beat.ask("compare_set", f"{beat.epoch}/silent", "", str(successor))
            beat.ask("set", broken_key(beat.epoch), "silent")
    if not beat.broken:
        beat.broken = bool(beat.ask("check", [broken_key(beat.epoch)]))
    silent = beat.ask("read", f"{beat.epoch}/silent") if beat.broken and not HOSTS_LOST else None
    if silent:
        HOSTS_LOST.append(int(silent))
    if beat.broken and beat.on_broken is not None:
        broken, beat.on_broken = beat.on_broken, None
        broken()


keep_alive = _KeepAlive()
