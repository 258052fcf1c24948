"""A job with no whole replica left brought back from its snapshots (``snapshots``), in ``sync_state``.

After the shrink that found no replica whole, every survivor and the replacement form one
membership again (``torch_membership``); in the ``sync_state`` that follows, every rank says which
complete copies it has, and all of them go back to the newest step that every rank's shards are
held for: a survivor loads its own copy of that step, a replacement receives the lost rank's from
the rank that held it (raw tensors, into its own, as ``sync_state`` hands any state over). The steps
since are lost: the loop replays them (so its data must depend only on the step and the rank).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from .._errors import CommunicatorStateError
from .._state_copy import load_parts, receive_state, send_parts
from .snapshots import snapshots_of

if TYPE_CHECKING:
    from .._communicator import Communicator

__all__ = ["catalogue", "restore"]

Catalogue = tuple[int, list[int], "int | None", list[int]]
"""A rank's complete copies: its job rank, its own steps, whose copies it holds, and their steps."""


def catalogue(comm: Communicator) -> Catalogue | None:
    """This rank's copies where a shrink left it to restore from them; else None (a replacement,
    or a job that isn't restoring)."""
    held = comm._mesh.snapshots if comm._mesh is not None else None
    if held is None or not held.restoring:
        return None
    return held.catalogue(comm.membership.job_ranks[comm.rank])


def restore(comm: Communicator, objects: tuple[Any, ...], states: list[Any], said: list[Catalogue | None],
            load: Callable[[Any, Any], None], allow: Iterable[Any]) -> str | None:
    """Every rank back to the newest step all of them are held for (``said``: every rank's
    ``catalogue``); why this rank couldn't send or load its part, or None. Where no step is held
    for every rank, CommunicatorStateError on every rank alike. ``allow``: ``sync_state``'s."""
    job = comm.membership.job_ranks
    step, sources = _plan(job, said)
    holders = {c[2]: c[0] for c in said if c is not None and c[2] is not None and step in c[3]}
    held = snapshots_of(comm)
    if held is None:  # (the others wait for this rank's part until their timeout, then fail too)
        raise CommunicatorStateError("sync_state: the job restores its snapshots, and this rank has no mesh to "
                                     "take them into: build the model over comm.device_mesh() before sync_state")
    failure = None
    for r in [r for r, src in sources.items() if src == comm.rank]:  # (the lost predecessor's replacement)
        failure = send_parts(comm, r, *held.held_at(step).parts(allow)) or failure
    if comm.rank in sources:
        failure = receive_state(comm, objects, states, sources[comm.rank], list(range(len(objects))), True,
                                load) or failure
    else:
        failure = load_parts(comm, objects, states, *held.own_at(step).parts(allow), load) or failure
    held.restored(step, holders, objects if comm.rank in sources and failure is None else None)
    return failure


def _plan(job: tuple[int, ...], said: list[Catalogue | None]) -> tuple[int, dict[int, int]]:
    """The step to go back to, and the ranks that receive it (a replacement) with the rank that holds
    their copy; the others load their own."""
    own = {j: set(c[1]) if c is not None else set() for j, c in zip(job, said, strict=True)}
    holding = {c[2]: (r, set(c[3])) for r, c in enumerate(said) if c is not None and c[2] is not None}
    steps = [own[j] | holding.get(j, (-1, set()))[1] for j in job]
    common = set.intersection(*steps)
    if not common:
        missing = [j for j, s in zip(job, steps, strict=True) if not s]
        raise CommunicatorStateError(
            f"sync_state: no snapshot step is held for every rank (none at all for job rank(s) {missing}: their "
            f"copies were lost with them, or none was taken); the job can't go on: start it again from a checkpoint")
    step = max(common)
    return step, {r: holding[j][0] for r, j in enumerate(job) if step not in own[j]}
