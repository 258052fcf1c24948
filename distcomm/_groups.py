"""Sub-communicators and machines: split, new_group, create_local_groups. Every rank tells the
others what it asked for in one exchange, so that ranks that ask for different groups raise the
same error instead of creating process groups that never meet."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._agreement import odd_ones
from ._calls import CallSpec, Op
from ._errors import CollectiveMismatchError

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["dup", "regroup_machines", "split", "sub_settings"]


def split(comm: Communicator, color: int | None, key: int, members: tuple[int, ...] | None,
          timeout: float | None, label: str | None = None) -> Communicator | None:
    """This rank's communicator of the ranks with its ``color`` (None: none), ordered by ``key``
    (then by rank); ``members``: new_group's (and dup's) ranks, which every rank must pass alike.
    ``label``: the public call, for errors (default: split, or new_group where ``members`` is given)."""
    asked = (color, key, members)
    alone = comm._returns_at_once()
    infos = [asked] if alone else comm._run(CallSpec(Op.SPLIT, -1, asked, timeout))
    label = label or ("new_group" if members is not None else "split")
    if len({repr(a) for _, _, a in infos}) > 1:
        rows = "\n".join(f"  rank {r}: {list(a) if a is not None else 'split'}"
                         for r, (_, _, a) in enumerate(infos))
        raise CollectiveMismatchError(f"{label}: the ranks asked for different groups:\n{rows}", op=label,
                                      ranks=odd_ones([a for _, _, a in infos]))
    ordered = _groups_by_color(infos)
    mine = next((m for m in ordered if comm.rank in m), None)
    sub = comm._make_sub(ordered, mine, timeout)  # set up within the call's timeout
    if sub is not None:
        sub._timeout = comm._timeout  # then waits as long as its parent by default, not as long as set-up took
    for k in [k for k, c in comm._children.items() if c._closed]:  # closed ones are let go
        del comm._children[k]
    if sub is not None:
        comm._children[("sub", comm._seq, id(sub))] = sub
    return sub


def dup(comm: Communicator, timeout: float | None) -> Communicator:
    """A communicator over ``comm``'s ranks, numbered alike, over groups of its own (MPI's
    Comm_dup): new_group over every rank, every rank its own key."""
    sub = split(comm, 0, comm.rank, tuple(range(comm.world_size)), timeout, "dup")
    assert sub is not None  # every rank is a member
    return sub


def _groups_by_color(infos: list[Any]) -> list[list[int]]:
    """Each color's ranks, colors in order, each color's ranks by key, then by rank (MPI's order):
    the new communicators' rank order (a torch transport maps it onto its group's, see
    ``_torch._TorchCommunicator``)."""
    groups: dict[int, list[int]] = {}
    for r, (c, _, _) in enumerate(infos):
        if c is not None:
            groups.setdefault(c, []).append(r)
    return [sorted(groups[c], key=lambda r: (infos[r][1], r)) for c in sorted(groups)]


def sub_settings(comm: Communicator, timeout: float | None) -> dict[str, Any]:
    """The settings a sub-communicator shares with its parent."""
    return {"timeout": timeout, "serializer": comm.serializer, "max_bytes": comm.max_bytes,
            "slot_bytes": comm.slot_bytes, "receive_cuda_on": comm.receive_cuda_on}


def regroup_machines(comm: Communicator, n: int) -> None:
    """create_local_groups: machines of ``n`` ranks each, after every rank agreed on ``n``."""
    if comm.world_size > 1 or not comm._world_of_one_shortcut:  # every rank must regroup alike: compare first
        asked = comm._run(CallSpec(Op.CREATE_LOCAL_GROUPS, -1, n, comm._timeout))
        if len(set(asked)) > 1:
            rows = "\n".join(f"  rank {r}: {a}" for r, a in enumerate(asked))
            raise CollectiveMismatchError(f"create_local_groups: the ranks passed different numbers:\n{rows}",
                                          op="create_local_groups", ranks=odd_ones(asked))
    comm._set_machines([list(range(m, m + n)) for m in range(0, comm.world_size, n)])
    comm._machines_declared = True
