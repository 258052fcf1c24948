"""Sub-communicators and machines: split, new_group, create_local_groups. Every rank tells the
others what it asked for in one exchange, so that ranks that ask for different groups raise the
same error instead of creating process groups that never meet."""

from __future__ import annotations

import datetime
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ._agreement import odd_ones
from ._calls import CallSpec, Op
from ._errors import CollectiveMismatchError
from ._transfer.transport import front_door

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["SubCommunicators", "dup", "regroup_machines", "split", "sub_settings"]


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
        sub._is_sub = True
        sub._timeout = comm._timeout  # then waits as long as its parent by default, not as long as set-up took
        sub._holds_state = comm._holds_state  # (a stage's group: its newcomers are no source of state)
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


class SubCommunicators:
    """The front door's methods that make communicators over some of its ranks (``Communicator``
    inherits them; ``self`` is always one)."""

    def split(self, color: int | None, key: int | None = None, *,
              timeout: float | datetime.timedelta | None = None) -> Communicator | None:
        """A communicator over the ranks that pass the same ``color`` (an int >= 0); None for None.

        Collective: every rank calls it. The new ranks are ordered by ``key`` (default: this
        rank), then by rank here, as MPI's split orders them, whatever the keys' order: the new
        communicator's ``rank`` and every collective's rank numbering (results, roots, scatter's
        parts, tensor rows) follow it. (Its torch ``group`` orders the same processes by global
        rank, as torch does: where the keys don't, ``dist.get_rank(sub.group)`` is not
        ``sub.rank``.) The new communicator is of this communicator's class and settings, over a
        group created now; this communicator owns it and closes it (closing it earlier is fine).
        """
        comm = front_door(self)
        if color is not None and (isinstance(color, bool) or not isinstance(color, int) or color < 0):
            raise ValueError(f"color must be an int >= 0 or None, got {color!r}")
        if key is not None and (isinstance(key, bool) or not isinstance(key, int)):
            raise TypeError(f"key must be an int or None, got {type(key).__name__}")
        comm._check_usable()
        return split(comm, color, comm.rank if key is None else key, None, comm._op_timeout(timeout))

    def dup(self, *, timeout: float | datetime.timedelta | None = None) -> Communicator:
        """A communicator over the same ranks, numbered the same, whose collectives never meet this
        one's (MPI's Comm_dup): process groups of its own, for a library or a background thread
        (a metrics writer beside the training loop) to run collectives of its own, concurrently
        with this communicator's.

        Collective: every rank calls it. Of this communicator's class and settings; this
        communicator owns it and closes it (closing it earlier is fine).
        """
        comm = front_door(self)
        comm._check_usable()
        return dup(comm, comm._op_timeout(timeout))

    def device_mesh(self, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str] | None = None) -> Any:
        """Torch's ``DeviceMesh`` over this job's ranks (the arguments of torch's ``init_device_mesh``;
        the device type follows the backend): ``fully_shard(model, mesh=comm.device_mesh((2, 2),
        ("replicate", "shard")))`` is HSDP.

        The mesh follows the job across ``shrink()`` and ``admit()``: FSDP is built once. Its
        layout is by launcher rank, so a rank's coordinates never change. Where a dimension is
        named "replicate" (or "dp_replicate"), each slice of the mesh along it is a replica, the
        unit of failure: a shrink keeps the whole replicas only (the lost rank's replica peers
        wait in ``shrink()`` until a replacement makes their replica whole, and the members'
        ``admit()`` lets the replica in, whole); a loss that leaves no replica whole is
        ``CommunicatorStateError`` on every survivor, unless every rank's shards are held in a
        neighbour's ``snapshot()`` (then the survivors wait for the replacements, and
        ``sync_state`` takes the job back to that step). Collective: every rank calls it, while the
        job is whole. A replacement's call is not: it returns at once, before the replacement joins
        (so its model is built off the members' path), and the mesh follows the membership it joins.
        One mesh per job.
        """
        from ._mesh import device_mesh  # (imports torch's DeviceMesh: only where a mesh is asked for)

        return device_mesh(front_door(self), mesh_shape, mesh_dim_names)

    def new_group(self, ranks: Sequence[int], *,
                  timeout: float | datetime.timedelta | None = None) -> Communicator | None:
        """A communicator over ``ranks`` (of this communicator), ordered by rank; None off them.

        Collective: every rank of this communicator calls it with the same ranks.
        """
        comm = front_door(self)
        members = _group_members(ranks, comm.world_size)
        comm._check_usable()
        return split(comm, 0 if comm.rank in members else None, comm.rank, tuple(members), comm._op_timeout(timeout))

    def _group_in(self, partition: list[list[int]]) -> Any:
        """The torch group of this rank's part of ``partition`` (ranks, every part in rank order),
        which every rank derives alike from what it already knows (the mesh's lines): a collective.
        Here a split; the torch transports make the groups without asking the others first."""
        color = next(i for i, part in enumerate(partition) if self.rank in part)  # type: ignore[attr-defined]
        sub = front_door(self).split(color)
        assert sub is not None
        return sub.group

    def create_local_groups(self, num_workers_per_machine: int) -> None:
        """Regroup ranks by machine as ``rank // num_workers_per_machine``, for processes started
        without launch() or torchrun, where host names don't tell machines apart.

        Collective: every rank must call it with the same number, which must divide world_size.
        ``local_rank``, ``local_size`` and ``local_group`` then follow the new grouping.
        """
        comm = front_door(self)
        n = num_workers_per_machine
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"num_workers_per_machine must be an int >= 1, got {n!r}")
        if comm.world_size % n:
            raise ValueError(f"num_workers_per_machine={n} does not divide world_size {comm.world_size}")
        comm._check_usable()
        regroup_machines(comm, n)


def _group_members(ranks: Sequence[int], world: int) -> list[int]:
    """new_group's ranks, checked and sorted."""
    if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence):
        raise TypeError(f"ranks must be a sequence of ints, got {type(ranks).__name__}")
    members = []
    for r in ranks:
        if isinstance(r, bool) or not isinstance(r, (int, np.integer)):
            raise TypeError(f"ranks must be ints, got {type(r).__name__}")
        if not 0 <= r < world:
            raise ValueError(f"rank {r} is out of range for world_size {world}")
        members.append(int(r))
    if len(set(members)) != len(members) or not members:
        raise ValueError(f"ranks must be distinct and not empty, got {list(ranks)}")
    return sorted(members)
