"""Starting a job's default group: from a launcher's environment, a URL, or a world of one.

``start_from`` turns what ``detect()`` found into a rendezvous and a communicator; ``start_world``
is the one place that initializes torch.distributed's default group (``from_env``, ``launch`` and
``distcomm.testing.spawn`` all come here).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import functools
import os
import sys
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .._communicator import DEFAULT_TIMEOUT
from .._defaults import set_default
from .._elastic.deferred_free import DEFERRED
from .._elastic.failure_report import store_host_pid
from .._elastic.forming import FormingFailed, WatchedStore, init_gloo, publish_pid
from .._elastic.keepalive import keep_alive
from .._elastic.membership import job_pids, reformed, remember_let_in, shrink_begun, successor
from .._errors import CommunicatorStateError, PeerError, is_rank_loss
from .._transfer.messages import settle_limit
from .._trust.handshake import prove_members, remember_ticket
from .._trust.key import job_key
from .._wire.memory import seconds as _seconds
from .joining import joining
from .launchers import LaunchEnv
from .ports import free_port
from .rendezvous import TICKET, Seat, Waiting, meet_or_wait, parse_url, unreachable_here, unresolved

if TYPE_CHECKING:
    from .._mesh import ElasticMesh
    from .._torch import _TorchCommunicator

__all__ = ["start_from", "start_seat", "start_world", "url_host"]


def url_host(addr: str) -> str:
    """``addr`` as the host part of a tcp:// URL: an IPv6 address goes in brackets."""
    return f"[{addr}]" if ":" in addr else addr


def start_from(cls: type[_TorchCommunicator], env: LaunchEnv, *,
               timeout: float | datetime.timedelta | None = None, **kwargs: Any) -> Any:
    """A ``cls`` communicator over a new default group, for the process ``env`` describes."""
    if dist.is_initialized():
        raise CommunicatorStateError(
            f"torch.distributed is already initialized; use {cls.__name__}() to adopt its default group")
    if env.master_addr is None or (env.master_port is None and env.world_size > 1):
        raise CommunicatorStateError(f"{cls.__name__}.from_env(): {env.address_problem or 'set MASTER_PORT'}")
    spans_machines = env.local_size is not None and env.local_size < env.world_size
    problem = unresolved(env.master_addr) or (unreachable_here(env.master_addr) if spans_machines else "")
    if problem:  # refused before connecting: otherwise each of gloo's connections waits for the timeout
        where = " across machines" if spans_machines else ""
        raise CommunicatorStateError(f"{cls.__name__}.from_env() under {env.launcher}{where}: {problem}")
    port = env.master_port or free_port()  # a world of one: any free port
    if env.node_rank is not None:
        kwargs.setdefault("machine", env.node_rank)
    url = f"tcp://{url_host(env.master_addr)}:{port}"
    return start_world(cls, url, env.rank, env.world_size, env.local_rank, timeout=timeout, scope=env.job,
                       hosted=not (env.launcher_store or _store_apart()), launcher=env.launcher, **kwargs)


def _store_apart() -> bool:
    """Whether the job's store is served apart from its ranks (``python -m distcomm store``): then
    rank 0 is its client like every other rank, and the store outlives any of them."""
    return os.environ.get("DISTCOMM_STORE", "") == "external"


def start_world(
    cls: type[_TorchCommunicator], url: str, rank: int, world: int, local_rank: int, *,
    timeout: float | datetime.timedelta | None = None, scope: str = "", hosted: bool = True,
    launcher: str | None = None, **kwargs: Any,
) -> Any:
    """Initialize torch.distributed's default group and return a ``cls`` communicator that owns it.

    The one place that starts a job's group: used by ``from_env``, ``launch`` and
    ``distcomm.testing.spawn``. ``url`` (tcp://host:port), ``scope`` and ``hosted`` say where the
    ranks meet (see ``meet``), under the job's key where the environment gives one (``job_key``);
    ``launcher`` names what started the process. For NCCL it binds
    ``cuda:<local_rank % device_count>`` first. The communicator becomes the process-wide default
    (``distcomm.current()`` in every thread) until it is closed. A replacement (a process the
    members' ``admit()`` saw waiting) gets it at once, and joins the members at its first use
    (``joining``): the members step on while its script starts up.
    """
    seconds = _seconds(timeout, DEFAULT_TIMEOUT)
    assert seconds is not None
    host, port = parse_url(url)
    key = job_key()  # (before anything connects: a bad key is refused on this rank alone, at once)
    seat = meet_or_wait(host, port, rank, world, seconds, scope=scope, hosted=hosted,
                        what=f"{launcher}'s rendezvous" if launcher else "the rendezvous", key=key)
    if cls.backend == "nccl" and "device" not in kwargs:
        if not torch.cuda.is_available():
            raise CommunicatorStateError(
                "NcclCommunicator needs CUDA and NCCL, and this machine has no CUDA device; "
                "use GlooCommunicator on CPU")
        kwargs["device"] = torch.device("cuda", local_rank % torch.cuda.device_count())
    if isinstance(seat, Waiting):
        join = functools.partial(_join_when_ready, seat, cls, seconds, timeout, launcher, kwargs)
        known = {"_device": kwargs["device"]} if "device" in kwargs else {}
        return joining(cls, join, rank, world, _launcher=launcher, _timeout=seconds, _closed=False,
                       _holds_state=False, **known)
    comm = start_seat(cls, seat, timeout=timeout, **kwargs)
    comm._launcher = launcher
    return comm


def _join_when_ready(waiting: Waiting, cls: type[_TorchCommunicator], seconds: float,
                     timeout: float | datetime.timedelta | None, launcher: str | None, kwargs: dict[str, Any],
                     comm: Any) -> Exception | None:
    """A replacement's first use: it proves the job's key, the members' next ``admit()`` lets it
    in, and ``comm`` (the object its script holds) becomes the communicator of their new membership.
    Returns the loss of a member met as that membership's mesh was made (its first use raises it)."""
    mesh = comm.__dict__.pop("_mesh", None)  # (one its script made before: ElasticMesh.before_join)
    seat = waiting.join(seconds)
    if mesh is not None:
        mesh.drop_stand_ins()
    comm.__class__ = cls  # (from here on a plain one, made in place)
    start_seat(cls, seat, timeout=timeout, into=comm, **kwargs)
    comm._launcher = launcher
    let_in = seat.job_rank in seat.admitted  # (else the round completed: a restart of the whole job)
    comm._holds_state = not let_in  # (a newcomer's, once sync_state hands it the members')
    if let_in:  # the members wait for its first call from now (warn_late_first_call)
        comm._let_in_at = time.monotonic()
    if mesh is None:
        return None
    comm._mesh = mesh  # (the members' admit makes its groups too: _succeeded_by)
    return _follow_as_members_do(comm, mesh)


def _follow_as_members_do(comm: _TorchCommunicator, mesh: ElasticMesh) -> Exception | None:
    """Point a replacement's mesh at the membership it joined. Where a member was lost as it
    formed, the members shrink at once (``_succeeded_by``); the replacement learns of the loss
    from its first call, as a rank loss, and its script's ``shrink()`` meets theirs."""
    members = comm.membership.job_ranks
    if mesh.layout.whole(members) != members:
        return PeerError(
            f"a member was lost as this replacement was let in: the membership it joined ({list(members)}) has a "
            f"replica that isn't whole; shrink() to go on with the whole ones", op="admit")
    try:
        mesh.follow(comm)
    except Exception as e:  # (a member lost as the mesh's groups were made: torch's own error too)
        if not is_rank_loss(e):
            raise
        return e
    return None


def start_seat(cls: type[_TorchCommunicator], seat: Seat, *, timeout: float | datetime.timedelta | None,
               lost: tuple[int, ...] = (), pids: dict[int, int] | None = None, into: Any = None,
               **kwargs: Any) -> Any:
    """The default group of the membership ``seat`` names, and a ``cls`` communicator that owns it.

    Also where a shrink or an admit ends: each makes a new membership, and its group afresh. A
    membership that breaks while its group forms (a member lost, or the others already agreeing
    on its survivors) is shrunk like any other, and its survivors form again; no new try starts
    once the timeout has passed. In the job's first round, where every rank must be there, a lost
    rank is an error naming it. ``pids`` are the members' pids this machine already knows (job
    rank -> pid). ``into``: the object to make the communicator in (a replacement's: ``joining``)."""
    seconds = _seconds(timeout, DEFAULT_TIMEOUT)
    assert seconds is not None
    deadline = time.monotonic() + seconds
    pids = dict(pids or {})
    try:
        while True:
            store = WatchedStore(seat, pids)
            try:
                return _form(cls, seat, store, seconds, lost, into, timeout=timeout, **kwargs)
            except BaseException as e:
                DEFERRED.hold(e, seconds)  # (its half-built groups: see _deferred_free)
                failure = _broken(store, e)
                if failure is None:
                    raise
                first = seat.epoch.startswith("round-")
                if first or time.monotonic() > deadline:
                    raise PeerError(f"{seat.where}: {failure}" + (
                        "; the job's ranks must all start before it can lose one" if first
                        else f"; no group of the survivors formed within {seconds:g} s"),
                        op="rendezvous", ranks=failure.ranks) from e
            pids = store.known_pids()
            seat, via_admit = successor(seat)
            seat, more = reformed(seat, pids, seconds)
            lost = more if via_admit else lost + more
    except BaseException:
        keep_alive.stop()  # no beat for a process that joins no membership
        raise


def _form(cls: type[_TorchCommunicator], seat: Seat, store: WatchedStore, seconds: float,
          lost: tuple[int, ...], into: Any, **kwargs: Any) -> Any:
    """One try at the membership's group, over ``store``; undone if it fails."""
    td = datetime.timedelta(seconds=seconds)
    rank, world = seat.rank, len(seat.members)
    keep_alive.follow(seat)
    try:
        publish_pid(seat)
        if cls.backend == "nccl":
            device = kwargs["device"]
            torch.cuda.set_device(device)
            dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=td, device_id=device)
        else:
            init_gloo(store, rank, world, td, lazily=not seat.epoch.startswith("round-"))
        ticket = prove_members(seat.job.key, seat.epoch, seat.members, kwargs.get("device"),  # (before set-up)
                               watch=store.look)
        if ticket is not None:  # (newcomers prove the key over it: see rendezvous.prove_to_members)
            remember_ticket(ticket)
            remember_let_in(seat)
            if rank == 0:
                seat.job.set(TICKET, ticket)
        pids = store.known_pids(refresh=True)
        comm = _made(cls, into, _owns_default=True, _pids={i: pids[r] for i, r in enumerate(seat.members) if r in pids},
                     _seat=seat, **kwargs)
        comm._machines_declared = True  # the job's launcher knows its machines (the reference's launch())
        comm._store_by_rank0 = seat.hosted and seat.members[0] == 0  # job rank 0 serves it, if still here
        comm._job_ranks, comm._lost, comm._admitted = seat.members, lost, seat.admitted
        keep_alive.watch_host(store_host_pid(comm), job_pids(comm))
        keep_alive.on_broken(functools.partial(_break_waits, weakref.ref(comm)))
        atexit.register(_close_at_exit, weakref.ref(comm))
        set_default(comm)  # every thread of the process sees it
        return comm
    except BaseException:
        keep_alive.unwatch()  # this process beats on while it agrees on the next (start_seat stops it if not)
        if dist.is_initialized():  # (the communicator's own set-up destroys it when that fails)
            DEFERRED.hold(dist.distributed_c10d._get_default_group(), seconds)  # (see _deferred_free)
            dist.destroy_process_group()
        # torch counts every group it starts to make: the next try's must have the name the others give it
        dist.distributed_c10d._world.group_count = 0
        raise


def _made(cls: type[_TorchCommunicator], into: Any, **kwargs: Any) -> Any:
    """A new ``cls`` communicator over the default group, or ``into`` made one in place."""
    if into is None:
        return cls(None, **kwargs)
    cls.__init__(into, None, **kwargs)
    return into


def _broken(store: WatchedStore, error: BaseException) -> FormingFailed | None:
    """Why a try at a group failed, where the membership broke: a wait of its formation said so,
    members are found gone (one that died after it wrote its address fails the others'
    connections to it, not their waits), or a peer left the set-up's first collective (the others
    already agree on the survivors). None for any other failure, and for Ctrl-C."""
    if not isinstance(error, Exception):
        return None
    if store.failure is not None:
        return store.failure
    try:
        gone = store.lost()
        if gone or isinstance(error, PeerError) or shrink_begun(store.seat.job, store.seat.epoch):
            return FormingFailed(store.seat, gone)
    except Exception:  # noqa: S110 - the store is gone: the error as it is says more
        pass
    return None


def _break_waits(ref: weakref.ref[_TorchCommunicator]) -> None:
    """The keep-alive found the membership broken: break the waits on its groups (on a thread of
    its own: the beat goes on meanwhile)."""
    comm = ref()
    if comm is not None:
        comm._break_waits()


def _close_at_exit(ref: weakref.ref[_TorchCommunicator]) -> None:
    """Close a job's communicator the program never closed, before the interpreter tears its groups'
    threads down (that aborts the process: "terminate called without an active exception", after
    all the work is done). Calls still pending get a moment; on an uncaught error, or past that,
    they are let go rather than waited for: their peers may be waiting for this very process."""
    comm = ref()
    if comm is None or comm._closed or comm._pid != os.getpid():
        return
    dying = getattr(sys, "last_value", None) is not None
    deadline = time.monotonic() + (settle_limit(comm, dying) or _AT_EXIT_SECONDS)
    for handle in comm._pending_calls():
        with contextlib.suppress(Exception):
            handle.wait(timeout=max(deadline - time.monotonic(), 0.001))
    if dying or comm._pending_calls() or comm._broken is not None:
        comm._abandon()
    else:
        with contextlib.suppress(Exception):
            comm.close()


_AT_EXIT_SECONDS = 60.0
"""The longest exit waits for calls a never-closed communicator left pending (bounded by its timeout too)."""
