"""``comm.device_mesh()``: torch's ``DeviceMesh`` over a communicator, that follows it across
``shrink()`` and ``admit()``, so that FSDP (``fully_shard(model, mesh=...)``) is built once.

FSDP holds the process groups of the mesh it was given, so the mesh's groups can't be replaced:
each dimension's group of this rank is a ``FollowingGroup``, a torch group that forwards every
call to that dimension's group of the communicator's current membership. Those are remade (as
``split``s, proven like any group distcomm makes) by every member whenever a membership is made.

The mesh's layout is the job's, by launcher rank: a rank's coordinates never change, so FSDP's
shards stay where they are. With a dimension named "replicate" (or "dp_replicate", as HSDP's),
the slice of the mesh at one replicate coordinate is a *replica*, the unit of failure: a shrink
keeps only the whole replicas, the lost rank's replica peers wait until a replacement makes it
whole, and the members' ``admit()`` lets a replica in only whole.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName

from ._elastic.deferred_free import let_go
from ._errors import CommunicatorStateError
from ._torch_tables import enter, leave

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ._communicator import Communicator
    from ._elastic.snapshots import Snapshots

__all__ = ["ElasticMesh", "FollowingGroup", "MeshLayout", "device_mesh", "no_whole_replica"]

REPLICA_DIM_NAMES = ("replicate", "dp_replicate")
"""A mesh dimension by one of these names counts replicas (HSDP's): each holds the whole model."""


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A mesh's shape over the job's ranks, in launcher-rank (row-major) order."""

    shape: tuple[int, ...]
    names: tuple[str, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def replica_dim(self) -> int | None:
        return next((d for d, name in enumerate(self.names) if name in REPLICA_DIM_NAMES), None)

    def coords(self, job_rank: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(job_rank, self.shape))

    def line(self, dim: int, job_rank: int) -> int:
        """Which of dimension ``dim``'s groups ``job_rank`` is in: its coordinates on the other dimensions."""
        rest = [c for d, c in enumerate(self.coords(job_rank)) if d != dim]
        return int(np.ravel_multi_index(rest, [s for d, s in enumerate(self.shape) if d != dim])) if rest else 0

    def ranks_along(self, dim: int, job_rank: int) -> list[int]:
        """The job ranks of ``job_rank``'s group along dimension ``dim``, in that group's rank order."""
        coords = list(self.coords(job_rank))
        return [int(np.ravel_multi_index([*coords[:dim], c, *coords[dim + 1:]], self.shape))
                for c in range(self.shape[dim])]

    def replica(self, job_rank: int) -> int:
        """The replica ``job_rank`` belongs to (a mesh without a replicate dimension is one replica)."""
        dim = self.replica_dim
        return 0 if dim is None else self.coords(job_rank)[dim]

    def whole(self, job_ranks: Iterable[int]) -> tuple[int, ...]:
        """Those of ``job_ranks`` whose replica is all there."""
        present = set(job_ranks)
        by_replica: dict[int, list[int]] = {}
        for r in range(self.size):
            by_replica.setdefault(self.replica(r), []).append(r)
        return tuple(sorted(r for ranks in by_replica.values() if present.issuperset(ranks) for r in ranks))


class FollowingGroup(dist.ProcessGroup):
    """A torch process group that forwards every call to another one, which can be changed: FSDP
    keeps this one, and it follows the communicator's memberships."""

    def __init__(self, name: str, target: Any) -> None:
        super().__init__(target.rank(), target.size())  # type: ignore[call-arg]
        self._name = GroupName(name)
        self._target = target

    def follow(self, target: Any) -> None:
        self._target = target

    @property
    def target(self) -> Any:
        """The group it forwards to now."""
        return self._target

    def rank(self) -> int:
        return int(self._target.rank())

    def size(self) -> int:
        return int(self._target.size())

    @property
    def group_name(self) -> GroupName:
        return self._name

    def getBackendName(self) -> str:
        return str(dist.get_backend(self._target))

    def shutdown(self) -> None:
        """Torch shuts down every group it knows when a default group is destroyed (a shrink
        destroys the broken membership's); this one outlives memberships."""

    def __repr__(self) -> str:
        return f"FollowingGroup({self._name!r}, rank={self.rank()}, size={self.size()})"


_FORWARDED = (
    "allreduce", "allreduce_coalesced", "allgather", "allgather_coalesced", "all_gather_single",
    "all_gather_single_coalesced", "_allgather_base", "allgather_into_tensor_coalesced", "broadcast", "reduce",
    "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced", "_reduce_scatter_base",
    "reduce_scatter_tensor_coalesced", "alltoall", "all_to_all_single", "alltoall_base", "barrier", "send", "recv",
    "recv_anysource", "gather", "scatter", "monitored_barrier",
)


def _forwarder(name: str) -> Any:
    def forward(self: FollowingGroup, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self._target, NotJoinedGroup):  # (a collective before a replacement's first call)
            self._target.join()
            if isinstance(self._target, NotJoinedGroup):
                raise _joining_elsewhere()
        return getattr(self._target, name)(*args, **kwargs)
    forward.__name__ = name
    return forward


for _name in _FORWARDED:
    setattr(FollowingGroup, _name, _forwarder(_name))

_NAMES = itertools.count()


class ElasticMesh:
    """The mesh a job's communicators share: its layout, torch's ``DeviceMesh`` and the groups it follows."""

    def __init__(self, layout: MeshLayout, device_type: str, targets: Sequence[Any]) -> None:
        """The mesh over ``targets``, this rank's group along each dimension (``over``, ``before_join``)."""
        self.layout = layout
        self.snapshots: Snapshots | None = None
        """This rank's snapshots of its shards and its predecessor's (``comm.snapshot``)."""
        self._not_joined: list[NotJoinedGroup] = []
        serial = next(_NAMES)
        self.groups = [FollowingGroup(f"distcomm-mesh-{serial}-{layout.names[d]}", target)
                       for d, target in enumerate(targets)]
        self._register(targets)
        from torch.distributed.device_mesh import DeviceMesh

        ranks = torch.arange(layout.size, dtype=torch.int).reshape(layout.shape)  # (global ranks: the job is whole)
        groups: list[dist.ProcessGroup] = list(self.groups)
        self.torch_mesh: DeviceMesh = DeviceMesh.from_group(
            groups if len(groups) > 1 else groups[0], device_type,
            mesh=ranks if len(self.groups) > 1 else ranks.flatten().tolist(), mesh_dim_names=layout.names)

    @classmethod
    def over(cls, comm: Communicator, layout: MeshLayout) -> ElasticMesh:
        """The mesh over the groups of ``comm``'s members (a collective of theirs)."""
        return cls(layout, comm.device.type, _lines(comm, layout))

    @classmethod
    def before_join(cls, comm: Communicator, layout: MeshLayout, job_rank: int,
                    join: Callable[[], None]) -> ElasticMesh:
        """A replacement's mesh before it joins (``_launching.joining``): FSDP is built over it off
        the members' path, as it is built in a torch script, after ``from_env()``. Its groups (and,
        meanwhile, torch's default group) know their ranks and sizes in the whole job, which a
        replacement is let into; their first collective (or the process's first call) joins."""
        world = NotJoinedWorld(job_rank, layout.size, join)
        dist.distributed_c10d._update_default_pg(world)  # (DeviceMesh reads this rank's from it)
        enter(world, GroupName("distcomm-not-joined-world"), range(layout.size), comm.backend, "")
        targets = []
        for dim in range(len(layout.shape)):
            group = NotJoinedGroup(layout.coords(job_rank)[dim], layout.shape[dim], join)
            enter(group, GroupName(f"distcomm-not-joined-{next(_NAMES)}"), layout.ranks_along(dim, job_rank),
                  comm.backend, "")
            targets.append(group)
        mesh = cls(layout, comm.device.type, targets)
        mesh._not_joined = [world, *targets]
        return mesh

    def drop_stand_ins(self) -> None:
        """Take a replacement's stand-ins (``before_join``) out of torch's tables, as it joins (torch's
        default group is then the membership's, and ``follow`` enters the mesh's groups again over
        the membership's) or is closed unjoined."""
        if not self._not_joined:  # (dropped already: a failed join's communicator, closed)
            return
        world = dist.distributed_c10d._world
        for group in [*self._not_joined, *self.groups]:
            name = world.pg_names.get(group)
            if name is not None:  # (else gone already: the script destroyed torch's default group)
                leave(group, name)
        if world.default_pg is self._not_joined[0]:
            dist.distributed_c10d._update_default_pg(None)
        self._not_joined = []

    def follow(self, comm: Communicator) -> None:
        """Point the mesh's groups at ``comm``'s (a collective of its members: every one of them
        that holds the mesh calls it as its membership is made, a newcomer in its ``device_mesh()``)."""
        targets = _lines(comm, self.layout)
        old = [group.target for group in self.groups]
        for group, target in zip(self.groups, targets, strict=True):
            group.follow(target)
        self._register(targets)
        let_go(old)  # (the last membership's, closed: torn down off this path)

    def unrestorable(self, lost: Sequence[int]) -> str:
        """Why this rank's snapshots can't bring back the job ranks ``lost`` ("" where they can)."""
        if self.snapshots is None:
            return "no snapshot was taken (comm.snapshot after each step)"
        return self.snapshots.unrestorable(tuple(lost))

    def _register(self, targets: Sequence[Any]) -> None:
        """Tell torch about the groups (a destroyed default group took every group torch knew)."""
        c10d = dist.distributed_c10d
        for group, target in zip(self.groups, targets, strict=True):
            enter(group, group.group_name, dist.get_process_group_ranks(target), c10d._world.pg_map[target][0],
                  c10d._world.pg_backend_config.get(target, ""))


def _lines(comm: Communicator, layout: MeshLayout) -> list[Any]:
    """This rank's torch group along each dimension, of ``comm``'s members (made on every member
    in the same order, each line's ranks in its order: the job ranks', which the layout orders)."""
    job_ranks = comm.membership.job_ranks
    groups = []
    try:
        for dim in range(len(layout.shape)):
            lines: dict[int, list[int]] = {}
            for r, job_rank in enumerate(job_ranks):
                lines.setdefault(layout.line(dim, job_rank), []).append(r)
            groups.append(comm._group_in([lines[k] for k in sorted(lines)]))
    except BaseException:
        groups.clear()  # (the error's traceback keeps this frame: the groups go with their communicator)
        raise
    return groups


class NotJoinedGroup(dist.ProcessGroup):
    """Where a mesh group of a replacement points before it joins: its rank and size in the whole
    job; ``join`` (the process's first call) makes the membership, and the mesh then follows it."""

    def __init__(self, rank: int, size: int, join: Callable[[], None]) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]
        self._rank, self._size, self.join = rank, size, join

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


class NotJoinedWorld(NotJoinedGroup):
    """A replacement's stand-in for torch's default group until it joins: a collective on it (a
    ``dist.barrier()``) joins first, then runs on the membership's default group."""


def _joined_forwarder(name: str) -> Any:
    def forward(self: NotJoinedWorld, *args: Any, **kwargs: Any) -> Any:
        self.join()
        world = dist.distributed_c10d._world.default_pg
        if world is None or isinstance(world, NotJoinedGroup):
            raise _joining_elsewhere()
        return getattr(world, name)(*args, **kwargs)
    forward.__name__ = name
    return forward


for _name in _FORWARDED:
    setattr(NotJoinedWorld, _name, _joined_forwarder(_name))


def _joining_elsewhere() -> CommunicatorStateError:
    return CommunicatorStateError("a collective on a replacement's group while another thread joins the job: "
                                  "join first (its first call), then use its groups from other threads")


def no_whole_replica(layout: MeshLayout, lost: Sequence[int], why: str) -> CommunicatorStateError:
    """What every survivor's ``shrink()`` raises where no replica of the job's mesh is whole and the
    lost ranks' shards can't be brought back (``why``: ``ElasticMesh.unrestorable``): every transport's."""
    return CommunicatorStateError(
        f"shrink: lost job rank(s) {list(lost)}, and no replica of the job's mesh {layout.shape} {layout.names} "
        f"is whole: the model's shards are gone with them ({why}), and the job can't go on; start it again "
        f"from a checkpoint")


def device_mesh(comm: Communicator, mesh_shape: Sequence[int], mesh_dim_names: Sequence[str] | None) -> DeviceMesh:
    """``Communicator.device_mesh``."""
    from ._launching.joining import join_now, not_joined

    if comm._is_sub:  # (refused alike on every rank, before anything moves)
        raise CommunicatorStateError("device_mesh lays out the job's ranks: call it on the job's communicator "
                                     "(from_env, launch, spawn), not on one split from it")
    waits_as = not_joined(comm)
    if waits_as is None:
        comm._check_usable()
    held = comm._mesh
    job = waits_as[1] if waits_as is not None else held.layout.size if held is not None else comm.world_size
    layout = _layout(mesh_shape, mesh_dim_names, job)
    if held is not None:
        if held.layout != layout:
            raise ValueError(f"device_mesh{layout.shape}: this job's communicator already has a mesh of shape "
                             f"{held.layout.shape} {held.layout.names}; one mesh per job")
        return held.torch_mesh
    if waits_as is not None:  # (a replacement: its model is built over the mesh before it joins)
        mesh = ElasticMesh.before_join(comm, layout, waits_as[0], lambda: join_now(comm))
        comm.__dict__["_mesh"] = mesh
        return mesh.torch_mesh
    if comm.group is None:
        raise CommunicatorStateError(f"device_mesh needs torch process groups; this {type(comm).__name__} has none")
    if comm.membership.job_ranks != tuple(range(layout.size)):
        raise CommunicatorStateError(
            f"device_mesh: make the mesh while the job is whole (every one of its {layout.size} ranks a member; "
            f"this membership is {list(comm.membership.job_ranks)}): it follows shrinks and admits from there")
    comm._mesh = ElasticMesh.over(comm, layout)
    return comm._mesh.torch_mesh


def _layout(mesh_shape: Sequence[int], mesh_dim_names: Sequence[str] | None, job: int) -> MeshLayout:
    shape = tuple(mesh_shape)
    if not shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"device_mesh: mesh_shape must be positive ints, got {mesh_shape!r}")
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else tuple(f"dim{d}" for d in range(len(shape)))
    if len(names) != len(shape) or len(set(names)) != len(names) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"device_mesh: mesh_dim_names must be {len(shape)} distinct strings, got {mesh_dim_names!r}")
    if math.prod(shape) != job:
        raise ValueError(f"device_mesh: a mesh of shape {shape} has {math.prod(shape)} ranks; this job has {job}")
    return MeshLayout(shape, names)
