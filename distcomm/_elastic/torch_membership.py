"""How a torch communicator leaves a broken membership and enters the next: ``shrink`` and ``admit``,
breaking the waits on its groups (torch's own included), and letting go of the old groups
(held for a timeout: ``deferred_free``)."""

from __future__ import annotations

import dataclasses
import datetime
import os
import threading
import weakref
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist

from .._errors import is_rank_loss
from .._handles import Queues
from .._launching.rendezvous import Seat, rejoin
from .._launching.start import start_seat
from .._mesh import no_whole_replica
from . import membership as _membership
from .deferred_free import DEFERRED
from .keepalive import keep_alive
from .membership import Membership
from .waits import break_groups

if TYPE_CHECKING:
    from .._communicator import Communicator
    from .._torch import _TorchCommunicator

__all__ = ["TorchMembership"]


def _torch_comm(part: object) -> _TorchCommunicator:
    """The torch communicator this part of it belongs to (``_TorchCommunicator`` inherits the class below)."""
    return cast("_TorchCommunicator", part)


class TorchMembership:
    """The membership methods of ``GlooCommunicator`` and ``NcclCommunicator`` (``self`` is always one)."""

    @property
    def membership(self) -> Membership:
        comm = _torch_comm(self)
        job_ranks = tuple(comm._ranks) if comm._job_ranks is None else comm._job_ranks
        return Membership(job_ranks, comm._lost, comm._admitted)

    def shrink(self, *, timeout: float | datetime.timedelta | None = None) -> Communicator:
        comm = _torch_comm(self)
        if os.getpid() != comm._pid:  # (a broken or closed one may shrink: that is what it is for)
            comm._check_usable()
        settings = comm._rebuild_settings()
        pids = _membership.job_pids(comm)
        seconds = comm._op_timeout(timeout)
        seat, lost = _membership.survivors(comm, seconds, pids)
        if comm._mesh is not None:
            kept = _whole_replicas(comm, seat, lost, seconds)
            if kept.epoch != seat.epoch:  # (let in again: that membership lost no one, as its members see it)
                lost = ()
            seat = kept
        return comm._succeeded_by(start_seat(type(comm), seat, lost=lost, pids=pids, **settings), timeout)

    def admit(self, *, timeout: float | datetime.timedelta | None = None) -> Communicator:
        comm = _torch_comm(self)
        comm._check_usable()
        if comm._seat is None:  # a sub-communicator: newcomers join the job's communicator, not this one
            return comm
        seat = _membership.admission(comm, comm._op_timeout(timeout))
        if seat is None:
            return comm
        if comm._mesh is not None and comm._mesh.snapshots is not None:
            comm._mesh.snapshots.settle()  # (its group goes with this membership: the copy in flight ends first)
        settings = comm._rebuild_settings()
        pids = _membership.job_pids(comm)
        with comm._closing_together(off_path=True):
            comm._retire_subs("admit")
            comm.close()
        return comm._succeeded_by(start_seat(type(comm), seat, pids=pids, **settings), timeout)

    def _succeeded_by(self, new: Communicator, timeout: float | datetime.timedelta | None) -> Communicator:
        """``new``, made by this one's shrink or admit, once it took over what this one had."""
        comm = _torch_comm(self)
        comm._successor = new  # use(comm) follows it
        new._launcher = comm._launcher  # (the same processes, started by the same launcher)
        new._holds_state = comm._holds_state  # (and the same state)
        new._mesh = comm._mesh
        if new._mesh is not None:
            members = new.membership.job_ranks
            if new._mesh.layout.whole(members) != members:  # (a rank lost as the membership formed: its
                return new.shrink(timeout=timeout)          # replica's other ranks wait again, the rest go on)
            try:
                new._mesh.follow(new)  # (FSDP's groups: the first collective of the new membership)
            except Exception as e:  # (its own failure: not the one the caller handles)
                if not is_rank_loss(e):  # (torch's own error too: a group's set-up met the loss first)
                    raise
                return new.shrink(timeout=timeout)  # (a rank lost as the membership began)
        return new

    def _rebuild_settings(self) -> dict[str, Any]:
        """What a communicator of a new membership takes over from this one."""
        comm = _torch_comm(self)
        return {"timeout": comm._timeout, "serializer": comm.serializer, "max_bytes": comm.max_bytes,
                "slot_bytes": comm.slot_bytes, "receive_cuda_on": comm.receive_cuda_on,
                "machine": comm._machine_key}  # (as a replacement names its machine: from_env's)

    def _held_groups(self) -> list[Any]:
        """The torch groups this communicator uses (the default one where it owns it: DDP's, when
        the user gave it none)."""
        comm = _torch_comm(self)
        groups = [comm._group, comm._obj_group, comm._local_group, comm._block_group, comm._leader_group,
                  *comm._owned]
        if comm._owns_default and dist.is_initialized():
            groups.append(dist.distributed_c10d._get_default_group())
        return list({id(g): g for g in groups if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER}.values())

    def _break_waits(self, seconds: float | None = None) -> None:
        """Fail every wait in this process on the groups of this communicator and those split from
        it, torch's own included (``_waits.break_groups``): the membership broke (a member lost),
        so none of them can end well. On a thread of its own: the breaking receive of a group that
        connects lazily may first connect to a peer, for as long as the group's timeout where the
        peer is gone. ``seconds``: how long the caller waits for it (None: not at all)."""
        comm = _torch_comm(self)
        groups = comm._groups_to_break()  # (now: once closed, the default group is the next membership's)
        breaking = threading.Thread(target=break_groups, args=(groups,), name="distcomm-break", daemon=True)
        breaking.start()
        if seconds is not None:
            breaking.join(seconds)

    def _groups_to_break(self) -> list[Any]:
        """The groups of this communicator and of those split from it, each marked as breaking."""
        comm = _torch_comm(self)
        if comm._closed:
            return []
        comm._waits_broken = True
        return comm._held_groups() + [g for sub in list(comm._subs) for g in sub._groups_to_break()]

    def _abandon(self) -> list[Any]:
        """Close over a failure: nothing waits for peers that may be gone (eager sends, pending calls).

        Its groups and their pending work (and its sub-communicators') are held for the group's
        timeout (``_deferred_free``), broken or not: a transport thread of theirs may still wait on
        a lost peer until then. Returns what it held (``DEFERRED.free`` lets go of it at once)."""
        comm = _torch_comm(self)
        DEFERRED.free_due()
        with comm._eager_lock:
            held = [DEFERRED.hold([comm._eager, comm._held_groups(), comm._queues], comm._timeout)]
            comm._eager = []
        comm._queues = Queues()
        comm._children.clear()  # their groups go with the default group
        with comm._closing_together():
            held += comm._retire_subs("shrink")
            comm.close()
        return held

    def _retire_subs(self, by: str) -> list[Any]:
        """Close the sub-communicators split from this one: their groups go with its default group.
        Returns what closing them held."""
        comm = _torch_comm(self)
        held = []
        for sub in list(comm._subs):
            if not sub._closed:
                sub._closed_why = f": the job's communicator it was split from was remade by {by}(); split the new one"
                held += sub._abandon()
        comm._subs = weakref.WeakSet()
        return held


def _whole_replicas(comm: _TorchCommunicator, seat: Seat, lost: tuple[int, ...], seconds: float | None) -> Seat:
    """The survivors' seat where the job's mesh has replicas: only the whole ones go on. A rank of a
    replica that lost one waits, as a replacement does, until the members let its replica in whole
    again (it is then a newcomer: its state fell behind); its seat is then that membership's."""
    assert comm._mesh is not None
    layout = comm._mesh.layout
    kept = layout.whole(seat.members)
    if not kept:
        return _from_snapshots(comm, seat, lost, seconds)
    if seat.job_rank in kept:
        return dataclasses.replace(seat, members=kept, admitted=tuple(r for r in seat.admitted if r in kept))
    comm._holds_state = False
    keep_alive.stop()  # (no membership of its own until let in: a launcher sees the job end without it)
    return rejoin(seat, layout.size, 3600.0 * 24 if seconds is None else seconds)


def _from_snapshots(comm: _TorchCommunicator, seat: Seat, lost: tuple[int, ...], seconds: float | None) -> Seat:
    """The survivors' seat where no replica is whole but every lost rank's snapshot is held by a
    survivor (``snapshots``): each survivor waits, as a replacement does, in the job's open round,
    which the replacements complete; that whole membership's ``sync_state`` restores the snapshots."""
    mesh = comm._mesh
    assert mesh is not None
    why = mesh.unrestorable(lost)
    if why or mesh.snapshots is None:
        raise no_whole_replica(mesh.layout, lost, why)
    mesh.snapshots.settle()  # (the exchange in flight ended with the membership: its groups are broken)
    mesh.snapshots.restoring = True
    # Beating on (unlike a replica's rank that waits while the others step on): every member waits
    # here, and a launcher that saw no beat would take the job for ended and stop them all.
    keep_alive.unwatch()
    return rejoin(seat, mesh.layout.size, 3600.0 * 24 if seconds is None else seconds)
