"""torch.distributed's four object collectives, with torch 2.13's signatures, over the current communicator.

    from distcomm.compat.torch import all_gather_object, broadcast_object_list   # was: torch.distributed

Each fills the caller's list in place and returns None, as torch's do; ``src``/``dst`` are global
ranks and ``group_src``/``group_dst`` the group's, as in torch. The objects travel through
distcomm's pipeline: each rank's own size (no padding to the largest), and a rank whose object
can't be pickled, or whose list torch would refuse, makes every rank raise instead of leaving the
others waiting. What differs from torch: docs/migration.md.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

from .._calls import Op
from .._communicator import Communicator
from ._common import communicator, refuse, root_rank, translated

__all__ = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]


def _outside(group: Any, name: str) -> bool:
    """Whether this process is not in ``group`` (torch then warns and returns)."""
    if group is None or dist.get_rank(group) >= 0:
        return False
    warnings.warn(f"Running {name} on global rank {dist.get_rank()} which does not belong to the given group.",
                  stacklevel=4)
    return True


def _rooted(name: str, group: Any, rank: int | None, group_rank: int | None) -> tuple[Communicator, int] | None:
    """The communicator of ``group`` and the root as its rank; None off the group."""
    root = root_rank(group, rank, group_rank)  # (torch checks the roots first)
    return None if _outside(group, name) else (communicator(group), root)


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Gather ``obj`` from every rank into ``object_list`` (world_size long), on every rank.

    Args:
        object_list: the output list, filled in place by rank; this rank's entry is ``obj`` itself.
        obj: this rank's picklable object.
        group: a torch process group; None: the current communicator.
    """
    if _outside(group, "all_gather_object"):
        return
    for i, value in enumerate(translated(communicator(group).all_gather, obj, kind=ValueError)):
        object_list[i] = value


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: Any = None, group_dst: int | None = None) -> None:
    """Gather ``obj`` from every rank into ``object_gather_list`` on ``dst``.

    Args:
        obj: this rank's picklable object.
        object_gather_list: on the destination, the output list (world_size long), filled in place;
            elsewhere None (or empty). Otherwise every rank raises ValueError (torch: that rank only).
        dst: the destination's global rank (default 0).
        group: a torch process group; None: the current communicator.
        group_dst: the destination's rank in ``group`` (instead of ``dst``).
    """
    rooted = _rooted("gather_object", group, dst, group_dst)
    if rooted is None:
        return
    comm, root = rooted
    if comm.rank == root and not object_gather_list:
        refuse(comm, Op.GATHER, root, ValueError, "Argument ``gather_list`` must be specified on destination rank.")
    if comm.rank != root and object_gather_list:
        refuse(comm, Op.GATHER, root, ValueError,
               "Argument ``gather_list`` must NOT be specified on non-destination ranks.")
    gathered = translated(comm.gather, obj, root, kind=ValueError)
    if object_gather_list is not None:
        for i, value in enumerate(gathered):
            object_gather_list[i] = value


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                          device: torch.device | None = None, group_src: int | None = None) -> None:
    """Copy ``src``'s ``object_list`` items into every rank's list (of the same length), in place.

    Args:
        object_list: on ``src`` the objects; elsewhere a list of as many items, overwritten.
        src: the source's global rank (default 0).
        group: a torch process group; None: the current communicator.
        device: accepted for torch's signature; objects travel over the CPU, and tensors in them
            are rebuilt on the receiver's device.
        group_src: the source's rank in ``group`` (instead of ``src``).

    Raises:
        ValueError: on a rank whose list is not as long as ``src``'s (after the broadcast, which
            the other ranks complete).
    """
    rooted = _rooted("broadcast_object_list", group, src, group_src)
    if rooted is None:
        return
    comm, root = rooted
    got = translated(comm.broadcast, object_list if comm.rank == root else None, root, kind=ValueError)
    if comm.rank == root:
        return
    if len(got) != len(object_list):
        raise ValueError(f"broadcast_object_list: this rank's list has {len(object_list)} items and the source's "
                         f"{len(got)}; every rank must pass a list as long as the source's")
    object_list[:] = got


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: Any = None, group_src: int | None = None) -> None:
    """Send ``scatter_object_input_list[r]`` from ``src`` to rank r, into its output list's first item.

    Args:
        scatter_object_output_list: a list of at least one item; its first is overwritten.
        scatter_object_input_list: on ``src``, world_size picklable objects; read there only.
        src: the source's global rank (default 0).
        group: a torch process group; None: the current communicator.
        group_src: the source's rank in ``group`` (instead of ``src``).
    """
    rooted = _rooted("scatter_object_list", group, src, group_src)
    if rooted is None:
        return
    comm, root = rooted
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        refuse(comm, Op.SCATTER, root, ValueError,
               "Expected argument scatter_object_output_list to be a list of size at least 1.")
    if comm.rank == root and scatter_object_input_list is None:
        refuse(comm, Op.SCATTER, root, ValueError, "source rank must provide non-None scatter_object_input_list")
    scatter_object_output_list[0] = translated(comm.scatter, scatter_object_input_list, root, kind=ValueError)
