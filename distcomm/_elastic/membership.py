"""Who is in the job: the survivors of a lost rank agree on it (``shrink``), and the members let
replacements in (``admit``). Both end in a new membership with a torch group of its own.

The agreement happens in the job's store, not over the broken group: the store is one server,
so the first proposal written with compare-and-set is the decision every survivor reads, and a
rank that dies while the others agree only makes them agree again without it (ULFM's
``MPI_Comm_shrink`` and ``MPIX_Comm_agree`` give the same guarantee). A rank is gone when its
process is gone (same machine: its pid), or when its keep-alive beat in the store has not moved
for ``LOSS_SECONDS`` (a lost host, whose connections nothing resets). A rank that is alive but slow
is waited for until the timeout.
"""

from __future__ import annotations

import dataclasses
import datetime
import secrets
import time
import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .._calls import CallSpec, Op
from .._errors import CommunicatorStateError, DistCommError, PeerError
from .._launching.rendezvous import (
    Seat,
    admitted_key,
    admitted_seat,
    beat_of,
    pid_key,
    proof_key,
    ranks_in,
    refused_key,
    seen_key,
    who_key,
)
from .._state import check_identical, sync_state
from .._transfer.transport import front_door
from .._trust.handshake import known_ticket
from .._trust.key import KEY_FILE_VAR, KEY_VAR
from .._trust.records import Records
from .deferred_free import DEFERRED
from .keepalive import broken_key, keep_alive
from .liveness import HOSTS_LOST, alive, lost_by_silence

if TYPE_CHECKING:
    from .._communicator import Communicator
    from .._torch import _TorchCommunicator

__all__ = ["Membership", "admission", "job_pids", "reformed", "remember_let_in", "shrink_begun", "successor",
           "survivors", "warn_late_first_call"]

BREAK_SECONDS = 1.0
"""How long a shrink waits for its groups' waits to break before it goes on (the groups are held: ``deferred_free``)."""
LATE_FIRST_CALL_SECONDS = 0.5
"""A replacement whose first call comes this long after the members let it in is told: they waited."""
POLL_SECONDS = 0.05
LEADER_POLL_SECONDS = 0.2


@dataclasses.dataclass(frozen=True)
class Membership:
    """Who a job communicator's ranks are.

    ``job_ranks[r]`` is the launcher's rank of this communicator's rank ``r``; ``lost`` the job
    ranks that the shrink which made it found gone; ``admitted`` the job ranks that the admit which
    made it let in."""

    job_ranks: tuple[int, ...]
    lost: tuple[int, ...] = ()
    admitted: tuple[int, ...] = ()


# ---------------------------------------------------------------- agreement
def agree_on_survivors(seat: Seat, members: tuple[int, ...], pids: dict[int, int],
                       seconds: float) -> tuple[str, tuple[int, ...]]:
    """The new epoch and its members: ``members`` (job ranks) that are here, once every other is gone.

    Repeated until a round of it finds everyone it agreed on: a rank that dies between the
    decision and the new group is then dropped too, and every survivor ends with the same answer."""
    base = _shrink_base(seat.epoch)
    while True:  # each round its own bound: one that waited out a slow rank leaves the next none
        epoch, survivors = _agree(seat, base, members, pids, time.monotonic() + seconds)
        if seat.job_rank not in survivors:
            raise CommunicatorStateError(
                f"rank {members.index(seat.job_rank)} (job rank {seat.job_rank}) was left out of the shrink: the "
                f"others found it gone or it came after their timeout; start a new process to be admitted")
        if survivors == members and base.endswith("/ready"):
            return epoch, survivors
        members, base = survivors, f"{epoch}/ready"


def _agree(seat: Seat, base: str, members: tuple[int, ...], pids: dict[int, int],
           deadline: float) -> tuple[str, tuple[int, ...]]:
    """One round of agreement under ``base``: each member says it is here; one of them, the leader
    (the first to come, or whoever finds the leader gone), looks at who is missing and proposes once
    the rest are gone; the others only look for the decision (one store call a poll) and, each
    second, at the leader. Only the leader's calls grow with the world size. Two leaders (one
    taken for gone while it lives) are harmless: the first decision written is the one."""
    job = _checked(seat)
    me = seat.job_rank
    try:
        job.set(f"{base}/here/{me}", seat.token)
        leader = int(job.compare_set(f"{base}/leader", "", str(me)))
    except Exception as e:
        raise _store_lost(seat) from e
    beats: dict[int, tuple[int, float]] = {}
    next_look = 0.0
    while True:
        if keep_alive.store_gone():
            raise _store_lost(seat)
        try:
            if job.check([f"{base}/decision"]):
                return _decision(job.get(f"{base}/decision").decode())
            now = time.monotonic()
            if leader != me:
                if now >= next_look:
                    next_look = now + 1.0
                    if _gone(job, leader, pids, beats):  # take over from a lost leader (or from its taker)
                        leader = int(job.compare_set(f"{base}/leader", str(leader), str(me)))
                time.sleep(POLL_SECONDS)
                continue
            present = tuple(r for r in members if job.check([f"{base}/here/{r}"]))
            waiting = [r for r in members if r not in present and not _gone(job, r, pids, beats)]
        except Exception as e:
            raise _store_lost(seat) from e
        if not waiting or time.monotonic() > deadline:
            proposal = f"{_new_epoch(job)}:{','.join(map(str, present))}"
            return _decision(job.compare_set(f"{base}/decision", "", proposal).decode())
        time.sleep(LEADER_POLL_SECONDS)


def _new_epoch(job: Records) -> str:
    """A new membership's name: numbered in order, and never one used before (its records signed
    under an old name can't be replayed into it, whatever an outsider does to the counter)."""
    return f"epoch-{job.add('epochs', 1)}-{secrets.token_hex(4)}"


def shrink_begun(job: Records, epoch: str) -> bool:
    """Whether a member has begun to agree on the survivors of membership ``epoch`` (its first
    round of agreement has a leader)."""
    return bool(job.check([f"{_shrink_base(epoch)}/leader"]))


def _shrink_base(epoch: str) -> str:
    """Where the survivors of membership ``epoch`` agree."""
    return f"{epoch}/shrink"


def _decision(text: str) -> tuple[str, tuple[int, ...]]:
    epoch, _, ranks = text.partition(":")
    return epoch, tuple(int(r) for r in ranks.split(",") if r)


def _gone(job: Records, rank: int, pids: dict[int, int], beats: dict[int, tuple[int, float]]) -> bool:
    """Whether job rank ``rank`` is gone: its process, where this machine sees it; its beat posted
    silent; or its beat standing still (``lost_by_silence``)."""
    pid = pids.get(rank)
    if (pid is not None and not alive(pid)) or rank in HOSTS_LOST:
        return True
    now = time.monotonic()
    beat = beat_of(job, rank)
    last = beats.get(rank)
    if last is None or beat > last[0]:
        beats[rank] = (beat, now)
        return False
    return lost_by_silence(pid, now - last[1])


def _checked(seat: Seat) -> Records:
    """The job's store, if its host is still there."""
    if keep_alive.store_gone():
        raise _store_lost(seat)
    return seat.job


def _store_lost(seat: Seat) -> PeerError:
    host = "rank 0, which hosted it," if seat.hosted else "the process that hosted it"
    return PeerError(
        f"the job's store ({seat.where}) was lost: {host} is gone, and the survivors can no longer agree on who "
        f"is left. To outlive any rank, host the store apart: launch(..., elastic=True) serves it from the "
        f"launching process, and under other launchers DISTCOMM_STORE=external with MASTER_ADDR/MASTER_PORT "
        f"naming a store you run (python -m distcomm store --port PORT)", op="shrink", ranks=[0])


# ---------------------------------------------------------------- admission
def waiting_newcomers(seat: Seat, members: Iterable[int],
                      pids: dict[int, int]) -> tuple[str, dict[int, str], dict[int, tuple[str, str]]]:
    """The job's open round and the processes waiting in it: (job rank -> token) to let in, and
    (job rank -> (token, why)) to refuse: a process started as a rank that is a member and alive.
    One started for a member that is gone but not yet shrunk away waits on: the members' next
    admit after their shrink lets it in. Only one that proved the key comes in (it does so at its
    first use: ``_launching.joining``); one refused nothing that hasn't yet is told it was seen.
    ``pids``: the members' on this machine, by job rank."""
    job = _checked(seat)
    rnd = f"round-{int(job.add('round', 0))}"
    world = int(job.read(f"{rnd}/world") or 0)  # ("": a size refused)
    members = set(members)
    newcomers: dict[int, str] = {}
    refused: dict[int, tuple[str, str]] = {}
    for r in range(world):
        token = (job.read(f"{rnd}/rank/{r}") or b"").decode()
        if not token or job.check([f"{rnd}/{admitted_key(r, token)}"]) or job.check([f"{rnd}/{refused_key(r, token)}"]):
            continue
        if job.key is None:
            refused[r] = (token, _NO_KEY)
        elif r in members:
            if _alive_member(job, seat.epoch, r, pids):
                refused[r] = (token, f"rank {r} of the job is a member and alive ({_member_process(job, seat, r)}); "
                                     f"this process ({token}) was started as rank {r} too: a replacement takes the "
                                     f"rank of a lost one")
            elif r in pids:  # its member dead (its pid, here): it starts up meanwhile, and comes in after their shrink
                _saw(job, rnd, r, token)
        elif token not in _LET_IN:
            if _proven(job.under(rnd), r, token):
                newcomers[r] = token
            else:  # not ready yet: it proves the key at its first use, and comes in at an admit after that
                _saw(job, rnd, r, token)
    return rnd, newcomers, refused


def _saw(job: Records, rnd: str, rank: int, token: str) -> None:
    """Tell a newcomer not ready yet that the members saw it and refused it nothing: its
    ``from_env()`` returns, and it starts up off the members' path (``_launching.joining``)."""
    if token not in _SEEN:
        job.set(f"{rnd}/{seen_key(rank, token)}", "1")
        _SEEN.add(token)


_SEEN: set[str] = set()


def remember_let_in(seat: Seat) -> None:
    """The processes the admit that made ``seat``'s membership let in, remembered by each member: a
    place of one of them written back into the round (its signed record replayed after it was
    freed) never lets a ghost in again."""
    for r in seat.admitted:
        said = seat.job.read(f"{seat.epoch}/token/{r}")
        if said:
            _LET_IN.add(said.decode())


_LET_IN: set[str] = set()


def _proven(rnd: Records, rank: int, token: str) -> bool:
    """Whether the newcomer ``token`` waiting as ``rank`` proved it holds the job's key over the
    ticket of a membership this process was in (fresh: made of its members' nonces when its group
    formed, so a proof copied from an earlier job with the same key names none of them)."""
    ticket = rnd.read(proof_key(rank, token))
    return ticket is not None and known_ticket(ticket.decode())


_NO_KEY = (f"this job has no key, and only a job with one lets a process in once it runs (an outsider who can "
           f"reach the store could join it otherwise): give every process of the job the same key, "
           f"{KEY_VAR} (16 or more characters) or {KEY_FILE_VAR}; python -m distcomm run, launch() and "
           f"testing.spawn() make one (docs/trust-model.md)")


def _alive_member(job: Records, epoch: str, rank: int, pids: dict[int, int]) -> bool:
    """Whether member ``rank`` of membership ``epoch`` is alive: its process where this machine sees
    it, else its beat moved since the last admit looked (the first look is no proof: it waits for
    the next)."""
    pid = pids.get(rank)
    if pid is not None:
        return alive(pid)
    beat = beat_of(job, rank)
    seen, _BEATS_SEEN[(epoch, rank)] = _BEATS_SEEN.get((epoch, rank)), beat
    return seen is not None and beat > seen


_BEATS_SEEN: dict[tuple[str, int], int] = {}
"""Each member's keep-alive count when an admit of its membership last looked (alive, it moves it)."""


def _member_process(job: Records, seat: Seat, rank: int) -> str:
    """The process of member ``rank`` as the rendezvous named it (host and pid), where it can be found."""
    said = job.read(who_key(seat.epoch, rank))
    return said.decode() if said else f"job rank {rank}"


def _decide(seat: Seat, members: tuple[int, ...], pids: dict[int, int],
            whole: Callable[[Iterable[int]], tuple[int, ...]] | None) -> tuple[str, tuple[int, ...]]:
    """Rank 0's part of an admit: the new membership's epoch and who comes in ("" and none when no
    one waits, or when a shrink of this membership began first). It is written down and claimed
    as this membership's successor before anyone is told, so that members who fail the admit's
    broadcast (a rank died in it) find it and agree within it, with those who got it. ``whole``:
    where the job's mesh has replicas, those of some ranks whose replica is all there (a replica
    comes in whole: ``_mesh``)."""
    job = _checked(seat)
    rnd, newcomers, refused = waiting_newcomers(seat, members, pids)
    for r, (token, why) in refused.items():
        job.set(f"{rnd}/{refused_key(r, token)}", why)
    if whole is not None:
        entire = set(whole((*members, *newcomers)))
        newcomers = {r: token for r, token in newcomers.items() if r in entire}
    if not newcomers:
        return "", ()
    epoch = _new_epoch(job)
    job.set(f"{epoch}/members", ",".join(map(str, sorted((*members, *newcomers)))))
    job.set(f"{epoch}/admitted", ",".join(map(str, sorted(newcomers))))
    job.set(f"{epoch}/round", rnd)
    for r, token in newcomers.items():
        job.set(f"{epoch}/token/{r}", token)
        said = job.read(f"{rnd}/{pid_key(r, token)}")
        if said:  # watched while the group forms, from the first try
            where, _, pid = said.decode().partition(":")
            job.append_entry(f"{epoch}/pids/{where}", f"{r}:{pid}")
    if job.compare_set(f"{seat.epoch}/successor", "", f"admit:{epoch}").decode() != f"admit:{epoch}":
        return "", ()
    tell_newcomers(job, epoch)
    return epoch, tuple(sorted(newcomers))


def tell_newcomers(job: Records, epoch: str) -> None:
    """Let the newcomers of membership ``epoch`` in: each leaves its wait in the round, and its
    place there is freed (the round counts only processes still waiting). Done again by any member
    that finds the membership after a lost rank 0 (which may have told only some); the place is
    freed once."""
    rnd = job.get(f"{epoch}/round").decode()
    for r in ranks_in(job.get(f"{epoch}/admitted")):
        token = job.get(f"{epoch}/token/{r}").decode()
        job.set(f"{rnd}/{admitted_key(r, token)}", epoch)
        job.compare_set(f"{rnd}/rank/{r}", token, "")  # (then counted once: whoever tells first, or again)
        if job.add(f"{epoch}/told/{r}", 1) == 1:
            job.add(f"{rnd}/count", -1)


# ---------------------------------------------------------------- the two calls
def survivors(comm: _TorchCommunicator, seconds: float | None,
              pids: dict[int, int]) -> tuple[Seat, tuple[int, ...]]:
    """``comm.shrink()``'s agreement: the seat of the survivors' membership, and the job ranks lost
    (``pids``: the members' on this machine, by job rank).
    ``comm`` is let go of first (its groups are kept, not closed: see ``_abandon``); ranks still
    waiting in the failed call find, within a second, that this one has begun to agree
    (``_waits.check_peers``), and fail too.

    Where an admit had already made this membership's successor (some members got its decision,
    others failed it), the survivors are those of the admit's membership, newcomers included."""
    seat = _job_seat(comm, "shrink")
    comm._break_waits(BREAK_SECONDS)  # (this process's own waits first: the others' break at their next beat)
    tell_broken(seat)
    held = comm._abandon()
    seat, via_admit = successor(seat)
    if via_admit:
        tell_broken(seat)
    new, lost = reformed(seat, pids, _bounded(seconds))
    if not lost:  # (every peer of those groups is here: no transport thread of theirs waits on a lost one)
        DEFERRED.free(held)
    return (new if via_admit else dataclasses.replace(new, admitted=())), lost


def tell_broken(seat: Seat) -> None:
    """Say in the job's store that ``seat``'s membership broke: every member's keep-alive then
    breaks the waits on its groups (torch's own, DDP's, included) at its next beat."""
    try:
        _checked(seat).set(broken_key(seat.epoch), "shrink")
    except DistCommError:
        raise
    except Exception as e:
        raise _store_lost(seat) from e


def successor(seat: Seat) -> tuple[Seat, bool]:
    """The membership whose survivors the members of a broken one (``seat``'s) agree on, and
    whether an admit made it: claimed for the shrink, unless an admit already claimed it as its
    successor (some members got its decision, others failed it); then the admit's membership,
    its newcomers told again (rank 0 may have told only some). Every member comes here before it
    agrees (a shrink's, or a group that failed to form), so all agree on the same one."""
    try:
        claim = _checked(seat).compare_set(f"{seat.epoch}/successor", "", "shrink").decode()
        if not claim.startswith("admit:"):
            return seat, False
        epoch = claim.partition(":")[2]
        tell_newcomers(seat.job, epoch)
        return admitted_seat(seat.job, epoch, seat.job_rank, seat.token, seat.where, hosted=seat.hosted), True
    except DistCommError:
        raise
    except Exception as e:
        raise _store_lost(seat) from e


def warn_late_first_call(let_in_at: float) -> None:
    """At a replacement's first call: warn where it came late. The members let it in at its first use
    of the communicator (``_launching.joining``): where that was a read (its rank, its group) rather
    than a call, they have waited in their first call with it (the state's hand-over) since."""
    waited = time.monotonic() - let_in_at
    if waited > LATE_FIRST_CALL_SECONDS:
        warnings.warn(f"distcomm: this replacement's first call came {waited:.2f} s after the members let it in, "
                      f"and every member waited for it that long: it joins them at its first use of the "
                      f"communicator, a call or a read of its rank, world size, group or membership; build the "
                      f"model and the optimizer before that use "
                      f"(docs/elastic.md#the-whole-state-sync_state-and-check_identical)",
                      RuntimeWarning, stacklevel=4)


def job_pids(comm: _TorchCommunicator) -> dict[int, int]:
    """The pids of ``comm``'s members on this machine, by job rank."""
    members = comm.membership.job_ranks
    return {members[r]: pid for r, pid in comm._peer_pids.items()}


def reformed(seat: Seat, pids: dict[int, int], seconds: float) -> tuple[Seat, tuple[int, ...]]:
    """The seat of the survivors of ``seat``'s membership (one that broke, or whose group failed to
    form), and the job ranks lost."""
    epoch, alive = agree_on_survivors(seat, seat.members, pids, seconds)
    lost = tuple(r for r in seat.members if r not in alive)
    admitted = tuple(r for r in seat.admitted if r in alive)
    return dataclasses.replace(seat, epoch=epoch, members=alive, admitted=admitted), lost


def admission(comm: _TorchCommunicator, seconds: float | None) -> Seat | None:
    """``comm.admit()``'s agreement (a collective): the seat of the membership with the newcomers
    in, or None when no one comes in. Rank 0 decides; every member gets its answer in one broadcast."""
    seat = comm._seat
    assert seat is not None
    members = comm.membership.job_ranks
    try:
        whole = comm._mesh.layout.whole if comm._mesh is not None else None
        decision = _decide(seat, members, job_pids(comm), whole) if comm.rank == 0 else None
    except DistCommError:
        raise
    except Exception as e:
        raise _store_lost(seat) from e
    epoch, newcomers = comm._run(CallSpec(Op.ADMIT, 0, decision, seconds))[0]
    if not newcomers:
        return None
    return dataclasses.replace(seat, epoch=epoch, members=tuple(sorted((*members, *newcomers))), admitted=newcomers)


def _job_seat(comm: _TorchCommunicator, op: str) -> Seat:
    """The seat a job's communicator met the others at; refused on a sub-communicator."""
    seat = comm._seat
    if seat is None:
        raise CommunicatorStateError(
            f"{op}() remakes a job's communicator (from_env, launch, spawn): this {type(comm).__name__} is a "
            f"sub-communicator or over a group torch was given elsewhere; {op} the job's communicator, then "
            f"split the new one again")
    return seat


def _bounded(seconds: float | None) -> float:
    return 3600.0 * 24 if seconds is None else seconds


class ElasticMethods:
    """The front door's methods for a job that outlives its ranks; a communicator that is no job's
    (a world of one, a double that loses no one) answers with itself (``Communicator`` inherits
    them; ``self`` is always one; the torch transports replace ``membership``, ``shrink``, ``admit``)."""

    @property
    def membership(self) -> Membership:
        """Who this communicator's ranks are in the job: each one's launcher rank (``job_ranks``),
        and the job ranks the shrink that made it lost (``lost``) or the admit let in (``admitted``)."""
        comm = front_door(self)
        return Membership(tuple(range(comm.world_size)))

    def shrink(self, *, timeout: float | datetime.timedelta | None = None) -> Communicator:
        """A new communicator of the ranks still alive, after a call failed because ranks were lost.

        Every survivor calls it; they agree on who is gone, even if another rank dies meanwhile,
        and are renumbered in their old order. A rank that is alive but slow is waited for until
        the timeout. This communicator (and its sub-communicators) is closed: split the new one
        again. A communicator that lost no one gives one of the same membership.

        Raises:
            PeerError: the job's store was lost with the rank that hosted it.
            CommunicatorStateError: this rank was left out (it came after the others' timeout), or
                this communicator is not a job's (a sub-communicator, an adopted group).
        """
        comm = front_door(self)
        return comm

    def admit(self, *, timeout: float | datetime.timedelta | None = None) -> Communicator:
        """A new communicator that includes the processes waiting to join the job (replacements
        started with a lost rank's launcher variables), from their first use of the communicator
        ``from_env()`` gave them (before it, they start up while the members step on); this one
        when no one waits.

        Collective: every member calls it, at a point where all agree (a step boundary). Members
        and newcomers are ordered by their launcher rank, so a replacement takes the place of the
        rank it replaces. Hand the newcomers the state they need with the new communicator's
        collectives (``broadcast``). This communicator is closed when someone came in.
        """
        comm = front_door(self)
        comm._check_usable()
        return comm

    def sync_state(self, *objects: Any, allow: Iterable[Any] = ()) -> None:
        """Make every member's training state that of the first member that holds the job's trained
        state (a newcomer holds it only once handed it, through any shrink, admit or split since):
        after ``admit()`` (the newcomers need it) or ``shrink()`` (a failed step may be half applied).
        Where no member holds it (every holder lost), CommunicatorStateError on every rank. After a
        shrink that found no replica of the job's mesh whole, every rank goes back to the newest
        ``snapshot()`` step that every rank's copy is held for (``progress`` too).

        ``objects``: what has ``state_dict()`` and ``load_state_dict()`` (a model, an optimizer, a
        scheduler, a grad scaler) or dicts (updated in place), in the same order on every rank.
        Members compare fingerprints first; only those whose state differs receive it, and only
        the objects that differ: nothing but the fingerprints moves when all agree. Collective.

        What a peer sends is loaded with the safe loader (``SafeSerializer``): what models,
        optimizers, schedulers and grad scalers hold (tensors, numbers, strings, dicts, lists, a
        state dict's OrderedDict) loads; code never runs, whoever sent it. ``allow``: classes of
        your own that the state holds (as ``SafeSerializer(allow=...)``). A state that a rank
        can't load fails the call on every rank.
        """
        comm = front_door(self)
        sync_state(comm, objects, allow)

    def snapshot(self, *objects: Any, every: int = 1) -> None:
        """Keep this rank's part of ``objects`` (as ``sync_state``'s: a model, an optimizer, a
        ``progress`` dict) at this step, in host memory here and, sent in the background over a
        group of its own, on the next rank: a job whose mesh has no whole replica left after a
        loss (plain FSDP) then goes back to the newest step every rank's copy is held for, instead
        of ending; ``shrink()`` waits for the replacement and ``sync_state`` restores it.

        Collective: every member calls it, after each step (it waits for the previous copy to be
        sent). ``every``: take one at every ``every``-th call only (a restore then goes back up to
        ``2 * every`` steps). A communicator without ``device_mesh()`` keeps none: every rank holds
        the whole state, and ``sync_state`` hands it over.
        """
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"snapshot: every must be an int >= 1, got {every!r}")
        comm = front_door(self)
        comm._check_usable()
        from .snapshots import snapshots_of

        held = snapshots_of(comm)
        if held is not None:
            held.take(comm, objects, every)

    def check_identical(self, *objects: Any) -> None:
        """Raise CollectiveMismatchError on every rank when the members' states differ, naming the
        ranks whose state differs from ``sync_state``'s source and the first key that does.
        ``objects`` as for ``sync_state``. It moves a fingerprint per object and rank (and the
        keys', once they differ): cheap enough to run every few steps. Collective."""
        comm = front_door(self)
        check_identical(comm, objects)
