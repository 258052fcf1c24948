"""A threaded world's job: ranks lost on cue (``run_threaded(lose=...)``), the survivors' ``shrink()``
and the replacements that the members' ``admit()`` lets in. The membership calls of a real job, in
one process, so that a trainer's recovery loop can be unit-tested."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .._elastic.membership import Membership
from .._errors import CommunicatorStateError
from .._mesh import no_whole_replica

if TYPE_CHECKING:
    from .._mesh import ElasticMesh
    from ._threaded import ThreadedCommunicator, _World

__all__ = ["Ended", "Lost", "ThreadedJob"]


class Lost(BaseException):
    """Ends a lost rank's thread as SIGKILL ends a process: no ``except Exception`` of the user's sees it."""


class Ended(BaseException):
    """Ends the thread of a rank still waiting in ``shrink()`` for its replica to be whole when the
    members have all returned, as the agent ends such a process (its result is None, as a lost rank's)."""


class ThreadedJob:
    """What the ranks of one ``run_threaded`` world share across their memberships.

    ``lose[r]``: job rank ``r``'s first thread is lost as it enters its ``lose[r]``-th collective
    (calls on its sub-communicators count; calls made inside another, and async ones until they run,
    don't). ``replacements``: how many lost ranks are run again, each waiting until the members
    ``admit()`` it."""

    def __init__(self, lose: Mapping[int, int], replacements: int) -> None:
        self.lose = dict(lose)
        self.replacements = replacements
        self._lock = threading.Lock()
        self._entered: dict[int, int] = {}
        self._gone: set[int] = set()
        self._next: dict[_World, tuple[_World, Membership]] = {}  # a world's successor, made once
        self._waiting: dict[int, ThreadedCommunicator | None] = {}  # newcomers: their comm, once admitted
        self._rejoining: set[int] = set()  # those of them that are members left out of a shrink, not replacements
        self._changed = threading.Condition(self._lock)
        self.ended = False

    # ------------------------------------------------------------------ losing a rank
    def entering(self, comm: ThreadedCommunicator) -> None:
        """``comm``'s rank enters a collective: raise Lost in it if this is where its thread is lost."""
        if comm._replacement:
            return
        with self._lock:
            n = self._entered[comm._job_rank] = self._entered.get(comm._job_rank, 0) + 1
            if self.lose.get(comm._job_rank) != n:
                return
            self._gone.add(comm._job_rank)
            # (the survivors of another loss may have made their next world with this rank in it
            # before it was lost: as a real one's process, it is lost there too)
            formed = [w for w, _ in self._next.values() if comm._job_rank in w.job_ranks]
        comm._world_lost(comm._job_rank)
        for world in formed:
            world.lose(comm._job_rank)
        raise Lost

    # ------------------------------------------------------------------ shrink
    def survivors(self, world: _World, membership: Membership, mesh: ElasticMesh | None) -> tuple[_World, Membership]:
        """The world and membership of ``world``'s survivors (the same for every survivor). Where the
        job's mesh has replicas, only the whole ones (``MeshLayout.whole``): a survivor left out
        waits to be let in again (``wait_admitted``)."""
        with self._lock:
            if world not in self._next:
                alive = tuple(r for r in membership.job_ranks if r not in self._gone)
                lost = tuple(r for r in membership.job_ranks if r in self._gone)
                members = _whole_replicas(mesh, alive, lost)
                self._next[world] = (type(world)(len(members), job_ranks=members), Membership(members, lost))
            return self._next[world]

    # ------------------------------------------------------------------ admit
    def wait_admitted(self, job_rank: int, deadline: float, *, rejoining: bool = False) -> ThreadedCommunicator | None:
        """A replacement for ``job_rank`` waits here until the members let it in (None: the job ended,
        or ``deadline`` passed). ``rejoining``: a member left out of a shrink waits instead."""
        with self._changed:
            self._waiting[job_rank] = None
            if rejoining:
                self._rejoining.add(job_rank)
            self._changed.notify_all()
            while self._waiting[job_rank] is None and not self.ended and time.monotonic() < deadline:
                self._changed.wait(0.1)
            self._rejoining.discard(job_rank)
            return self._waiting.pop(job_rank)

    def newcomers(self, members: tuple[int, ...], mesh: ElasticMesh | None) -> tuple[int, ...]:
        """Rank 0's part of an admit: the replacements waiting to come in (only those whose replica
        they make whole, where the job's mesh has replicas: ``_decide``'s)."""
        with self._lock:
            waiting = tuple(sorted(r for r, comm in self._waiting.items() if comm is None and r not in members))
        if mesh is not None:
            entire = set(mesh.layout.whole((*members, *waiting)))
            waiting = tuple(r for r in waiting if r in entire)
        return waiting

    def admitted(self, comm: ThreadedCommunicator, newcomers: tuple[int, ...]) -> tuple[_World, Membership]:
        """The world and membership with ``newcomers`` in, each newcomer handed its communicator (of
        ``comm``'s classes: ``_threaded`` imports this module)."""
        with self._changed:
            if comm._world not in self._next:
                members = tuple(sorted((*comm.membership.job_ranks, *newcomers)))
                world = type(comm._world)(len(members), job_ranks=members)
                membership = Membership(members, admitted=newcomers)
                self._next[comm._world] = (world, membership)
                self._gone -= set(newcomers)  # (alive again: replaced)
                for r in newcomers:  # (a member let in again is still the thread it was: lost on its own cue)
                    settings = comm._job_settings(r, membership, replacement=r not in self._rejoining)
                    newcomer = type(comm)(world, members.index(r), **settings)
                    newcomer._holds_state = False  # (until sync_state hands it the members')
                    self._waiting[r] = newcomer
                self._changed.notify_all()
            return self._next[comm._world]

    def end(self) -> None:
        """The members have all finished: replacements still waiting give up."""
        with self._changed:
            self.ended = True
            self._changed.notify_all()

    @property
    def waiting(self) -> int:
        with self._lock:
            return sum(1 for comm in self._waiting.values() if comm is None)


def _whole_replicas(mesh: ElasticMesh | None, alive: tuple[int, ...], lost: tuple[int, ...]) -> tuple[int, ...]:
    """Those of ``alive`` that go on: where the job's mesh has replicas, only the whole ones. Where
    none is whole, the error of every transport's shrink (each survivor finds it: none is made)."""
    if mesh is None:
        return alive
    kept = mesh.layout.whole(alive)
    if not kept:  # (the in-process world's shrink restores no snapshots: ``_elastic.snapshots``)
        raise no_whole_replica(mesh.layout, lost, mesh.unrestorable(lost) or "the in-process world restores none")
    return kept


def refuse_sub(comm: Any, op: str) -> None:
    if comm._world.parent is not None:
        raise CommunicatorStateError(
            f"{op}() remakes a job's communicator: this {type(comm).__name__} is a sub-communicator; {op} the "
            f"job's communicator, then split the new one again")
