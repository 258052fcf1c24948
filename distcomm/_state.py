"""The whole training state on every member: ``sync_state`` hands it to those whose state differs
(a newcomer, a rank that applied half a failed step), ``check_identical`` says who differs and where.

A state has two parts: what every rank of the job holds alike (its *replicated* part: the structure,
plain values, plain tensors, param_groups, step counters), compared across every rank against the
job's first holder's, and the DTensors' shards, compared only within their shard class
(``_sharded``: all of them, for plain state) against the class's source's. A call where every member
agrees (after most shrinks, and every N steps of a healthy job) moves small
fingerprints only; a newcomer needs none, it gets everything. The state itself goes only to the
members that need it, one point-to-point copy each (``_state_copy``), striped over the members that
hold it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

from ._calls import CallSpec, Op
from ._elastic.restore import catalogue, restore
from ._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CommunicatorStateError,
    SerializationError,
)
from ._fingerprint import entries, fingerprints, path_text, shown
from ._sharded import class_key, settle
from ._state_copy import receive_state, send_state, state_tensors
from ._wire.serialization import AuthenticatedSerializer, SafeSerializer, Serializer, serializing_with

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["check_identical", "sync_state"]

_R = TypeVar("_R")

def sync_state(comm: Communicator, objects: tuple[Any, ...], allow: Iterable[Any] = ()) -> None:
    """``Communicator.sync_state``: every member ends with the state of its shard class's source
    (its first holder of the job's trained state whose replicated part is the job's first
    holder's: ``_planned``); only members whose state differs receive it
    (only the objects that differ), each from one member that holds it, striped over those.

    What peers send is loaded with the safe loader (and the classes in ``allow``): state is
    tensors and plain values, so even a member can send wrong numbers, never code."""
    settle(objects)
    with serializing_with(_state_serializer(comm, allow)):
        states, survey = _survey(comm, objects, Op.SYNC_STATE, digests=False)
        if any(c is not None for c in survey.catalogues):  # (a job with no whole replica: back to a snapshot)
            failure = restore(comm, objects, states, survey.catalogues, _load, allow)
            plan: dict[int, tuple[int, list[int]]] = {}
        else:
            plan = _plan(comm, objects, states, survey)
            if not plan:
                comm._holds_state = True
                return
            failure = _hand_over(comm, objects, states, plan)
        said = _exchange(comm, Op.SYNC_STATE, failure)  # (the sender too learns that a load failed)
    failed = [(r, text) for r, text in enumerate(said) if text is not None]
    if not failed:
        comm._holds_state = True  # (every member now holds the state of one that held it)
    else:
        r, text = failed[0]
        src = plan[r][0] if r in plan else r
        raise SerializationError(f"sync_state: rank(s) {[r for r, _ in failed]} could not send or load the state "
                                 f"rank {src} holds; rank {r}: {text}", op="sync_state", ranks=[r for r, _ in failed])


_STATE_SERIALIZER = SafeSerializer()


def _state_serializer(comm: Communicator, allow: Iterable[Any]) -> Serializer:
    """What moves state, whatever serializer the communicator has: plain pickle out, the safe loader
    (with ``allow``) in; behind the communicator's authentication where it has one."""
    safe = SafeSerializer(allow) if allow else _STATE_SERIALIZER
    chosen = comm.serializer
    return chosen.around(safe) if isinstance(chosen, AuthenticatedSerializer) else safe


def _plan(comm: Communicator, objects: tuple[Any, ...], states: list[Any],
          survey: _Survey) -> dict[int, tuple[int, list[int]]]:
    """Who receives which objects from whom (``_planned``). Where the job has more than one holder
    they fingerprint their state first (a second small exchange): the replicated part always (it is
    compared across the whole job), the shards only where their class has another holder; a lone
    holder (a newcomer's job of two) copies without hashing anything."""
    digests: list[Any] = [None] * comm.world_size
    if sum(survey.holds) > 1:
        mine_ = next(ranks for ranks in survey.classes if comm.rank in ranks)
        several = sum(survey.holds[r] for r in mine_) > 1  # (else no one compares this rank's shards)
        mine = _read(lambda: [fingerprints(s, several) for s in states]) if comm._holds_state else None
        said = _exchange(comm, Op.SYNC_STATE, mine)
        _refuse_unread(Op.SYNC_STATE.label, said)
        digests = [d if isinstance(d, list) else None for d in said]
    return _planned(survey, digests, len(objects))


def _planned(survey: _Survey, digests: list[Any], n: int) -> dict[int, tuple[int, list[int]]]:
    """In each shard class, its *source*: its first holder whose replicated part is the job's
    source's (the first holder's); every other rank gets the objects whose replicated part differs
    from the job's source's or whose shards differ from its class source's (a newcomer: all of
    them). Receivers are striped over the class's holders that need nothing.

    A class where no holder has the job's replicated part is refused (CollectiveMismatchError, alike
    on every rank): its shards belong with its own replicated part (a step counter a step ahead
    comes with shards a step ahead), so the job's replicated part beside them would be a state no
    rank ever held."""
    ref = _part(digests[survey.holds.index(True)], 0)
    plan: dict[int, tuple[int, list[int]]] = {}
    for ranks in survey.classes:
        holders = [r for r in ranks if survey.holds[r]]
        right = [r for r in holders if _part(digests[r], 0) == ref]
        if not right:
            first = survey.holds.index(True)
            raise CollectiveMismatchError(
                f"sync_state: no rank among {ranks}, which hold the same shards, holds the job's replicated state "
                f"(what is not DTensor shards: step counters, param_groups) as rank {first} does; their "
                f"shards may be of another step: check_identical says where they differ; start again from a "
                f"checkpoint", op="sync_state", ranks=ranks)
        src, shards = right[0], _part(digests[right[0]], 1) or [None] * n
        need = {r: list(range(n)) if not survey.holds[r] or ref is None else
                [i for i, (rep, shard) in enumerate(digests[r]) if rep != ref[i] or shard != shards[i]]
                for r in ranks if r != src}
        sources = [src, *(r for r in holders if r != src and not need[r])]
        for k, r in enumerate(r for r in ranks if need.get(r)):
            plan[r] = (sources[k % len(sources)], need[r])
    return plan


def _part(digests: Any, k: int) -> list[Any] | None:
    return None if digests is None else [d[k] for d in digests]


def _hand_over(comm: Communicator, objects: tuple[Any, ...], states: list[Any],
               plan: dict[int, tuple[int, list[int]]]) -> str | None:
    """Send the objects each rank needs from this one (all on their way at once), and load them
    where they arrive; why this rank couldn't send or load its own, or None."""
    raw = comm._moves_bytes
    mine = {r: which for r, (src, which) in plan.items() if src == comm.rank}
    if mine:
        return send_state(comm, states, mine, raw)
    if comm.rank not in plan:
        return None
    src, which = plan[comm.rank]
    return receive_state(comm, objects, states, src, which, raw, _load)


def check_identical(comm: Communicator, objects: tuple[Any, ...]) -> None:
    """``Communicator.check_identical``: raise CollectiveMismatchError on every rank, naming the
    ranks whose state differs from ``sync_state``'s source's (``_odd``) and the first key that
    differs. Fingerprints and keys are loaded with the safe loader, as ``sync_state``'s."""
    with serializing_with(_state_serializer(comm, ())):
        states, survey = _survey(comm, objects, Op.CHECK_IDENTICAL, digests=True)
        odd = _odd(survey)
        if not odd:
            return
        keyed = [[(path_text(path), shown(path), rep, shard) for path, rep, shard in entries(state)]
                 for state in states]
        told = {r for src, differ, _ in odd for r in (src, *differ)}
        tables = _exchange(comm, Op.CHECK_IDENTICAL, keyed if comm.rank in told else None)
    names = [type(obj).__name__ for obj in objects]
    ranks = sorted({r for _, differ, _ in odd for r in differ})
    said = [_where_they_differ(_projected(tables, k), src, differ, names) for src, differ, k in odd]
    text = "; and ".join([said[0], *(s.removeprefix("check_identical: ") for s in said[1:])])
    raise CollectiveMismatchError(text, op="check_identical", ranks=ranks)


def _odd(survey: _Survey) -> list[tuple[int, list[int], int]]:
    """Who differs from whom, in which part (0: replicated, 1: sharded): the ranks whose replicated
    part differs from the job's first holder's (across every class), then in each class the ranks
    whose shards differ from its source's (its first holder with the job's replicated part)."""
    digests = survey.digests
    first = survey.holds.index(True)
    rep = [_part(d, 0) for d in digests]
    differ = [r for r in range(len(digests)) if rep[r] != rep[first]]
    odd = [(first, differ, 0)] if differ else []
    for ranks in survey.classes:
        holders = [r for r in ranks if survey.holds[r]]
        src = next((r for r in holders if r not in differ), holders[0])
        shards = [r for r in ranks if _part(digests[r], 1) != _part(digests[src], 1)]
        odd += [(src, shards, 1)] if shards else []
    return odd


def _projected(tables: list[Any], k: int) -> list[Any]:
    """Each rank's table with one part's digest (0: replicated, 1: the shards', DTensors only)."""
    return [t if t is None else [[(text, path, e[k]) for text, path, *e in entries_ if e[k] is not None]
                                 for entries_ in t] for t in tables]


class _Survey(NamedTuple):
    holds: list[bool]
    """Which ranks hold the job's trained state."""
    classes: list[list[int]]
    """The ranks of each shard class (``_sharded``), in rank order; every class has a holder."""
    digests: list[list[tuple[bytes, bytes | None]]]
    """Every rank's fingerprints (each object's replicated and sharded parts) (where asked for; else empty)."""
    catalogues: list[Any]
    """Every rank's snapshots where a shrink left the job to restore from them (``_elastic.restore``)."""


def _survey(comm: Communicator, objects: tuple[Any, ...], op: Op, digests: bool) -> tuple[list[Any], _Survey]:
    """This rank's states (each object's ``state_dict()``, or the dict itself), and what every rank
    said of its own: whether it holds the job's trained state (not a newcomer not yet handed it,
    through any shrink, admit or split since), its shard class, its fingerprints (``digests``).
    Objects that are neither, a state that can't be read, counts that differ, and a class where no
    rank holds the state are refused on every rank alike: one rank's mistake doesn't leave the
    others waiting, and no newcomer's fresh state is taken."""
    comm._check_usable()
    bad = [f"object {i} is a {type(obj).__name__}" for i, obj in enumerate(objects)
           if not (_stateful(obj) or isinstance(obj, dict))]
    read: Any = None if bad else _read(lambda: _read_state(objects, digests))
    states, key, mine = read if isinstance(read, tuple) else ([], b"", [])
    gathered = _exchange(comm, op, (bad, read if isinstance(read, str) else None, len(objects), comm._holds_state,
                                    key, mine, catalogue(comm)))
    label = op.label
    refused = [f"rank {r}: {', '.join(b)}" for r, (b, *_) in enumerate(gathered) if b]
    if refused:
        raise TypeError(f"{label} takes objects with state_dict() and load_state_dict() (a model, an optimizer, a "
                        f"scheduler, a grad scaler) or dicts; {'; '.join(refused)}")
    _refuse_unread(label, [u for _, u, *_ in gathered])
    counts = [n for _, _, n, *_ in gathered]
    if len(set(counts)) > 1:
        raise CollectiveMismatchError(f"{label}: ranks gave different numbers of state objects: {counts} (by rank)",
                                      op=label, ranks=[r for r, n in enumerate(counts) if n != counts[0]])
    holds = [bool(g[3]) for g in gathered]
    classes: dict[bytes, list[int]] = {}
    for r, g in enumerate(gathered):
        classes.setdefault(g[4], []).append(r)
    for ranks in classes.values():
        if not any(holds[r] for r in ranks):
            among = "" if len(classes) == 1 else f" among rank(s) {ranks}, which hold the same shards"
            raise CommunicatorStateError(
                f"{label}: no member holds the job's trained state{among}: every rank that held it was lost, and the "
                f"members left are newcomers not yet handed it; start again from a checkpoint")
    return states, _Survey(holds, list(classes.values()), [g[5] for g in gathered], [g[6] for g in gathered])


def _read_state(objects: tuple[Any, ...],
                digests: bool) -> tuple[list[Any], bytes, list[tuple[bytes, bytes | None]]]:
    states = [obj.state_dict() if _stateful(obj) else obj for obj in objects]
    key = class_key(state_tensors(states, objects))
    return states, key, [fingerprints(state) for state in states] if digests else []


def _read(fn: Callable[[], _R]) -> _R | str:
    """``fn()``, or what it raised as text: a ``state_dict()`` of the user's raises what it likes,
    on this rank alone, and every rank must still meet in the exchange that says so."""
    try:
        return fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _refuse_unread(label: str, unread: list[Any]) -> None:
    failed = [r for r, u in enumerate(unread) if isinstance(u, str)]
    if failed:
        raise CollectiveError(f"{label}: rank(s) {failed} could not read their state; rank {failed[0]}: "
                              f"{unread[failed[0]]}", op=label, ranks=failed)


def _exchange(comm: Communicator, op: Op, obj: Any) -> list[Any]:
    """Every rank's ``obj`` on every rank, as ``op``'s exchange: a rank in another call (another
    state call, an all_gather) meets a CollectiveMismatchError naming both, not this call's bytes."""
    if comm._returns_at_once():
        return [obj]
    return comm._run(CallSpec(op, -1, obj, comm._op_timeout(None)))


def _stateful(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")


def _load(obj: Any, state: Any) -> None:
    if not _stateful(obj):  # a dict
        obj.clear()
        obj.update(state)
    else:
        obj.load_state_dict(state)


def _where_they_differ(tables: list[Any], src: int, differ: list[int], names: list[str]) -> str:
    """Which ranks differ from rank ``src``, and the first key (in its order) where one of them
    does. ``tables``: each rank's entries of each object, as (path's text, path shown, digest)."""
    head = f"check_identical: the state of rank(s) {differ} differs from rank {src}'s"
    for i, mine in enumerate(tables[src]):
        theirs = [{text: digest for text, _, digest in tables[r][i]} for r in differ]
        for text, path, digest in mine:
            odd = [r for r, t in zip(differ, theirs, strict=True) if t.get(text) != digest]
            if odd:
                return f"{head}; first at object {i} ({names[i]}), {_place(path)} (rank(s) {odd})"
        ours = {text for text, _, _ in mine}
        extra = next((path for r in differ for text, path, _ in tables[r][i] if text not in ours), None)
        if extra is not None:
            return f"{head}; first at object {i} ({names[i]}), {_place(extra)}, which rank {src} lacks"
    return head


def _place(path: str) -> str:
    return f"key {path!r}" if path else "its root"
