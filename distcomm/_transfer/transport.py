"""The transport hooks: the handful of methods through which every family of collectives moves
bytes. A transport (GlooCommunicator, NcclCommunicator, LocalCommunicator, the test doubles)
implements ``rank``, ``world_size``, ``_exchange`` (point to point), ``_reduce_tensor`` and
``_make_sub``; it may replace the defaults of the others (which go through ``_exchange``, see
``_p2p``) with native collectives. ``Communicator`` (the front door) inherits them."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

from .._calls import Op
from .._tensors import all_gather_by_gathering, broadcast_by_gathering, reduce_by_gathering, reduce_scatter_by_gathering
from . import p2p as _p2p
from .routes.broadcast import tree_send

if TYPE_CHECKING:
    from .._communicator import Communicator

__all__ = ["TransportHooks", "front_door"]


def front_door(part: object) -> Communicator:
    """The communicator a part of the front door belongs to (``TransportHooks`` and the other classes
    ``Communicator`` inherits from are only ever one), typed as such for the families' functions."""
    return cast("Communicator", part)


class TransportHooks(abc.ABC):
    if TYPE_CHECKING:  # what the hooks' defaults use of the front door
        @property
        def world_size(self) -> int: ...
        @property
        def device(self) -> torch.device: ...
        def _count(self, sent: int, received: int) -> None: ...

    # What a transport must provide: ``rank``, ``world_size``, ``_exchange``, ``_reduce_tensor``,
    # ``_make_sub``. What it may replace (defaults over ``_exchange``): the rest of this section.
    @abc.abstractmethod
    def _exchange(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], timeout: float | None
    ) -> None:
        """Send each (dst, tensor) and receive each (src, tensor) concurrently, in list order per pair."""

    @abc.abstractmethod
    def _reduce_tensor(self, tensor: torch.Tensor, dst: int | None, timeout: float | None) -> None:
        """Sum ``tensor`` in place across ranks, onto ``dst`` (None: onto every rank)."""

    def _make_sub(self, groups: list[list[int]], mine: list[int] | None, timeout: float | None) -> Communicator | None:
        """Create a communicator for each group (every rank, the same order); return this rank's."""
        raise NotImplementedError(f"{type(self).__name__} can't create sub-communicators")

    def _exchange_counted(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], timeout: float | None
    ) -> None:
        """``_exchange``, with what it moves added to this collective's counters."""
        self._count(sum(t.numel() for _, t in sends), sum(t.numel() for _, t in recvs))
        self._exchange(sends, recvs, timeout)

    def _exchange_slots(self, slot: bytearray, size: int, timeout: float | None,
                        carry: Sequence[memoryview] = (), own: Sequence[bytearray] = ()) -> tuple[memoryview, Any]:
        """The pipeline's first exchange: every rank's slot (``_allgather_slots``), and what the
        exchange learnt of how alike they are, for ``_frame.agreed``: (k, c), every slot but slot k
        (-1: none) is c, byte for byte; None where it learnt nothing (this default).

        ``carry``: on a broadcast's root, the segments that follow its slot. A transport whose
        exchange ends in a broadcast from the root may send them with it (``_carried`` says where
        they went); this default doesn't.
        ``own``: in small worlds, on a scatter's root, the slot of each rank's part: rank r receives
        ``own[r]`` where the others receive ``slot``."""
        return self._allgather_slots(slot, size, timeout, own), None

    def _carried(self, root: int, total: int) -> memoryview | None:
        """The ``total`` bytes of ``root``'s broadcast segments where the last ``_exchange_slots``
        brought them along (a view that lasts until the next exchange), on every rank the same
        answer; None: they weren't, and go in ``_broadcast_buffer``. This default carries nothing."""
        return None

    def _allgather_slots(self, slot: bytearray, size: int, timeout: float | None,
                         own: Sequence[bytearray] = ()) -> memoryview:
        """Every rank's slot of ``size`` bytes, in rank order, flat (``own``: see ``_exchange_slots``):
        Bruck's all-gather over point to point beyond small worlds (see ``_p2p.allgather_slots``)."""
        return _p2p.allgather_slots(front_door(self), slot, size, timeout, own)

    def _allgather_small(self, slot: bytearray, size: int, timeout: float | None,
                         own: Sequence[bytearray] = ()) -> memoryview:
        """The small-world slot exchange (``own``: see ``_exchange_slots``); this default sends the
        slot to every peer point to point."""
        return _p2p.allgather_small(front_door(self), slot, size, timeout, own)

    def _alltoallv(
        self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor, recv_counts: list[int],
        timeout: float | None,
    ) -> None:
        """Send ``send_counts[r]`` bytes of ``send`` to each rank r and receive ``recv_counts[r]``
        bytes from each rank r into ``recv``, chunks in rank order. Every rank calls it."""
        _p2p.alltoallv(front_door(self), send, send_counts, recv, recv_counts, timeout)

    def _scatter_slots(self, root: int, subs: list[bytearray], size: int, timeout: float | None) -> torch.Tensor | None:
        """The root's ``subs[r]`` (``size`` bytes each) to each rank r; returns what this rank
        received (None on the root)."""
        return _p2p.scatter_slots(front_door(self), root, subs, size, timeout)

    def _broadcast_buffer(self, buf: torch.Tensor, root: int, timeout: float | None) -> None:
        """Copy the root's ``buf`` into every rank's (every rank's is the same size). Here a binary
        tree of point-to-point messages; transports with a native broadcast use it instead."""
        tree_send(front_door(self), [buf], root, timeout)

    _agrees_by_reduction = False
    """Whether every collective starts with ``_agreement_sums`` (see ``_agreement``): for transports
    whose reductions are cheap beside their slots' exchange (NCCL, whose slots cross machines over
    gloo). Agreement-only calls then make no exchange when every rank agrees."""

    def _agreement_sums(self, vector: list[int], timeout: float | None) -> list[int]:
        """The elementwise sum over ranks of ``vector`` (the same length on every rank), exactly."""
        work = torch.tensor(vector, dtype=torch.int64, device=self.device)
        self._count(*self._reduce_traffic(work, None, "sum"))
        self._tensor_reduce(work, None, "sum", timeout)
        return [int(x) for x in work.tolist()]

    def _device_barrier(self, timeout: float | None) -> None:  # noqa: B027 - optional hook
        """Wait for the device streams too (NCCL); nothing on CPU transports."""

    def _shutdown(self) -> None:  # noqa: B027 - optional hook
        """Release transport resources (groups this communicator created)."""

    def _send_message(self, dst: int, tag: int, parts: list[torch.Tensor], timeout: float | None) -> None:
        """Send ``parts`` to ``dst`` on ``tag``, in order (point-to-point objects, ``_messages``)."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point messages")

    def _recv_message(self, src: int, tag: int, bufs: list[torch.Tensor], timeout: float | None) -> None:
        """Receive the next parts ``src`` sends on ``tag`` into ``bufs`` (each of its part's exact size)."""
        raise NotImplementedError(f"{type(self).__name__} has no point-to-point messages")

    # The tensor transport. These defaults move every rank's tensor to every rank through
    # ``_gather_tensors`` (the test doubles' way); torch communicators run the native collectives.
    def _device_problem(self, tensor: torch.Tensor) -> str | None:
        """Why this transport can't take ``tensor``'s device (None: it can)."""
        return None

    def _unchecked_fast_path(self, op: Op, root: int, tensor: torch.Tensor,
                             reduce_op: str | None) -> torch.Tensor | None:
        """An unchecked all_reduce, broadcast_tensor or all_gather_tensor (check=False, the default
        timeout) in the fewest Python calls the transport allows: the hot path of training loops.
        It must do exactly what ``_tensors.run_tensor_op`` does (results, stats); None sends the
        call there. This default always does: the test doubles run ``run_tensor_op``."""
        return None

    def _gather_tensors(self, tensor: torch.Tensor, timeout: float | None) -> list[torch.Tensor]:
        """Every rank's tensor, in rank order (this rank's own included)."""
        raise NotImplementedError(f"{type(self).__name__} has no tensor transport")

    def _tensor_reduce(self, tensor: torch.Tensor, dst: int | None, op: str, timeout: float | None) -> None:
        """Reduce ``tensor`` in place onto ``dst`` (None: every rank); "mean" sums."""
        reduce_by_gathering(front_door(self), tensor, dst, op, timeout)

    def _reduce_traffic(self, tensor: torch.Tensor, dst: int | None, op: str) -> tuple[int, int]:
        """The bytes (sent, received) that ``_tensor_reduce`` of ``tensor`` with ``op`` moves on this
        rank, for the stats: by default a ring's, 2 (world - 1) / world of the values each way."""
        moved = 2 * (self.world_size - 1) * tensor.numel() * tensor.element_size() // self.world_size
        return moved, moved

    def _tensor_broadcast(self, tensor: torch.Tensor, src: int, timeout: float | None) -> None:
        broadcast_by_gathering(front_door(self), tensor, src, timeout)

    def _tensor_all_gather(self, out: torch.Tensor, tensor: torch.Tensor, rows: list[int],
                           timeout: float | None) -> None:
        all_gather_by_gathering(front_door(self), out, tensor, rows, timeout)

    def _tensor_reduce_scatter(self, out: torch.Tensor, tensor: torch.Tensor, op: str, timeout: float | None) -> None:
        reduce_scatter_by_gathering(front_door(self), out, tensor, op, timeout)
