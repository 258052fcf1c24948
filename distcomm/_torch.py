"""Communicators over torch.distributed: GlooCommunicator (CPU) and NcclCommunicator (CUDA)."""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as _dc10d

from ._agreement import check_settings, spans
from ._calls import CallSpec, Op
from ._communicator import DEFAULT_SLOT_BYTES, Communicator
from ._defaults import clear_default
from ._elastic.deferred_free import DEFERRED, let_go
from ._elastic.failure_report import fail
from ._elastic.forming import connecting, forming_watched, native_store
from ._elastic.liveness import process_id
from ._elastic.torch_membership import TorchMembership
from ._elastic.waits import SLICE, interrupted, timedelta_of, wait
from ._errors import (
    CollectiveError,
    CommunicatorStateError,
)
from ._launching.launchers import detect
from ._launching.rendezvous import Seat
from ._launching.start import start_from
from ._one_at_a_time import exclusive
from ._transfer.gathered_reduce import gathered_reduce, gathered_traffic, takes_gathered
from ._transfer.header_exchange import (
    SUMMARY_CARRY,
    SUMMARY_CARRY_ACROSS,
    HeaderBufs,
    binomial_children,
    gather_headers,
    header_blocks,
    table_index,
)
from ._transfer.messages import settle_eager, settle_limit, torch_recv, torch_send
from ._trust.handshake import prove_members
from ._trust.key import JobKey
from ._trust.records import Records
from ._wire import frame as _frame
from ._wire.serialization import Serializer

__all__ = ["GlooCommunicator", "NcclCommunicator"]

_SETTLE_SECONDS = 0.02
"""How long close() lets the transport's threads finish releasing the last ops."""

_SETTLED = threading.local()
"""``now``: this thread closes communicators together, and their threads had their pause (or
need none: ``off_path``, their groups torn down on a thread of their own)."""

_HOW_TO_START = (
    "torch.distributed is not initialized. Start it with {cls}.from_env() (under any launcher), "
    "with distcomm.launch(main, num_processes_per_machine=N), or with "
    "torch.distributed.init_process_group(...) before creating a {cls}"
)


def _c10d() -> Any:
    return torch._C._distributed_c10d


def _td(seconds: float | None) -> datetime.timedelta | None:
    return None if seconds is None else datetime.timedelta(seconds=seconds)


_CARRIED = Communicator._REDUCIBLE_DTYPES
"""The dtypes gloo's broadcast and all-gather take as they are: those it reduces (see ``_as_carried``)."""


def _as_carried(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as the native broadcast and all-gather move it, same memory: complex as
    (re, im) pairs, a dtype gloo refuses (float8, uint16, ...) as its raw bytes, each element's
    bytes in a last dimension of its own, so that dim 0 (all-gather's rows) stays as it is."""
    if t.is_complex():
        return torch.view_as_real(t)
    if t.dtype in _CARRIED:
        return t
    return t.unsqueeze(-1).view(torch.uint8)


_REUSABLE_NAMES: set[str] = set()
"""Names of live groups this process made with use_local_synchronization, whose names torch may
give again once they are destroyed (see ``_TorchCommunicator._forget_keys``)."""


def _machine_key(machine: str | int | None) -> str:
    if isinstance(machine, str) and machine.startswith(("given:", "node:", "host:")):
        return machine  # a key already made (a sub-communicator's, from its parent)
    if machine is not None:
        return f"given:{machine}"
    try:
        env = detect()
    except ValueError:  # contradictory launcher variables: the host name still tells machines apart
        return f"host:{socket.gethostname()}"
    return f"node:{env.node_rank}" if env.node_rank is not None else f"host:{socket.gethostname()}"


class _TorchCommunicator(TorchMembership, Communicator):
    """Shared plumbing of the torch.distributed communicators."""

    def __init__(
        self,
        group: Any = None,
        *,
        timeout: float | datetime.timedelta | None = None,
        serializer: Serializer | None = None,
        max_bytes: int | None = None,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        receive_cuda_on: Literal["device", "cpu"] = "device",
        machine: str | int | None = None,
        _owns_default: bool = False,
        _order: Sequence[int] | None = None,
        _pids: dict[int, int] | None = None,
        _seat: Seat | None = None,
        _key: JobKey | None = None,
    ) -> None:
        super().__init__(timeout=timeout, serializer=serializer, max_bytes=max_bytes, slot_bytes=slot_bytes,
                         receive_cuda_on=receive_cuda_on)
        self._key = _seat.job.key if _seat is not None else _key  # (every group it makes is proven with it)
        if not dist.is_available():
            raise CommunicatorStateError("this torch build has no torch.distributed")
        if not dist.is_initialized():
            raise CommunicatorStateError(_HOW_TO_START.format(cls=type(self).__name__))
        default = dist.distributed_c10d._get_default_group()
        self._group: Any = default if group is None else group
        self._is_world = self._group is default
        self._owns_default = _owns_default
        self._owned: list[Any] = []
        self._eager: list[Any] = []  # small sends posted without waiting (see _messages.torch_send)
        self._eager_lock = threading.Lock()
        self._eager_at_exit = False  # whether exit waits for them (registered with the first)
        self._subs: weakref.WeakSet[_TorchCommunicator] = weakref.WeakSet()  # split from this one (_make_sub)
        rank = dist.get_rank(self._group)
        if rank < 0:
            raise ValueError(f"this process (global rank {dist.get_rank()}) is not a member of the given group")
        # This communicator's ranks are numbered its own way (split's keys), its group's by global
        # rank: _ranks (each rank's global rank), _rank, machines, blocks and error reports go by
        # its own numbering, and _to_group maps it onto the group's (None: they are the same)
        # where a rank or a rank-ordered list is handed to torch (see _at).
        group_ranks = list(dist.get_process_group_ranks(self._group))
        self._ranks = group_ranks if _order is None else list(_order)
        place = {g: i for i, g in enumerate(group_ranks)}
        if sorted(self._ranks) != sorted(group_ranks):
            raise ValueError(f"_order {self._ranks} is not an order of the group's ranks {group_ranks}")
        to_group = [place[g] for g in self._ranks]
        self._to_group: list[int] | None = None if to_group == list(range(len(to_group))) else to_group
        self._from_group: list[int] = sorted(range(len(to_group)), key=to_group.__getitem__)  # its inverse
        self._rank = self._from_group[rank]
        self._world = len(group_ranks)
        self._check_backend(dist.get_backend(self._group))
        self._opts_cache: tuple[float | None, Any] | None = None
        self._opts_made: dict[tuple[str, float | None, str | None, int | None], Any] = {}
        self._slot_bufs: tuple[torch.Tensor, memoryview, torch.Tensor, memoryview] | None = None
        self._obj_group: Any = self._object_group()
        try:
            self._store: Any = native_store(dist.distributed_c10d._get_default_store())
        except Exception:  # a store is only used to name missing ranks after a failure
            self._store = None
        # what ranks say there after a failure (who reached the call, what each waited for), signed
        self._reports = None if self._store is None else Records(self._store, self._key, "")
        self._token = ""
        self._peer_pids: dict[int, int] = dict(_pids or {})  # same-machine peers' pids (set-up learns them all)
        self._seat = _seat  # (before set-up: its waits then know when the others gave this membership up)
        self._local_group: Any = self._group
        # the header exchange's blocks, this rank's block and the groups it gathers and broadcasts
        # in (see _header_exchange); until set-up has made them, one block: the whole group
        self._blocks: list[list[int]] = [list(range(self._world))]
        self._block: list[int] = self._blocks[0]
        self._place = (0, self._rank)  # (this rank's block, its place in it)
        self._block_group: Any = self._obj_group
        self._leader_group: Any = None
        self._table_index: np.ndarray[Any, Any] | None = None  # see _header_exchange.table_index
        self._header_bufs: dict[int, HeaderBufs] = {}  # per slot size, for this layout (make_header_bufs)
        self._carry: memoryview | None = None  # see _carried
        self._summary_carry = SUMMARY_CARRY_ACROSS  # until set-up knows the machines (every rank alike)
        self._machine_key = _machine_key(machine)
        self._seq = -1  # set-up is call #0: the user's calls count from 1, as in the test doubles
        try:  # as a collective: other ranks' error messages then say this rank is in set-up, and where
            exclusive(type(self)._setup)(self, self._machine_key)
        except BaseException:
            self._shutdown()
            raise
        self._done = None  # "last returned" names the user's collectives, not set-up

    backend: ClassVar[str]
    """The torch.distributed backend of the default group this class starts (``from_env``)."""
    _store_by_rank0 = True
    """Whether global rank 0's process serves the job's store (not where a torchrun agent does)."""
    _seat: Seat | None = None
    """Where a job's communicator met the others (``shrink`` and ``admit`` start from it); None on
    sub-communicators and adopted groups."""
    _job_ranks: tuple[int, ...] | None = None
    _waits_broken = False
    """Whether this process began to break the waits on its groups (``_break_waits``): its calls then
    fail saying why the membership broke, not what the transport saw."""
    _lost: tuple[int, ...] = ()
    _admitted: tuple[int, ...] = ()

    # ------------------------------------------------------------------ set-up
    def _check_backend(self, backend: str) -> None:
        raise NotImplementedError

    def _object_group(self) -> Any:
        return self._group

    def _local_backend(self) -> str | None:
        return None

    def _new_group(self, ranks: list[int], backend: str | None) -> Any:
        with forming_watched(), connecting(lazily=False):  # (gloo's threads never ask a Python store: init_gloo)
            g = dist.new_group(
                [self._ranks[r] for r in ranks], backend=backend, timeout=_td(self._timeout),
                use_local_synchronization=not self._is_world,
            )
        if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
            self._owned.append(g)
            if not self._is_world:
                _REUSABLE_NAMES.add(g.group_name)
            device = None if (backend or self.backend) == "gloo" else getattr(self, "_device", None)
            prove_members(self._key, f"group {g.group_name}", tuple(self._ranks[r] for r in ranks), device, g)
        return g

    def _forget_keys(self, names: list[str]) -> None:
        """Delete the store keys of the groups ``names``, destroyed: torch names a group made with
        use_local_synchronization from its ranks and its members' count of groups, which destroying
        it brings back down, so the next group of those ranks gets the same name; its members would
        then read the closed group's addresses from the store ("Connection refused") instead of
        each other's. Each member deletes the keys when it closes, before it can take part in the
        exchange that makes the next group of that name. Best effort: a store that can't be reached
        at teardown (the job is ending) leaves them."""
        if not names or self._store is None:
            return
        try:
            keys = [k for k in self._store.list_keys() if k.startswith(tuple(f"{n}/" for n in names))]
            for k in keys:
                self._store.delete_key(k)
        except Exception:  # noqa: S110 - best effort on teardown
            pass

    def _setup(self, machine: str) -> None:
        # Set-up's slot has one size whatever the settings, so ranks whose settings differ still
        # meet in the same exchange, and every rank then refuses the difference alike.
        token = secrets.token_hex(8)
        infos = self._run(CallSpec(Op.SETUP, -1, (machine, token, self._settings(), process_id()), self._timeout,
                                   slot_size=_frame.HEADER_SLOT))
        self._stats.pop(Op.SETUP.label, None)  # the user never called it
        check_settings([info[2] for info in infos])
        self._token = infos[0][1]
        # peers whose process this rank can see (same kernel, same PID namespace): a long wait checks
        # that they still exist, since a dead peer's connections stay open while a process it forked
        # (a data loader's worker) holds them, and the transport then notices nothing
        here = process_id()[:2]
        self._peer_pids = {r: info[3][2] for r, info in enumerate(infos)
                           if r != self._rank and tuple(info[3][:2]) == here}
        keys = [info[0] for info in infos]
        self._set_machines([[r for r, k in enumerate(keys) if k == key] for key in dict.fromkeys(keys)])

    def _set_machines(self, machines: list[list[int]]) -> None:
        super()._set_machines(machines)
        for members in machines:  # every rank creates every machine's group, in the same order
            group = self._group if len(machines) == 1 else self._new_group(members, self._local_backend())
            if self._rank in members:
                self._local_group = group
        # the summary's room, just before the buffers that hold it are made again
        self._summary_carry = SUMMARY_CARRY if len(machines) == 1 else SUMMARY_CARRY_ACROSS
        self._set_header_blocks(header_blocks(self._world, machines),
                                machines if self._obj_group is self._group else None)

    def _set_header_blocks(self, blocks: list[list[int]], machines: list[list[int]] | None) -> None:
        """Make the groups of the header exchange's ``blocks`` (every rank makes every group, in the
        same order); ``machines``: where blocks that are machines may use the machine groups."""
        self._blocks = blocks
        self._table_index = table_index(blocks, self._world)
        self._header_bufs = {}
        self._place = next((i, b.index(self._rank)) for i, b in enumerate(blocks) if self._rank in b)
        self._block = blocks[self._place[0]]
        if len(blocks) == 1:
            self._block_group, self._leader_group = self._obj_group, None
            return
        # Every rank joins the same number of new groups, one per level: torch names a group made
        # with use_local_synchronization (a sub-communicator's, or the user's own) from the count of
        # groups each member is in, so members whose counts differ would never meet. Hence a group
        # for a block of one rank too, and at the second level one group for the blocks' j-th ranks
        # for every j (the first ranks' is the one the exchange uses; on machines, the others are
        # the "rails" of local rank j).
        self._block_group = None
        for block in blocks:
            group = (self._local_group if machines is not None and blocks == machines
                     else self._new_group(block, "gloo"))
            if self._rank in block:
                self._block_group = group
        self._leader_group = None
        for j in range(max(len(b) for b in blocks)):
            group = self._new_group([b[j] for b in blocks if len(b) > j], "gloo")
            if j == 0 and self._place[1] == 0:
                self._leader_group = group

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def group(self) -> Any:
        """The torch process group this communicator's tensor collectives use."""
        return self._group

    @property
    def local_group(self) -> Any:
        """The process group of the ranks on this machine."""
        return self._local_group

    @contextlib.contextmanager
    def _closing_together(self, *, off_path: bool = False) -> Iterator[None]:
        """Close several communicators in a row (a membership's and those split from it): the
        transport's threads get one pause to release their last ops, before the first, rather than
        one each (a pause each is on the path of every shrink and admit). ``off_path``: the job's
        communicator's groups are torn down on a thread of their own (``let_go``), which lets
        the transport's threads release their ops meanwhile: no pause (an admit's)."""
        if getattr(_SETTLED, "now", False):  # (within another: a sub-communicator's, as its parent closes)
            yield
            return
        if not off_path:
            time.sleep(_SETTLE_SECONDS)
        _SETTLED.now, _SETTLED.off_path = True, off_path
        try:
            yield
        finally:
            _SETTLED.now = _SETTLED.off_path = False

    def _shutdown(self) -> None:
        # A gloo worker drops its reference to a finished op's tensors after the op completes, and
        # that needs the GIL. Release the GIL for a moment so that it can, now: at interpreter exit
        # it would abort the process ("terminate called without an active exception").
        if not getattr(_SETTLED, "now", False):
            time.sleep(_SETTLE_SECONDS)
        DEFERRED.free_due()  # (a safe point: the groups of memberships broken long enough ago)
        if self._eager:
            settle_eager(self, settle_limit(self, self._ending_on_error))
        reused = []
        # a job's groups, as an admit closes it: torn down while the next membership forms
        letting_go = self._owns_default and getattr(_SETTLED, "off_path", False)
        groups = [*self._owned, self._group, self._obj_group, self._local_group, self._block_group,
                  self._leader_group] if letting_go else []
        for g in reversed(self._owned):
            name = getattr(g, "group_name", None)
            try:
                dist.destroy_process_group(g)
            except Exception:  # noqa: S110 - best effort on teardown
                pass
            if name in _REUSABLE_NAMES:
                _REUSABLE_NAMES.discard(name)
                reused.append(name)
        self._forget_keys(reused)
        self._owned.clear()
        if self._owns_default:
            clear_default(self)
        if self._owns_default and dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: S110 - best effort on teardown
                pass
        # Let go of the groups, so that they are torn down now where nothing else holds them; of
        # those it doesn't own too: one its owner destroys would otherwise live on here until
        # interpreter exit, where tearing its threads down can abort the process.
        self._group = self._obj_group = self._local_group = self._store = self._reports = None
        self._block_group = self._leader_group = None
        self._header_bufs, self._carry = {}, None  # its native calls are the groups' bound methods
        if letting_go:
            let_go(groups)

    # ------------------------------------------------------------------ transport
    # How its waits go (see _waits): in slices that look at Ctrl-C and at the peers' processes
    _sliced_waits = True  # NCCL: no (a timed-out wait may abort its communicator)

    def _alltoall_opts(self, timeout: float | None) -> Any:
        cached = self._opts_cache
        if cached is None or cached[0] != timeout:
            opts = _c10d().AllToAllOptions()
            if timeout is not None:
                opts.timeout = datetime.timedelta(seconds=timeout)
            cached = self._opts_cache = (timeout, opts)
        return cached[1]

    def _exchange_slots(self, slot: bytearray, size: int, timeout: float | None,
                        carry: Sequence[memoryview] = (), own: Sequence[bytearray] = ()) -> tuple[memoryview, Any]:
        self._carry = None
        if self._world > _frame.SMALL_WORLD:
            if self._to_group is not None:  # the header exchange lays slots out in its groups' order: Bruck's
                return Communicator._exchange_slots(self, slot, size, timeout, carry, own)
            return gather_headers(self, slot, size, timeout, carry)
        return super()._exchange_slots(slot, size, timeout, carry, own)

    def _carried(self, root: int, total: int) -> memoryview | None:
        # rank 0 wrote them into the summary when it was the root and the odd slot (every other
        # slot alike: the broadcast's common case) and they fit: what every rank can tell from the
        # summary and the root's slot
        carry = self._carry
        return carry[:total] if carry is not None and root == 0 and 0 < total <= carry.nbytes else None

    def _scatter_slots(self, root: int, subs: list[bytearray], size: int, timeout: float | None) -> torch.Tensor | None:
        # beyond small worlds in one native scatter: the root's sends are posted in C++, not a
        # Python post and wait per rank
        if self._world <= _frame.SMALL_WORLD:
            return super()._scatter_slots(root, subs, size, timeout)
        me = self._rank
        buf = torch.empty(size, dtype=torch.uint8)
        ins = [[torch.frombuffer(subs[r], dtype=torch.uint8) for r in self._from_group]] if me == root else []
        if me == root:
            self._count((self._world - 1) * size, 0)
        else:
            self._count(0, size)
        opts = self._opts("ScatterOptions", timeout, root=self._at(root))
        self._native(self._obj_group.scatter, ([buf], ins, opts), timeout)
        return None if me == root else buf

    def _allgather_small(self, slot: bytearray, size: int, timeout: float | None,
                         own: Sequence[bytearray] = ()) -> memoryview:
        # An all-to-all of the slot repeated once per rank (small worlds only): gloo runs it as
        # direct pairwise exchanges on the tensors' own memory, which on loopback takes about two
        # thirds of the time of its all-gather (a ring behind flatten-and-copy steps).
        # The buffers are reused from call to call: what the pipeline reads from the output
        # (inline segments) is deserialized, and so copied, before the collective returns.
        bufs = self._slot_bufs
        if bufs is None or bufs[0].numel() != self._world * size:
            n = self._world * size
            send, out = torch.empty(n, dtype=torch.uint8), torch.empty(n, dtype=torch.uint8)
            bufs = self._slot_bufs = (send, memoryview(send.numpy()), out, memoryview(out.numpy()))  # type: ignore[arg-type]
        send, send_view, out, out_view = bufs
        me, at = self._rank, self._to_group
        for r in range(self._world):  # a scatter's root: each rank's own slot (its part), in the group's order
            p = r if at is None else at[r]
            send_view[p * size : (p + 1) * size] = own[r] if own and r != me else slot
        try:
            work = self._obj_group.alltoall_base(out, send, [], [], self._alltoall_opts(timeout))
        except Exception as e:
            fail(self, e, timeout)
        wait(self, [work], timeout)
        if at is not None:  # from the group's order into this communicator's (a copy of the small slots)
            return memoryview(out.view(self._world, size)[at].reshape(-1).numpy())  # type: ignore[arg-type]
        return out_view

    def _exchange(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], timeout: float | None
    ) -> None:
        g, at = self._obj_group, self._to_group
        try:
            works = [g.recv([t], src if at is None else at[src], 0) for src, t in recvs]
            works += [g.send([t], dst if at is None else at[dst], 0) for dst, t in sends]
        except Exception as e:
            fail(self, e, timeout)
        wait(self, works, timeout, [src for src, _ in recvs] + [dst for dst, _ in sends],
                   sum(t.numel() for _, t in recvs) + sum(t.numel() for _, t in sends))

    def _alltoallv(
        self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor, recv_counts: list[int],
        timeout: float | None,
    ) -> None:
        if self._to_group is not None:  # the chunks are in this communicator's order, not the group's
            Communicator._alltoallv(self, send, send_counts, recv, recv_counts, timeout)  # point to point
            return
        try:
            work = self._obj_group.alltoall_base(recv, send, recv_counts, send_counts, self._alltoall_opts(timeout))
        except Exception as e:
            fail(self, e, timeout)
        wait(self, [work], timeout)

    def _broadcast_buffer(self, buf: torch.Tensor, root: int, timeout: float | None) -> None:
        at = self._at(root)
        self._broadcast_in(self._obj_group, self._world, (self._at(self._rank) - at) % self._world, buf, timeout, at)

    def _broadcast_in(self, group: Any, members: int, v: int, buf: torch.Tensor, timeout: float | None,
                      root: int = 0) -> None:
        """gloo's broadcast of ``buf`` in ``group`` (of ``members`` ranks, this one ``v`` from the
        root): one post, a binomial tree in C++, counted as such (``binomial_children``)."""
        n = buf.numel()
        self._count(binomial_children(members, v) * n, 0 if v == 0 else n)
        self._native(group.broadcast, ([buf], self._opts("BroadcastOptions", timeout, root=root)), timeout)

    def _reduce_tensor(self, tensor: torch.Tensor, dst: int | None, timeout: float | None) -> None:
        self._tensor_reduce(tensor, dst, "sum", timeout)

    def _send_message(self, dst: int, tag: int, parts: list[torch.Tensor], timeout: float | None) -> None:
        torch_send(self, dst, tag, parts, timeout)

    def _recv_message(self, src: int, tag: int, bufs: list[torch.Tensor], timeout: float | None) -> None:
        torch_recv(self, src, tag, bufs, timeout)

    def _at(self, r: int) -> int:
        """This communicator's rank ``r`` as its group numbers it (what torch's calls take)."""
        return r if self._to_group is None else self._to_group[r]

    # ------------------------------------------------------------------ tensor transport: the native collectives
    _REDUCE_OPS: ClassVar[dict[str, str]] = {"sum": "SUM", "mean": "SUM", "min": "MIN", "max": "MAX", "prod": "PRODUCT"}

    def _device_problem(self, tensor: torch.Tensor) -> str | None:
        if not tensor.is_cpu:
            return (f"{type(self).__name__} takes CPU tensors, this one is on {tensor.device} "
                    f"(NcclCommunicator moves CUDA tensors)")
        return None

    def _opts(self, kind: str, timeout: float | None, op: str | None = None, root: int | None = None) -> Any:
        """A native collective's options, made once per combination (torch copies them per call)."""
        key = (kind, timeout, op, root)
        opts = self._opts_made.get(key)
        if opts is None:
            c = _c10d()
            opts = getattr(c, kind)()
            if timeout is not None:
                opts.timeout = datetime.timedelta(seconds=timeout)
            if op is not None:
                opts.reduceOp = getattr(c.ReduceOp, self._REDUCE_OPS[op])
            if root is not None:
                opts.rootRank = root
            if kind == "BroadcastOptions":
                opts.rootTensor = 0
            if len(self._opts_made) > 256:
                self._opts_made.clear()
            self._opts_made[key] = opts
        return opts

    def _native(self, post: Callable[..., Any], args: tuple[Any, ...], timeout: float | None) -> None:
        """Post one native collective, ``post(*args)``, and wait for it."""
        try:
            work = post(*args)
        except Exception as e:
            fail(self, e, timeout)
        self._wait_one(work, timeout)

    def _wait_one(self, work: Any, timeout: float | None) -> None:
        """``wait(self, [work], timeout)`` for one native collective, with its common case (done within
        the first slice) in one timed wait: the tensor collectives' hot path runs few lines."""
        if not self._sliced_waits or (timeout is not None and timeout <= SLICE):
            wait(self, [work], timeout)
            return
        start = time.monotonic()
        try:
            work.wait(timedelta_of(SLICE))
            return
        except Exception as e:  # the slice ran out ("Operation timed out!"), or the transport failed
            if not isinstance(e, RuntimeError) or "timed out" not in str(e).lower():
                fail(self, e, timeout)
        except BaseException as e:  # Ctrl-C
            interrupted(self, e)
            raise
        wait(self, [work], timeout, start=start)

    _fast_path_device = torch.device("cpu")  # the device whose tensors the fast path takes (NCCL: its own)

    def _unchecked_fast_path(self, op: Op, root: int, tensor: torch.Tensor,
                             reduce_op: str | None) -> torch.Tensor | None:
        # run_tensor_op's check=False path for the common case, inlined into one call: each Python call
        # between a training loop and the native collective costs it microseconds with cold caches
        # (measured on gloo: this cut what a call adds to torch.distributed's own by half or more).
        # Anything uncommon (not a plain contiguous tensor, autograd, a reduction the dtype can't
        # take, another device, a closed or broken communicator) returns None: run_tensor_op then runs,
        # and words the error; it also materializes conjugate views, whose memory isn't their value, and
        # moves complex tensors as real pairs.
        if (type(tensor) is not torch.Tensor or tensor.dtype not in _CARRIED or tensor.requires_grad
                or not tensor.is_contiguous()
                or tensor.is_complex() or tensor.is_neg() or tensor.device != self._fast_path_device
                or self._world == 1 or self._closed or self._broken is not None or self._misused is not None
                or os.getpid() != self._pid or (self._to_group is not None and op is Op.ALL_GATHER_TENSOR)):
            return None
        if reduce_op == "mean" and not tensor.is_floating_point():  # (min and max refuse only complex: above)
            return None
        st = self._stats.get(op.label) or self._stat(op)  # (_stat's lookup, without its call)
        st.calls += 1
        self._cur = st
        self._op_label = op.label
        t = self._timeout
        t0 = time.perf_counter()
        world = self._world
        nbytes = tensor.numel() * tensor.element_size()
        if op is Op.ALL_GATHER_TENSOR:
            x = tensor if tensor.dim() else tensor.reshape(1)
            moved = nbytes * (world - 1)  # a ring's share: everyone else's rows, each way
            st.bytes_sent += moved
            st.bytes_received += moved
            out = x.new_empty((x.shape[0] * world, *x.shape[1:]))
            self._native(self._group._allgather_base, (out, x, self._opts("AllgatherOptions", t)), t)
        elif op is Op.ALL_REDUCE:
            assert reduce_op is not None
            moved = 2 * (world - 1) * nbytes // world
            st.bytes_sent += moved
            st.bytes_received += moved
            self._native(self._group.allreduce, ([tensor], self._opts("AllreduceOptions", t, reduce_op)), t)
            if reduce_op == "mean":
                tensor.div_(world)
            out = tensor
        else:
            if self._rank == root:
                st.bytes_sent += nbytes
            else:
                st.bytes_received += nbytes
            at = root if self._to_group is None else self._to_group[root]
            self._native(self._group.broadcast, ([tensor], self._opts("BroadcastOptions", t, root=at)), t)
            out = tensor
        st.transfer_s += time.perf_counter() - t0
        return out

    def _tensor_group(self, tensor: torch.Tensor) -> Any:
        """The process group that moves ``tensor``."""
        return self._group

    def _tensor_reduce(self, tensor: torch.Tensor, dst: int | None, op: str, timeout: float | None) -> None:
        g = self._tensor_group(tensor)
        if tensor.is_complex():  # a sum (the only complex reduction) of (re, im) pairs: NCCL has no complex types
            tensor = torch.view_as_real(tensor)
        if dst is None:
            self._native(g.allreduce, ([tensor], self._opts("AllreduceOptions", timeout, op)), timeout)
        else:
            self._native(g.reduce, ([tensor], self._opts("ReduceOptions", timeout, op, self._at(dst))), timeout)

    def _tensor_broadcast(self, tensor: torch.Tensor, src: int, timeout: float | None) -> None:
        opts = self._opts("BroadcastOptions", timeout, root=self._at(src))
        self._native(self._tensor_group(tensor).broadcast, ([_as_carried(tensor)], opts), timeout)

    def _tensor_all_gather(self, out: torch.Tensor, tensor: torch.Tensor, rows: list[int],
                           timeout: float | None) -> None:
        out, tensor = _as_carried(out), _as_carried(tensor)
        g, opts = self._tensor_group(tensor), self._opts("AllgatherOptions", timeout)
        even = rows.count(rows[0]) == len(rows)
        if even and self._to_group is None:
            self._native(g._allgather_base, (out, tensor, opts), timeout)
            return
        pieces = list(torch.split(out, rows))
        # each group rank's rows into this communicator's place for them (gloo, CPU tensors included: even only)
        if even or (self._uneven_allgather and g is self._group):
            self._native(g.allgather, ([[pieces[r] for r in self._from_group]], [tensor], opts), timeout)
            return
        # gloo's all-gather wants equal sizes: each rank's rows go straight to every peer instead
        me, at = self._rank, self._at
        pieces[me].copy_(tensor)
        peers = [r for r in range(self._world) if r != me]
        try:
            works = [g.recv([pieces[r]], at(r), 1) for r in peers if rows[r]]
            works += [g.send([tensor], at(r), 1) for r in peers] if rows[me] else []
        except Exception as e:
            fail(self, e, timeout)
        wait(self, works, timeout, [r for r in peers if rows[r]] + (peers if rows[me] else []),
                   out.numel() * out.element_size())

    _uneven_allgather = False  # NCCL's all-gather takes outputs of different sizes

    def _tensor_reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: str, timeout: float | None) -> None:
        opts = self._opts("ReduceScatterOptions", timeout, op)
        if self._to_group is not None:  # the group's rank p gets the p-th slice: its rank here, from_group[p]'s
            world = self._world
            parts = tensor.reshape(world, tensor.shape[0] // world, *tensor.shape[1:])
            tensor = parts[self._from_group].reshape(tensor.shape)
        if tensor.is_complex():  # as in _tensor_reduce
            out, tensor = torch.view_as_real(out), torch.view_as_real(tensor)
        self._native(self._tensor_group(tensor)._reduce_scatter_base, (out, tensor, opts), timeout)

    # ------------------------------------------------------------------ sub-communicators
    def _make_sub(self, groups: list[list[int]], mine: list[int] | None, timeout: float | None) -> Communicator | None:
        if not self._is_world:  # (on the world, torch names groups from a count every rank keeps alike)
            self._refuse_misnamed(groups, timeout)
        backend = str(dist.get_backend(self._group))
        made = [self._new_group(members, backend) for members in groups]  # every rank, every group, in order
        if mine is None:
            return None
        group = made[groups.index(mine)]
        sub = type(self)(group, machine=self._machine_key, _order=[self._ranks[r] for r in mine], _key=self._key,
                         **self._sub_kwargs(timeout))
        self._owned.remove(group)  # the sub-communicator destroys its group when it closes
        sub._owned.insert(0, group)
        sub._store_by_rank0 = self._store_by_rank0
        sub._job_ranks = tuple(self.membership.job_ranks[r] for r in mine)
        self._subs.add(sub)
        return sub

    def _group_in(self, partition: list[list[int]]) -> Any:
        """``SubCommunicators._group_in``: every rank makes every part's group, in order (no exchange:
        the parts are alike on every rank); this communicator owns them."""
        if not self._is_world:  # (as _make_sub: torch names these groups from each member's count)
            self._refuse_misnamed(partition, self._timeout)
        backend = str(dist.get_backend(self._group))
        mine = None
        for part in partition:
            group = self._new_group(part, backend)
            if self._rank in part:
                mine = group
        return mine

    def _refuse_misnamed(self, groups: list[list[int]], timeout: float | None) -> None:
        """Refuse, on every rank and before any group is made, groups whose members torch would name
        differently: it names a group made with use_local_synchronization from its ranks and the
        count of groups the process holds. Members whose counts differ (some of them hold an open
        new_group the others aren't in) would each wait at a name of their own until the timeout."""
        counts = list(self._run(CallSpec(Op.SPLIT, -1, len(_dc10d._world.pg_names), timeout)))
        for members in groups:  # made in this order on every rank, each adding one to its members' counts
            held = [counts[r] for r in members]
            if len(set(held)) > 1:
                more = [r for r in members if counts[r] != min(held)]
                raise CollectiveError(
                    f"split: {spans(members)} would make a group together but hold different numbers of torch "
                    f"process groups ({spans(more)} more: a new_group of only some ranks, still open); torch would "
                    f"name the group differently on them and they would wait for each other; close that new_group "
                    f"first", op="split", ranks=more)
            for r in members:
                counts[r] += 1

    def _sub_kwargs(self, timeout: float | None) -> dict[str, Any]:
        return self._sub_settings(timeout)

    # ------------------------------------------------------------------ construction from the environment
    @classmethod
    def from_env(cls, *, timeout: float | datetime.timedelta | None = None, **kwargs: Any) -> Any:
        """Initialize torch.distributed from what the launcher set and return a communicator.

        Understands torchrun (and torchelastic restarts), Slurm's srun, Open MPI's mpirun, MPICH /
        Intel MPI (Hydra) and MVAPICH; explicit RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT win.
        Started by none of them (plain ``python``): a world of one on 127.0.0.1. The communicator
        owns the default process group (``close()`` destroys it); ``launcher`` says what started it.

        Raises:
            ValueError: the launcher's variables contradict each other or don't parse.
            CommunicatorStateError: torch.distributed is already initialized, or no rendezvous
                host is known (processes across machines under mpirun without MASTER_ADDR).
            CollectiveTimeoutError: ranks didn't reach the rendezvous within ``timeout``; names them.
        """
        return start_from(cls, detect(), timeout=timeout, **kwargs)


class GlooCommunicator(_TorchCommunicator):
    """A communicator over a gloo process group (CPU).

    Args:
        group: the process group; None adopts the default group of an initialized
            torch.distributed (see ``from_env`` and ``distcomm.launch`` to start one).
        machine: a name for this process's machine, used to compute local ranks; default: the
            torchrun node rank under torchrun, else the host name.
        timeout, serializer, max_bytes, slot_bytes, receive_cuda_on: see ``Communicator``.

    Construction is collective: every rank of the group must create its communicator, in the
    same order; it creates one group per machine, eagerly.
    """

    backend = "gloo"

    def _tensor_reduce(self, tensor: torch.Tensor, dst: int | None, op: str, timeout: float | None) -> None:
        if takes_gathered(self, tensor, op):
            gathered_reduce(self, tensor, dst, op, timeout)
        else:
            super()._tensor_reduce(tensor, dst, op, timeout)

    def _reduce_traffic(self, tensor: torch.Tensor, dst: int | None, op: str) -> tuple[int, int]:
        if not takes_gathered(self, tensor, op):
            return super()._reduce_traffic(tensor, dst, op)
        return gathered_traffic(self, tensor, dst)

    def _check_backend(self, backend: str) -> None:
        if "gloo" not in str(backend):
            raise ValueError(
                f"GlooCommunicator needs a gloo process group, this one's backend is {backend!r}; "
                f"use NcclCommunicator for NCCL")



class NcclCommunicator(_TorchCommunicator):
    """A communicator whose tensor collectives run over NCCL on this rank's CUDA device.

    Object collectives go over a gloo side group that the communicator creates and owns, so
    objects never stage through GPU memory. The device is bound explicitly: ``device=None``
    takes ``cuda:<local_rank % device_count>``.

    Args:
        group: an NCCL process group; None adopts the default group.
        device: the CUDA device for tensor collectives (an index, a string or a torch.device).
        machine, timeout, serializer, max_bytes, slot_bytes, receive_cuda_on: see GlooCommunicator.
    """

    backend = "nccl"

    def __init__(self, group: Any = None, *, device: int | str | torch.device | None = None, **kwargs: Any) -> None:
        if not torch.cuda.is_available():
            raise CommunicatorStateError(
                "NcclCommunicator needs CUDA and NCCL, and this machine has no CUDA device "
                "(torch.cuda.is_available() is False); use GlooCommunicator on CPU")
        if not dist.is_available() or not dist.is_nccl_available():
            raise CommunicatorStateError("NcclCommunicator needs NCCL, and this torch build has none")
        self._requested_device = device
        self._device = torch.device("cuda", 0)
        super().__init__(group, **kwargs)

    def _check_backend(self, backend: str) -> None:
        if "nccl" not in str(backend):
            raise ValueError(
                f"NcclCommunicator needs an NCCL process group, this one's backend is {backend!r}; "
                f"use GlooCommunicator for gloo")

    def _object_group(self) -> Any:
        return self._new_group(list(range(self._world)), "gloo")

    def _local_backend(self) -> str | None:
        return "nccl"

    _uneven_allgather = True
    _sliced_waits = False
    _agrees_by_reduction = True  # one NCCL all_reduce of 7 int64, not gloo's exchange, on the common path

    def _device_problem(self, tensor: torch.Tensor) -> str | None:
        if tensor.device != self._device and tensor.device.type != "cpu":
            return f"tensor is on {tensor.device}, this NcclCommunicator's device is {self._device} (or the CPU)"
        return None

    def _tensor_group(self, tensor: torch.Tensor) -> Any:
        """CPU tensors travel over the gloo side group, as with torch's default group (cpu:gloo,cuda:nccl)."""
        return self._obj_group if tensor.is_cpu else self._group

    def _rebuild_settings(self) -> dict[str, Any]:
        return {**super()._rebuild_settings(), "device": self._device}

    def _sub_kwargs(self, timeout: float | None) -> dict[str, Any]:
        return {**self._sub_settings(timeout), "device": self._device}

    def _setup(self, machine: str) -> None:
        super()._setup(machine)
        dev = self._requested_device
        count = torch.cuda.device_count()
        if dev is None:
            device = torch.device("cuda", self.local_rank % count)
        else:
            device = torch.device(dev) if not isinstance(dev, int) else torch.device("cuda", dev)
            if device.type != "cuda":
                raise ValueError(f"NcclCommunicator needs a CUDA device, got {device}")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if device.index >= count:
                raise ValueError(f"device {device} does not exist: this machine has {count} CUDA devices")
        torch.cuda.set_device(device)
        self._device = self._fast_path_device = device

    @property
    def device(self) -> torch.device:
        return self._device

    def _device_barrier(self, timeout: float | None) -> None:
        try:
            dist.barrier(group=self._group, device_ids=[self._device.index])
        except Exception as e:
            fail(self, e, timeout)
