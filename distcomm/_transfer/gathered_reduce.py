"""Small reductions over gloo as a gather on the root and a broadcast: the per-step reductions
(``reduce_dict``'s losses, a tensor ``all_reduce`` of a few hundred values).

gloo reduces in a ring: 2 (world - 1) messages in sequence per rank, whatever the size, where
for a few values each message's latency is the whole cost. A gather on the root (one message from
each rank), a fold there in rank order and gloo's binomial broadcast take 1 + log2(world) steps and
about as many bytes per rank (each rank sends its values once and receives the result once),
the root taking one message per rank. Kept to worlds of up to ``FLAT_WORLD`` ranks (where the
header exchange of hosts of one rank is one gather too), to values whose gather the root takes
at once (``GATHERED_REDUCE_BYTES``), and to other than a max or min of floats (``takes_gathered``
says why). Integers reduce exactly as in the ring; float sums differ from
the ring's in the last bits (the additions run in another order, the same on every rank), and
half-precision values stay in the ring, where each addition rounds to half precision (a fold on
the root would add in float32 and round once).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .._ops import fold_tensors, folds_as_ring
from .._wire import frame as _frame
from .header_exchange import FLAT_WORLD, binomial_children

if TYPE_CHECKING:
    from .._torch import _TorchCommunicator

__all__ = ["GATHERED_REDUCE_BYTES", "gathered_reduce", "gathered_traffic", "takes_gathered"]

GATHERED_REDUCE_BYTES = 8 << 10
"""Reductions of up to this many bytes per rank (a thousand float64 values) go through the root."""


def takes_gathered(comm: _TorchCommunicator, tensor: torch.Tensor, op: str) -> bool:
    """Whether ``gathered_reduce`` reduces ``tensor`` with ``op`` in this world: where a fold on the
    root gives what the ring gives (``folds_as_ring``), so that a result is torch's at every world size."""
    return (_frame.SMALL_WORLD < comm._world <= FLAT_WORLD and tensor.is_cpu and tensor.is_contiguous()
            and folds_as_ring(tensor.dtype, op) and tensor.numel() * tensor.element_size() <= GATHERED_REDUCE_BYTES)


def gathered_reduce(comm: _TorchCommunicator, tensor: torch.Tensor, dst: int | None, op: str,
                    timeout: float | None) -> None:
    """Reduce ``tensor`` in place onto ``dst`` (None: onto every rank) with ``op`` ("sum", "mean" as
    a sum, "max", "min", "prod"): the root folds every rank's values in the group's rank order."""
    world, me = comm._world, comm._rank
    root = 0 if dst is None else dst
    flat = tensor.view(-1)
    raw = flat.view(torch.uint8)  # as bytes: gloo's gather and broadcast take no complex or bool
    rows = torch.empty((world, raw.numel()), dtype=torch.uint8) if me == root else None
    outs = [list(rows.unbind(0))] if rows is not None else []
    at = comm._at(root)  # the root as the group numbers it (a split's keys may order the ranks otherwise)
    comm._native(comm._group.gather, (outs, [raw], comm._opts("GatherOptions", timeout, root=at)), timeout)
    if rows is not None:
        flat.copy_(fold_tensors(rows.view(flat.dtype).unbind(0), op))
    if dst is None:
        comm._native(comm._group.broadcast, ([raw], comm._opts("BroadcastOptions", timeout, root=at)), timeout)


def gathered_traffic(comm: _TorchCommunicator, tensor: torch.Tensor, dst: int | None) -> tuple[int, int]:
    """The bytes (sent, received) ``gathered_reduce`` moves on this rank: the gather's, then
    the broadcast's binomial tree's."""
    world, me = comm._world, comm._rank
    root = 0 if dst is None else dst
    n = tensor.numel() * tensor.element_size()
    sent, received = (0, (world - 1) * n) if me == root else (n, 0)
    if dst is None:
        v = (comm._at(me) - comm._at(root)) % world  # gloo's tree runs in the group's numbering
        sent += binomial_children(world, v) * n
        received += 0 if v == 0 else n
    return sent, received
