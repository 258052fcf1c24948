"""Sharded state (DTensors: FSDP2, tensor parallelism) as the state calls see it.

A DTensor's local shard differs from rank to rank: two ranks can only hold the same state where
they hold the same shards. A rank's *shard class* says which: the layout of every DTensor in its
state, with the part of each that its shard covers (its local shape and global offset). Ranks of
one class (in HSDP, the ranks of one shard coordinate across the replicas) hold, or should hold,
the same shards; the shards of different classes are never compared, nor copied into each other
(what isn't a shard, the state's replicated part, is compared across every class: ``_state``). Plain
state puts every rank in one class.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["class_key", "is_dtensor", "layout_of", "like", "local_of", "settle"]

_DTensor: Any = None
_local_part: Any = None
try:
    from torch.distributed.tensor import DTensor as _DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset as _local_part
except ImportError:  # (a torch built without distributed: no DTensors anywhere)
    pass


def is_dtensor(value: Any) -> bool:
    return _DTensor is not None and isinstance(value, _DTensor)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``, detached: a DTensor's local shard (its own memory), else ``t``."""
    return t.detach().to_local() if is_dtensor(t) else t.detach()  # type: ignore[attr-defined]


def layout_of(dt: Any) -> str:
    """A DTensor's layout, as text alike on every rank that shares it: its mesh (the ranks and the
    names of its dimensions), placements, global shape and stride."""
    mesh = dt.device_mesh
    return (f"mesh {mesh.device_type} {mesh.mesh.tolist()} {mesh.mesh_dim_names} {tuple(dt.placements)} "
            f"{tuple(dt.shape)} {dt.stride()}")


def _shard_of(dt: Any) -> str:
    """Its layout and the part this rank's shard covers."""
    assert _local_part is not None
    shape, offset = _local_part(dt.shape, dt.device_mesh, dt.placements)
    return f"{layout_of(dt)} local {tuple(shape)} at {tuple(offset)}"


def class_key(tensors: Iterable[Any]) -> bytes:
    """This rank's shard class, from the tensors of its state (and its optimizers' parameters, so
    that a newcomer's Adam without moments yet has the class of its parameters): the set of its
    DTensors' shards, as a digest; empty for state without DTensors."""
    shards = sorted({_shard_of(t) for t in tensors if is_dtensor(t)})
    if not shards:
        return b""
    return hashlib.sha256("\n".join(shards).encode()).digest()[:16]


def like(model: Any, local: torch.Tensor) -> Any:
    """A DTensor laid out as ``model`` (a DTensor of this rank's) over ``local``, this rank's shard."""
    assert _DTensor is not None
    return _DTensor.from_local(local, model.device_mesh, model.placements, run_check=False, shape=model.shape,
                               stride=model.stride())


def local_shape(model: Any) -> tuple[int, ...]:
    """The shape of this rank's shard of a DTensor laid out as ``model``."""
    assert _local_part is not None
    return tuple(_local_part(model.shape, model.device_mesh, model.placements)[0])


def settle(objects: Iterable[Any]) -> None:
    """Put each FSDP2 model among ``objects`` (the module ``fully_shard`` was applied to last) back
    between steps. A step that a lost rank broke leaves it mid-forward or mid-backward, parameters
    unsharded and hooks half run; its next forward would then skip collectives its peers run, or
    run others. Torch's ``reset_iter_state`` undoes that; the broken step's gradients go too (the
    step is lost: the next one starts from none)."""
    for obj in objects:
        state = getattr(obj, "_get_fsdp_state", None)
        if state is None or not hasattr(obj, "reset_iter_state") or state()._is_root is not True:
            continue  # (not FSDP's, or not yet run: nothing to undo)
        obj.reset_iter_state()
        for p in obj.parameters():
            p.grad = None
