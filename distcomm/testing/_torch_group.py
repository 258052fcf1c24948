"""A torch ProcessGroup over a communicator: torch.distributed (DDP, FSDP, a user's ``dist.*`` calls
with ``group=comm.group``) running on a test double's own tensor collectives.

Every rank of a threaded world is a thread of one process, while torch keeps its world (the default
group, the tables that map a group to its ranks) process-wide. ``_RankDefaults`` gives each rank's
thread a default group of its own, the group of its job communicator, as a process of its own has;
everything else stays in torch's tables, where each group has a name of its own.
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future  # type: ignore[attr-defined]
from torch.distributed import distributed_c10d as c10d
from torch.distributed.distributed_c10d import GroupName

from .._torch_tables import enter, leave

if TYPE_CHECKING:
    from .._communicator import Communicator

__all__ = ["TorchGroup"]

BACKEND = "distcomm"

_REDUCE_OPS = {
    dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "mean", dist.ReduceOp.PRODUCT: "prod",
    dist.ReduceOp.MIN: "min", dist.ReduceOp.MAX: "max",
}
_names = itertools.count()


def _reduce_op(opts: Any) -> str:
    if opts is None:
        return "sum"
    op = opts.reduceOp
    for torch_op, name in _REDUCE_OPS.items():
        if op == torch_op:
            return name
    raise ValueError(f"{BACKEND} groups reduce with SUM, AVG, PRODUCT, MIN or MAX, not {op}")


def _done(result: Any = None) -> Any:
    """A torch Work already complete: the communicator's calls return when their data is in place."""
    future: torch.futures.Future[Any] = torch.futures.Future()
    future.set_result(result)
    return _create_work_from_future(future)


class TorchGroup(dist.ProcessGroup):
    """A torch ProcessGroup whose collectives are ``comm``'s own (its ranks, its timeouts, its errors:
    a lost peer raises what ``distcomm.is_rank_loss`` accepts, and ``run_threaded(lose=...)`` counts
    each call as a collective of ``comm``).

    ``global_ranks``: each rank's rank in the job communicator's group, which is the default group of
    the rank's thread (torch's ``dist.get_rank(group)`` maps through it)."""

    made = False  # (whether any was made in this process)

    def __init__(self, comm: Communicator, global_ranks: Sequence[int]) -> None:
        super().__init__(comm.rank, comm.world_size)  # type: ignore[call-arg]
        self._comm = comm
        self._global_ranks = tuple(global_ranks)
        self._name = GroupName(f"{BACKEND}-{type(comm).__name__}-{next(_names)}")
        self._registered = False
        TorchGroup.made = True

    def __repr__(self) -> str:
        return f"TorchGroup({self._name}, rank={self.rank()}, size={self.size()})"

    @property
    def group_name(self) -> GroupName:
        # (torch's reads a name set on its backend; this group has none)
        return self._name

    def getBackendName(self) -> str:
        return BACKEND

    # ------------------------------------------------------------------ torch's world tables
    def register(self, default: bool) -> None:
        """Enter this group in torch's tables (``default``: as this thread's default group too)."""
        world = _install()
        enter(self, self._name, self._global_ranks, BACKEND, BACKEND)
        self._registered = True
        if default:
            world.set_thread_default(self)

    def unregister(self) -> None:
        """Take this group out of torch's tables again (its communicator closed)."""
        if not self._registered:
            return
        self._registered = False
        _install().drop_default(self)
        leave(self, self._name)
        _forget_active_ddp(self)

    # ------------------------------------------------------------------ collectives
    # torch's Python API and its C++ (DDP's reducer) call these with lists of tensors, one per device
    # of this rank (one here: the CPU). The stubs overload torch's older call forms too: hence the
    # ignores on the overrides.
    def _run(self, fn: Callable[[], object], result: Any = None) -> Any:
        # no autograd: a group moves data; DDP and FSDP record what their gradients need themselves
        with torch.no_grad():
            fn()
        return _done(result)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:  # type: ignore[override]
        op = _reduce_op(opts)
        return self._run(lambda: _each(lambda t: self._comm.all_reduce(t, op), tensors), tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        op = _reduce_op(opts)
        return self._run(lambda: _each(lambda t: self._comm.reduce(t, opts.rootRank, op), tensors), tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> Any:  # type: ignore[override]
        return self._run(lambda: _each(lambda t: self._comm.broadcast_tensor(t, opts.rootRank), tensors), tensors)

    def barrier(self, opts: Any = None) -> Any:
        return self._run(lambda: self._comm.barrier())

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
                  opts: Any = None) -> Any:
        return self._run(lambda: _each(self._gather_into, outputs, inputs), outputs)

    def allgather_coalesced(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> Any:
        return self.allgather(outputs, inputs, opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self._run(lambda: self._gather_into([output], input), [output])

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.all_gather_single(output, input, opts)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> Any:
        return self._run(lambda: _each(lambda o, i: self._gather_into([o], i), outputs, inputs), outputs)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self.all_gather_single_coalesced(outputs, inputs, opts)

    def _gather_into(self, outputs: list[torch.Tensor], input: torch.Tensor) -> None:
        """Every rank's ``input`` into ``outputs`` (one per rank, or one tensor for all), flat: the
        communicator gathers rows, torch's groups gather whole tensors of any shape."""
        _copy_flat(self._comm.all_gather_tensor(input.detach().reshape(-1)), outputs)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],  # type: ignore[override]
                       opts: Any = None) -> Any:
        op = _reduce_op(opts)
        return self._run(lambda: _each(lambda o, parts: self._scatter_into(o, torch.cat(
            [p.detach().reshape(-1) for p in parts]), op), outputs, inputs), outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        op = _reduce_op(opts)
        return self._run(lambda: _each(lambda o, i: self._scatter_into(o, i.detach().reshape(-1), op),
                                       outputs, inputs), outputs)

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> Any:
        return self.reduce_scatter_single_coalesced(outputs, inputs, opts)

    def _scatter_into(self, output: torch.Tensor, flat: torch.Tensor, op: str) -> None:
        mine = self._comm.reduce_scatter_tensor(flat.reshape(self.size(), -1), op)
        output.copy_(mine.reshape(output.shape))

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None) -> Any:
        # the object all-to-all: tensors of any shapes, each straight to its receiver
        return self._run(lambda: _each(lambda o, got: o.copy_(got), outputs,
                                       self._comm.all_to_all([t.detach() for t in inputs])), outputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int] | None, input_split_sizes: list[int] | None,
                          opts: Any = None) -> Any:
        world = self.size()
        return self.alltoall(_split(output, output_split_sizes, world), _split(input, input_split_sizes, world))

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int], opts: Any = None) -> Any:
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes, opts)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],  # type: ignore[override]
               opts: Any) -> Any:
        def run() -> None:
            got = self._comm.gather(inputs[0].detach(), opts.rootRank)  # ([] off the root)
            _each(lambda o, t: o.copy_(t), outputs[0] if got else [], got)

        return self._run(run, outputs)

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],  # type: ignore[override]
                opts: Any) -> Any:
        def run() -> None:
            root = opts.rootRank
            parts = [t.detach() for t in inputs[0]] if self.rank() == root else None
            outputs[0].copy_(self._comm.scatter(parts, root))

        return self._run(run, outputs)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> Any:
        return self._run(lambda: _each(lambda t: self._comm.send(t.detach(), dst, tag=tag), tensors))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> Any:
        return self._run(lambda: _each(lambda t: t.copy_(self._comm.recv(src, tag=tag)), tensors), tensors)


def _forget_active_ddp(group: TorchGroup) -> None:
    """Let go of a DDP over ``group`` that torch still names as the one in its forward.

    DDP saves and restores that name (a class attribute) around each forward: forwards of several rank
    threads that interleave leave one rank's DDP there. Alive, a DDP whose backward failed keeps its
    hooks on the parameters, and they fail the next DDP's backward ("marked ready twice")."""
    module = sys.modules.get("torch.nn.parallel.distributed")
    ddp = None if module is None else module.DistributedDataParallel
    if ddp is not None and getattr(ddp._active_ddp_module, "process_group", None) is group:
        ddp._active_ddp_module = None


def _each(fn: Callable[..., object], *columns: Sequence[Any]) -> None:
    for args in zip(*columns, strict=True):
        fn(*args)


def _copy_flat(flat: torch.Tensor, outputs: list[torch.Tensor]) -> None:
    at = 0
    for out in outputs:
        n = out.numel()
        out.copy_(flat[at : at + n].reshape(out.shape))
        at += n
    if at != flat.numel():
        raise ValueError(f"{BACKEND} group: gathered {flat.numel()} elements into outputs of {at}")


def _split(t: torch.Tensor, sizes: list[int] | None, world: int) -> list[torch.Tensor]:
    """``t`` cut along dim 0 as all_to_all_single's split sizes say (none: evenly)."""
    rows = list(sizes) if sizes else [t.shape[0] // world] * world
    return list(torch.split(t, rows))


# ---------------------------------------------------------------------- a default group per rank thread
class _RankDefaults:
    """torch's world object, with a default group per rank thread.

    Stands in for ``torch.distributed.distributed_c10d._world``: a thread whose job communicator has
    a group reads that group as its default (``dist.get_rank()``, ``GroupMember.WORLD``, a
    DeviceMesh's global ranks); every other thread, and every other table, is torch's own."""

    def __init__(self, shared: Any) -> None:
        object.__setattr__(self, "_shared", shared)
        object.__setattr__(self, "_defaults", weakref.WeakKeyDictionary())
        object.__setattr__(self, "_lock", threading.Lock())

    def _mine(self) -> TorchGroup | None:
        defaults: weakref.WeakKeyDictionary[threading.Thread, TorchGroup] = self._defaults
        return defaults.get(threading.current_thread())

    def set_thread_default(self, group: TorchGroup) -> None:
        with self._lock:
            self._defaults[threading.current_thread()] = group

    def drop_default(self, group: TorchGroup) -> None:
        with self._lock:  # (a communicator may be closed from another thread than its rank's)
            for thread in [t for t, g in self._defaults.items() if g is group]:
                del self._defaults[thread]

    @property
    def default_pg(self) -> Any:
        mine = self._mine()
        return self._shared.default_pg if mine is None else mine

    @default_pg.setter
    def default_pg(self, value: Any) -> None:
        if self._mine() is None:
            self._shared.default_pg = value
        elif value is None:  # (torch's destroy_process_group in a rank thread: its job group goes too)
            with self._lock:
                self._defaults.pop(threading.current_thread(), None)
        else:
            raise RuntimeError(f"this thread is a rank of a {BACKEND} world: its default group is its communicator's")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shared, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._shared, name, value)


_install_lock = threading.Lock()


def _install() -> _RankDefaults:
    """torch's world object wrapped (once; where torch's world was replaced since, that one)."""
    with _install_lock:
        world = c10d._world
        if isinstance(world, _RankDefaults):
            return world
        mine = _RankDefaults(world)
        c10d._world = mine  # type: ignore[assignment]
        return mine
