"""Module-level helpers with the reference's names, delegating to ``current()``.

``import distcomm as comm`` runs code written against the reference's functions unchanged.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
import torch.distributed as dist

from ._communicator import Communicator
from ._context import active, current
from ._handles import Handle
from ._ops import ReduceOpLike, op_name
from ._torch import GlooCommunicator, NcclCommunicator

__all__ = [
    "all_gather",
    "all_gather_tensor",
    "all_reduce",
    "all_reduce_dict",
    "all_reduce_object",
    "all_to_all",
    "barrier",
    "broadcast",
    "broadcast_tensor",
    "create_local_process_group",
    "gather",
    "gather_in_order",
    "get_local_process_group",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
    "irecv",
    "is_main_process",
    "isend",
    "main_process_first",
    "recv",
    "reduce",
    "reduce_dict",
    "reduce_object",
    "reduce_scatter_tensor",
    "scan",
    "exscan",
    "scatter",
    "send",
    "shard",
    "shared_random_seed",
    "synchronize",
]


def _dist_on() -> bool:
    return active() is None and dist.is_available() and dist.is_initialized()


def get_world_size(group: Any = None) -> int:
    """Number of ranks of the active communicator (1 without one), or of ``group``."""
    if group is not None:
        return _for_group(group).world_size
    return dist.get_world_size() if _dist_on() else current().world_size


def get_rank(group: Any = None) -> int:
    """This process's rank in the active communicator (0 without one), or in ``group``."""
    if group is not None:
        return _for_group(group).rank
    return dist.get_rank() if _dist_on() else current().rank


def get_local_rank() -> int:
    """This process's rank on its machine.

    Without an installed communicator this reads torchrun's LOCAL_RANK; failing that it adopts
    the default group, which is collective.
    """
    if _dist_on() and "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"])
    return current().local_rank


def get_local_size() -> int:
    """Number of ranks on this process's machine (see get_local_rank)."""
    if _dist_on() and "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    return current().local_size


def create_local_process_group(num_workers_per_machine: int) -> None:
    """Group ranks by machine as ``rank // num_workers_per_machine`` (for processes started
    without launch() or torchrun). Collective; see Communicator.create_local_groups."""
    current().create_local_groups(num_workers_per_machine)


def get_local_process_group() -> Any:
    """The torch process group of the ranks on this machine (None in a world without one)."""
    return current().local_group


def is_main_process() -> bool:
    """True on rank 0."""
    return get_rank() == 0


def synchronize(group: Any = None) -> None:
    """Barrier over the active communicator (or ``group``). Every rank must call it."""
    _for_group(group).synchronize()


def barrier(group: Any = None) -> None:
    """torch's and mmengine's name for ``synchronize``."""
    _for_group(group).synchronize()


def _for_group(group: Any) -> Communicator:
    comm = current()
    if group is None or group is getattr(comm, "group", None):
        return comm
    # A communicator over another group, kept (and closed) by the active communicator; created
    # collectively by every member of that group on first use.
    sub = comm._children.get(group)
    if sub is None:
        kwargs: dict[str, Any] = {"timeout": comm.timeout, "serializer": comm.serializer, "max_bytes": comm.max_bytes}
        if "nccl" in str(dist.get_backend(group)).lower():  # its tensor collectives run where the group runs
            device = getattr(comm, "device", None)
            sub = NcclCommunicator(group, device=device if getattr(device, "type", "") == "cuda" else None, **kwargs)
        else:
            sub = GlooCommunicator(group, **kwargs)
        comm._children[group] = sub
    return sub


def all_gather(data: Any, group: Any = None) -> list[Any]:
    """Gather ``data`` from every rank on every rank (see Communicator.all_gather)."""
    return _for_group(group).all_gather(data)


def gather_in_order(results: Sequence[Any], size: int | None = None, sharding: str = "contiguous", dst: int = 0,
                    group: Any = None) -> list[Any] | None:
    """Every rank's results on ``dst`` in dataset order; None elsewhere (see Communicator.gather_in_order)."""
    return _for_group(group).gather_in_order(results, size=size, sharding=sharding, dst=dst)  # type: ignore[arg-type]


def shard(size: int, sharding: Literal["contiguous", "interleaved"] = "contiguous", group: Any = None) -> range:
    """This rank's indices of a dataset of ``size`` items (see Communicator.shard)."""
    return _for_group(group).shard(size, sharding=sharding)


def main_process_first(local: bool = False, timeout: float | datetime.timedelta | None = None,
                       group: Any = None) -> AbstractContextManager[None]:
    """A block that runs on the main process first, then on the others (see Communicator.main_process_first)."""
    return _for_group(group).main_process_first(local=local, timeout=timeout)


def gather(data: Any, dst: int = 0, group: Any = None) -> list[Any]:
    """Gather ``data`` from every rank on ``dst``; ``[]`` elsewhere (see Communicator.gather)."""
    return _for_group(group).gather(data, dst)


def broadcast(obj: Any = None, src: int = 0, group: Any = None) -> Any:
    """Send ``obj`` from ``src`` to every rank (see Communicator.broadcast)."""
    return _for_group(group).broadcast(obj, src)


def scatter(objs: Sequence[Any] | None = None, src: int = 0, group: Any = None) -> Any:
    """Send ``objs[r]`` from ``src`` to rank r (see Communicator.scatter)."""
    return _for_group(group).scatter(objs, src)


def shared_random_seed(group: Any = None) -> int:
    """An int in [0, 2**31) that is the same on every rank. Every rank must call it."""
    return _for_group(group).shared_random_seed()


def reduce_dict(input_dict: Mapping[Any, Any], average: bool | ReduceOpLike = True, group: Any = None, *,
                op: ReduceOpLike | None = None) -> dict[Any, Any]:
    """Sum or average a dict of scalar tensors (or numbers) onto rank 0 (see Communicator.reduce_dict).

    mmengine's spelling, an op in second place (``reduce_dict(d, "mean")``), works too."""
    average, op = _average_or_op(average, op)
    return _for_group(group).reduce_dict(input_dict, average, op=op)


def all_reduce_dict(input_dict: Mapping[Any, Any], average: bool | ReduceOpLike = True, group: Any = None, *,
                    op: ReduceOpLike | None = None) -> dict[Any, Any]:
    """Sum or average a dict of scalar tensors (or numbers) onto every rank; ``op``: "sum", "mean",
    "max" or "min", also in second place as mmengine's ``all_reduce_dict(data, "mean")``."""
    average, op = _average_or_op(average, op)
    return _for_group(group).all_reduce_dict(input_dict, average, op=op)


def _average_or_op(average: bool | ReduceOpLike, op: ReduceOpLike | None) -> tuple[bool, ReduceOpLike | None]:
    if isinstance(average, bool) or (not isinstance(average, str) and op_name(average) is None):
        return average, op  # type: ignore[return-value]  # (not a bool: reduce_dict refuses it)
    if op is not None:  # mmengine's all_reduce_dict(data, op), with an op= too
        raise TypeError(f"the op was given twice: {average!r} and op={op!r}")
    return True, average


# Tensor collectives and object reductions: see the Communicator methods of the same names.
def all_reduce(tensor: torch.Tensor, op: ReduceOpLike = "sum", group: Any = None, *,
               check: bool = True) -> torch.Tensor:
    """Reduce ``tensor`` in place on every rank of the active communicator (or ``group``); returns it."""
    return _for_group(group).all_reduce(tensor, op, check=check)


def reduce(tensor: torch.Tensor, dst: int = 0, op: ReduceOpLike = "sum", group: Any = None, *,
           check: bool = True) -> torch.Tensor:
    """Reduce ``tensor`` in place onto ``dst``; returns it."""
    return _for_group(group).reduce(tensor, dst, op, check=check)


def broadcast_tensor(tensor: torch.Tensor, src: int = 0, group: Any = None, *, check: bool = True) -> torch.Tensor:
    """Copy ``src``'s tensor into every rank's ``tensor``; returns it."""
    return _for_group(group).broadcast_tensor(tensor, src, check=check)


def all_gather_tensor(tensor: torch.Tensor, group: Any = None, *, check: bool = True) -> torch.Tensor:
    """Every rank's tensor concatenated along dim 0, in rank order."""
    return _for_group(group).all_gather_tensor(tensor, check=check)


def reduce_scatter_tensor(tensor: torch.Tensor, op: ReduceOpLike = "sum", group: Any = None, *,
                          check: bool = True) -> torch.Tensor:
    """Reduce ``tensor`` across ranks; rank r gets the r-th slice of dim 0."""
    return _for_group(group).reduce_scatter_tensor(tensor, op, check=check)


def reduce_object(obj: Any, op: str | Callable[[Any, Any], Any], dst: int = 0, group: Any = None) -> Any:
    """Reduce every rank's object in rank order onto ``dst`` (None elsewhere)."""
    return _for_group(group).reduce_object(obj, op, dst)


def all_reduce_object(obj: Any, op: str | Callable[[Any, Any], Any], group: Any = None) -> Any:
    """Reduce every rank's object in rank order, result on every rank."""
    return _for_group(group).all_reduce_object(obj, op)


def scan(obj: Any, op: str | Callable[[Any, Any], Any], group: Any = None) -> Any:
    """Rank r gets the reduction of ranks 0..r's objects."""
    return _for_group(group).scan(obj, op)


def exscan(obj: Any, op: str | Callable[[Any, Any], Any], group: Any = None) -> Any:
    """Rank r gets the reduction of ranks 0..r-1's objects (rank 0: None)."""
    return _for_group(group).exscan(obj, op)


def all_to_all(objs: Sequence[Any], group: Any = None) -> list[Any]:
    """Send ``objs[d]`` to rank d; returns what each rank sent this one, by source."""
    return _for_group(group).all_to_all(objs)


# Point-to-point objects: see the Communicator methods of the same names (not collective).
def send(obj: Any, dst: int, group: Any = None, *, tag: int = 0) -> None:
    """Send ``obj`` to rank ``dst``; it receives it with ``recv(src, tag=tag)``."""
    _for_group(group).send(obj, dst, tag=tag)


def recv(src: int, group: Any = None, *, tag: int = 0) -> Any:
    """The next object rank ``src`` sends this rank with ``tag``."""
    return _for_group(group).recv(src, tag=tag)


def isend(obj: Any, dst: int, group: Any = None, *, tag: int = 0) -> Handle[None]:
    """``send`` without waiting: a Handle."""
    return _for_group(group).isend(obj, dst, tag=tag)


def irecv(src: int, group: Any = None, *, tag: int = 0) -> Handle[Any]:
    """``recv`` without waiting: a Handle whose ``wait()`` returns the object."""
    return _for_group(group).irecv(src, tag=tag)
