"""LocalCommunicator: a world of one process, no torch.distributed needed."""

from __future__ import annotations

import torch

from ._communicator import Communicator

__all__ = ["LocalCommunicator"]


class LocalCommunicator(Communicator):
    """A communicator for a single process (world size 1).

    Every collective returns at once with what a one-rank world gives: ``all_gather(x) == [x]``,
    ``gather(x) == [x]``, ``broadcast(x) == x``, ``reduce_dict(d) == d``. Objects are returned
    as they are, not serialized: use ``distcomm.testing`` to exercise the serialization pipeline.
    """

    @property
    def rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def _exchange(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], timeout: float | None
    ) -> None:
        if sends or recvs:
            raise RuntimeError("LocalCommunicator has no peers to exchange with")

    def _reduce_tensor(self, tensor: torch.Tensor, dst: int | None, timeout: float | None) -> None:
        return None

    def _make_sub(self, groups: list[list[int]], mine: list[int] | None, timeout: float | None) -> Communicator | None:
        return None if mine is None else LocalCommunicator(**self._sub_settings(timeout))
