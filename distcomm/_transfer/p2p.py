"""The transport hooks' defaults, over point-to-point messages (``Communicator._exchange``): the
test doubles run these; the torch transports replace most with native collectives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .._wire import frame as _frame

if TYPE_CHECKING:
    from .._communicator import Communicator

__all__ = ["allgather_slots", "allgather_small", "alltoallv", "scatter_slots"]


def alltoallv(
    comm: Communicator, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor, recv_counts: list[int],
    timeout: float | None,
) -> None:
    """Send ``send_counts[r]`` bytes of ``send`` (chunks in rank order) to each rank r; receive
    ``recv_counts[r]`` bytes from each rank r into ``recv``, in rank order. Every rank calls it.

    This default moves each chunk point to point through ``_exchange``; transports with a
    native all-to-all override it.
    """
    sends, recvs = [], []
    out = inp = 0
    for r in range(comm.world_size):
        if send_counts[r]:
            sends.append((r, send[out : out + send_counts[r]]))
            out += send_counts[r]
        if recv_counts[r]:
            recvs.append((r, recv[inp : inp + recv_counts[r]]))
            inp += recv_counts[r]
    comm._exchange(sends, recvs, timeout)


def allgather_slots(comm: Communicator, slot: bytearray, size: int, timeout: float | None,
                     own: Sequence[bytearray] = ()) -> memoryview:
    """Every rank's slot of ``size`` bytes, in rank order, flat (``own``: see ``_exchange_slots``).

    Small worlds use the transport's one-step exchange (``allgather_small``). Larger ones run
    Bruck's all-gather over point to point: ceil(log2(world)) rounds, in round k each rank sends
    the slots it holds to rank - k and receives as many from rank + k. Every rank sends and
    receives (world - 1) slots in log2(world) messages, where an all-to-all takes world - 1.
    (The test doubles run this; the torch transports gather the slots in native collectives.)
    """
    world, me = comm.world_size, comm.rank
    if world <= _frame.SMALL_WORLD:
        comm._count(size * (world - 1), size * (world - 1))
        return comm._allgather_small(slot, size, timeout, own)
    if own:
        raise ValueError(f"slots of each rank's own are sent in worlds of up to {_frame.SMALL_WORLD} ranks")
    buf = torch.empty(world * size, dtype=torch.uint8)  # block j holds rank (me + j) % world
    view = memoryview(buf.numpy())  # type: ignore[arg-type]
    view[:size] = slot

    have = 1
    while have < world:
        n = min(have, world - have)
        comm._exchange_counted([((me - have) % world, buf[: n * size])],
                   [((me + have) % world, buf[have * size : (have + n) * size])], timeout)
        have += n
    first = (world - me) % world * size  # where rank 0's slot is
    return memoryview(bytes(view[first:]) + bytes(view[:first]))


def allgather_small(comm: Communicator, slot: bytearray, size: int, timeout: float | None,
                     own: Sequence[bytearray] = ()) -> memoryview:
    """The small-world slot exchange (``own``: see ``_exchange_slots``); this default sends the
    slot to every peer point to point."""
    world, me = comm.world_size, comm.rank
    out = torch.empty(world * size, dtype=torch.uint8)
    view = memoryview(out.numpy())  # type: ignore[arg-type]
    view[me * size : (me + 1) * size] = slot
    mine = torch.frombuffer(bytearray(slot), dtype=torch.uint8)
    peers = [r for r in range(world) if r != me]
    sends = [(r, torch.frombuffer(own[r], dtype=torch.uint8) if own else mine) for r in peers]
    comm._exchange(sends, [(r, out[r * size : (r + 1) * size]) for r in peers], timeout)
    return view


def scatter_slots(comm: Communicator, root: int, subs: list[bytearray], size: int,
                  timeout: float | None) -> torch.Tensor | None:
    """The root's ``subs[r]`` (``size`` bytes each) to each rank r: here a message per rank.
    Returns what this rank received (None on the root)."""
    if comm.rank == root:
        comm._exchange_counted([(r, torch.frombuffer(s, dtype=torch.uint8)) for r, s in enumerate(subs) if r != root],
                   [], timeout)
        return None
    buf = torch.empty(size, dtype=torch.uint8)
    comm._exchange_counted([], [(root, buf)], timeout)
    return buf
