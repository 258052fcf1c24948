"""The whole training state on every member: ``sync_state`` hands it to those whose state differs
(a newcomer, a rank that applied half a failed step), ``check_identical`` says who differs and where.

Both compare small fingerprints first, so that a call where every member agrees (after most
shrinks, and every N steps of a healthy job) moves a few bytes per object and rank: the state
itself goes only to the members that need it, one point-to-point copy each.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ._calls import CallSpec, Op
from ._errors import (
    CollectiveError,
    CollectiveMismatchError,
    CommunicatorStateError,
    PayloadTooLargeError,
    SerializationError,
    is_rank_loss,
)
from ._fingerprint import entries, fingerprint, path_text, shown
from ._wire.serialization import AuthenticatedSerializer, SafeSerializer, Serializer, serializing_with

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["check_identical", "sync_state"]

_STATE_TAG = 0x3FFF_5A7E  # (tags are below 2**30)


def sync_state(comm: Communicator, objects: tuple[Any, ...], allow: Iterable[Any] = ()) -> None:
    """``Communicator.sync_state``: every member ends with the state of the first member that holds
    the job's trained state; only members whose state differs receive it (only the objects that differ).

    What peers send is loaded with the safe loader (and the classes in ``allow``): state is
    tensors and plain values, so even a member can send wrong numbers, never code."""
    with serializing_with(_state_serializer(comm, allow)):
        states, digests, src = _fingerprints(comm, objects, Op.SYNC_STATE)
        needed = {r: [i for i, d in enumerate(digests[r]) if d != digests[src][i]] for r in range(comm.world_size)}
        if not any(needed.values()):
            comm._holds_state = True
            return
        failure = _hand_over(comm, objects, states, src, needed)
        said = _exchange(comm, Op.SYNC_STATE, failure)  # (the sender too learns that a load failed)
    failed = [(r, text) for r, text in enumerate(said) if text is not None]
    if not failed:
        comm._holds_state = True  # (every member now holds the state of one that held it)
    else:
        r, text = failed[0]
        raise SerializationError(f"sync_state: rank(s) {[r for r, _ in failed]} could not send or load the state "
                                 f"rank {src} holds; rank {r}: {text}", op="sync_state", ranks=[r for r, _ in failed])


_STATE_SERIALIZER = SafeSerializer()


def _state_serializer(comm: Communicator, allow: Iterable[Any]) -> Serializer:
    """What moves state, whatever serializer the communicator has: plain pickle out, the safe loader
    (with ``allow``) in; behind the communicator's authentication where it has one."""
    safe = SafeSerializer(allow) if allow else _STATE_SERIALIZER
    chosen = comm.serializer
    return chosen.around(safe) if isinstance(chosen, AuthenticatedSerializer) else safe


_NOT_SENT = "distcomm: the state was not sent"
"""What the source sends in place of the state it couldn't serialize: the receivers then fail the
call with the others, instead of waiting for a state that never comes."""


def _hand_over(comm: Communicator, objects: tuple[Any, ...], states: list[Any], src: int,
               needed: dict[int, list[int]]) -> str | None:
    """Send the objects each rank needs from ``src`` (one copy per rank, all on their way at once),
    and load them where they arrive; why this rank couldn't send or load its own, or None."""
    if comm.rank == src:
        return _send_state(comm, states, needed)
    if not needed[comm.rank]:
        return None
    try:
        got = comm.recv(src, tag=_STATE_TAG)
        if isinstance(got, tuple) and got[:1] == (_NOT_SENT,):
            return f"rank {src} could not send it: {got[1]}"
        for i, state in zip(needed[comm.rank], got, strict=True):
            _load(objects[i], state)
    except Exception as e:  # (a load_state_dict of the user's: whatever it raises)
        if is_rank_loss(e):
            raise
        return f"{type(e).__name__}: {e}"
    return None


def _send_state(comm: Communicator, states: list[Any], needed: dict[int, list[int]]) -> str | None:
    """The source's part: each rank's objects on their way at once; where they can't be serialized
    (nothing went), why, said to that rank in their place, and returned."""
    sends = {r: comm.isend([states[i] for i in which], r, tag=_STATE_TAG) for r, which in needed.items() if which}
    failure = None
    for r, sent in sends.items():
        try:
            sent.wait()
        except (SerializationError, PayloadTooLargeError) as e:
            failure = failure or str(e)
            comm.isend((_NOT_SENT, str(e)), r, tag=_STATE_TAG).wait()
    return failure


def check_identical(comm: Communicator, objects: tuple[Any, ...]) -> None:
    """``Communicator.check_identical``: raise CollectiveMismatchError on every rank, naming the
    ranks whose state differs from the first member's (``sync_state``'s source) and the first key
    that differs. Fingerprints and keys are loaded with the safe loader, as ``sync_state``'s."""
    with serializing_with(_state_serializer(comm, ())):
        states, digests, src = _fingerprints(comm, objects, Op.CHECK_IDENTICAL)
        differ = [r for r in range(comm.world_size) if digests[r] != digests[src]]
        if not differ:
            return
        keyed = [[(path_text(path), shown(path), digest) for path, digest in entries(state)] for state in states]
        tables = _exchange(comm, Op.CHECK_IDENTICAL, keyed if comm.rank in (src, *differ) else None)
    names = [type(obj).__name__ for obj in objects]
    raise CollectiveMismatchError(_where_they_differ(tables, src, differ, names), op="check_identical", ranks=differ)


def _fingerprints(comm: Communicator, objects: tuple[Any, ...],
                  op: Op) -> tuple[list[Any], list[list[bytes]], int]:
    """This rank's states (each object's ``state_dict()``, or the dict itself), every rank's
    fingerprints of theirs, and the source: the first rank that holds the job's trained state (not
    a newcomer not yet handed it, through any shrink, admit or split since). Objects that are
    neither, a state that can't be read, counts that differ, and no rank holding the state are
    refused on every rank alike: one rank's mistake doesn't leave the others waiting, and no
    newcomer's fresh state is taken."""
    comm._check_usable()
    states: list[Any] = []
    mine: list[bytes] = []
    bad = [f"object {i} is a {type(obj).__name__}" for i, obj in enumerate(objects)
           if not (_stateful(obj) or isinstance(obj, dict))]
    unread: str | None = None
    if not bad:
        try:
            states = [obj.state_dict() if _stateful(obj) else obj for obj in objects]
            mine = [fingerprint(state) for state in states]
        except Exception as e:  # (a state_dict() of the user's: whatever it raises, on this rank alone)
            unread = f"{type(e).__name__}: {e}"
    gathered = _exchange(comm, op, (bad, unread, mine, comm._holds_state))
    label = op.label
    refused = [f"rank {r}: {', '.join(b)}" for r, (b, *_) in enumerate(gathered) if b]
    if refused:
        raise TypeError(f"{label} takes objects with state_dict() and load_state_dict() (a model, an optimizer, a "
                        f"scheduler, a grad scaler) or dicts; {'; '.join(refused)}")
    failed = [r for r, (_, u, *_) in enumerate(gathered) if u]
    if failed:
        raise CollectiveError(f"{label}: rank(s) {failed} could not read their state; rank {failed[0]}: "
                              f"{gathered[failed[0]][1]}", op=label, ranks=failed)
    counts = [len(d) for _, _, d, _ in gathered]
    if len(set(counts)) > 1:
        raise CollectiveMismatchError(f"{label}: ranks gave different numbers of state objects: {counts} (by rank)",
                                      op=label, ranks=[r for r, n in enumerate(counts) if n != counts[0]])
    holders = [r for r, (*_, holds) in enumerate(gathered) if holds]
    if not holders:
        raise CommunicatorStateError(
            f"{label}: no member holds the job's trained state: every rank that held it was lost, and the members "
            f"left are newcomers not yet handed it; start again from a checkpoint")
    return states, [d for _, _, d, _ in gathered], holders[0]


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
