"""The whole training state on every member: ``sync_state`` hands it to those whose state differs
(a newcomer, a rank that applied half a failed step), ``check_identical`` says who differs and where.

Both compare small fingerprints first, so that a call where every member agrees (after most
shrinks, and every N steps of a healthy job) moves a few bytes per object and rank: the state
itself goes only to the members that need it, one point-to-point copy each.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._errors import CollectiveMismatchError, CommunicatorStateError, SerializationError, is_rank_loss
from ._wire.serialization import AuthenticatedSerializer, SafeSerializer, Serializer, serializing_with

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["check_identical", "sync_state"]

_DIGEST_BYTES = 16
_STATE_TAG = 0x3FFF_5A7E  # (tags are below 2**30)


def sync_state(comm: Communicator, objects: tuple[Any, ...], allow: Iterable[Any] = ()) -> None:
    """``Communicator.sync_state``: every member ends with the state of the first member that holds
    the job's trained state; only members whose state differs receive it (only the objects that differ).

    What peers send is loaded with the safe loader (and the classes in ``allow``): state is
    tensors and plain values, so even a member can send wrong numbers, never code."""
    with serializing_with(_state_serializer(comm, allow)):
        states, digests, src = _fingerprints(comm, objects, "sync_state")
        needed = {r: [i for i, d in enumerate(digests[r]) if d != digests[src][i]] for r in range(comm.world_size)}
        if not any(needed.values()):
            comm._holds_state = True
            return
        failure = _hand_over(comm, objects, states, src, needed)
        said = comm.all_gather(failure)  # (the sender too learns that a load failed: no rank goes on alone)
    failed = [(r, text) for r, text in enumerate(said) if text is not None]
    if not failed:
        comm._holds_state = True  # (every member now holds the state of one that held it)
    else:
        r, text = failed[0]
        raise SerializationError(f"sync_state: rank(s) {[r for r, _ in failed]} could not load the state rank {src} "
                                 f"sent; rank {r}: {text}", op="sync_state", ranks=[r for r, _ in failed])


_STATE_SERIALIZER = SafeSerializer()


def _state_serializer(comm: Communicator, allow: Iterable[Any]) -> Serializer:
    """What moves state, whatever serializer the communicator has: plain pickle out, the safe loader
    (with ``allow``) in; behind the communicator's authentication where it has one."""
    safe = SafeSerializer(allow) if allow else _STATE_SERIALIZER
    chosen = comm.serializer
    return chosen.around(safe) if isinstance(chosen, AuthenticatedSerializer) else safe


def _hand_over(comm: Communicator, objects: tuple[Any, ...], states: list[Any], src: int,
               needed: dict[int, list[int]]) -> str | None:
    """Send the objects each rank needs from ``src`` (one copy per rank, all on their way at once),
    and load them where they arrive; why this rank couldn't load its own, or None."""
    if comm.rank == src:
        sends = [comm.isend([states[i] for i in which], r, tag=_STATE_TAG) for r, which in needed.items() if which]
        for sent in sends:
            sent.wait()
    elif needed[comm.rank]:
        try:
            for i, state in zip(needed[comm.rank], comm.recv(src, tag=_STATE_TAG), strict=True):
                _load(objects[i], state)
        except (SerializationError, ValueError, TypeError, KeyError, RuntimeError) as e:
            if is_rank_loss(e):
                raise
            return f"{type(e).__name__}: {e}"
    return None


def check_identical(comm: Communicator, objects: tuple[Any, ...]) -> None:
    """``Communicator.check_identical``: raise CollectiveMismatchError on every rank, naming the
    ranks whose state differs from the first member's (``sync_state``'s source) and the first key
    that differs. Fingerprints and keys are loaded with the safe loader, as ``sync_state``'s."""
    with serializing_with(_state_serializer(comm, ())):
        states, digests, src = _fingerprints(comm, objects, "check_identical")
        differ = [r for r in range(comm.world_size) if digests[r] != digests[src]]
        if not differ:
            return
        keyed = [[(key, _leaf_digest(leaf)) for key, leaf in _leaves(state)] for state in states]
        tables = comm.all_gather(keyed if comm.rank in (src, *differ) else None)  # (only when they differ)
    names = [type(obj).__name__ for obj in objects]
    raise CollectiveMismatchError(_where_they_differ(tables, src, differ, names), op="check_identical", ranks=differ)


def _fingerprints(comm: Communicator, objects: tuple[Any, ...],
                  op: str) -> tuple[list[Any], list[list[bytes]], int]:
    """This rank's states (each object's ``state_dict()``, or the dict itself), every rank's
    fingerprints of theirs, and the source: the first rank that holds the job's trained state (not
    a newcomer not yet handed it, through any shrink, admit or split since). Objects that are
    neither, counts that differ, and no rank holding the state are refused on every rank alike:
    one rank's mistake doesn't leave the others waiting, and no newcomer's fresh state is taken."""
    bad = [f"object {i} is a {type(obj).__name__}" for i, obj in enumerate(objects)
           if not (_stateful(obj) or isinstance(obj, dict))]
    states = [] if bad else [obj.state_dict() if _stateful(obj) else obj for obj in objects]
    gathered = comm.all_gather((op, bad, [_digest(_leaves(state)) for state in states], comm._holds_state))
    holders = [r for r, (*_, holds) in enumerate(gathered) if holds]
    gathered = [(o, b, d) for o, b, d, _ in gathered]
    ops = [o for o, _, _ in gathered]  # both run on all_gather: one rank's sync_state beside another's
    if len(set(ops)) > 1:  # check_identical would otherwise meet as one call, then wait in different ones
        calls = ", ".join(f"rank {r} {o}" for r, o in enumerate(ops))
        raise CollectiveMismatchError(f"{op}: the ranks called different state calls: {calls}", op=op,
                                      ranks=[r for r, o in enumerate(ops) if o != ops[0]])
    gathered = [(b, d) for _, b, d in gathered]
    refused = [f"rank {r}: {', '.join(b)}" for r, (b, _) in enumerate(gathered) if b]
    if refused:
        raise TypeError(f"{op} takes objects with state_dict() and load_state_dict() (a model, an optimizer, a "
                        f"scheduler, a grad scaler) or dicts; {'; '.join(refused)}")
    counts = [len(d) for _, d in gathered]
    if len(set(counts)) > 1:
        raise CollectiveMismatchError(f"{op}: ranks gave different numbers of state objects: {counts} (by rank)",
                                      op=op, ranks=[r for r, n in enumerate(counts) if n != counts[0]])
    if not holders:
        raise CommunicatorStateError(
            f"{op}: no member holds the job's trained state: every rank that held it was lost, and the members "
            f"left are newcomers not yet handed it; start again from a checkpoint")
    return states, [d for _, d in gathered], holders[0]


def _stateful(obj: Any) -> bool:
    return hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")


def _load(obj: Any, state: Any) -> None:
    if not _stateful(obj):  # a dict
        obj.clear()
        obj.update(state)
    else:
        obj.load_state_dict(state)


def _leaves(state: Any, key: str = "") -> Iterator[tuple[str, Any]]:
    """``state``'s leaves with their dotted keys, in the order the state keeps them."""
    if isinstance(state, Mapping):
        for k, v in state.items():
            yield from _leaves(v, f"{key}.{k}" if key else str(k))
    elif isinstance(state, (list, tuple)):
        for i, v in enumerate(state):
            yield from _leaves(v, f"{key}.{i}" if key else str(i))
    else:
        yield key, state


def _leaf_digest(leaf: Any) -> bytes:
    """A leaf's fingerprint: a tensor's or an array's dtype, shape and bytes; a plain value's repr;
    anything else's pickle (a repr may be cut short, as numpy's, or carry an address)."""
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    if isinstance(leaf, torch.Tensor):
        t = leaf.detach()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(leaf, np.ndarray):
        h.update(f"{leaf.dtype}{leaf.shape}".encode())
        h.update(np.ascontiguousarray(leaf).view(np.uint8).data)
    elif leaf is None or isinstance(leaf, (bool, int, float, complex, str, bytes)):
        h.update(f"{type(leaf).__name__}:{leaf!r}".encode())
    else:
        try:
            h.update(pickle.dumps(leaf, protocol=4))
        except Exception:  # (not picklable: what it says of itself)
            h.update(f"{type(leaf).__name__}:{leaf!r}".encode())
    return h.digest()


def _digest(leaves: Any) -> bytes:
    h = hashlib.blake2b(digest_size=_DIGEST_BYTES)
    for key, leaf in leaves:
        h.update(key.encode())
        h.update(_leaf_digest(leaf))
    return h.digest()


def _where_they_differ(tables: list[Any], src: int, differ: list[int], names: list[str]) -> str:
    """Which ranks differ from rank ``src``, and the first key (in its order) where one of them does."""
    head = f"check_identical: the state of rank(s) {differ} differs from rank {src}'s"
    for i, mine in enumerate(tables[src]):
        theirs = [dict(tables[r][i]) for r in differ]
        for key, digest in mine:
            odd = [r for r, t in zip(differ, theirs, strict=True) if t.get(key) != digest]
            if odd:
                return f"{head}; first at object {i} ({names[i]}), key {key!r} (rank(s) {odd})"
        extra = sorted({k for t in theirs for k in t} - {k for k, _ in mine})
        if extra:
            return f"{head}; first at object {i} ({names[i]}), key {extra[0]!r}, which rank {src} lacks"
    return head
