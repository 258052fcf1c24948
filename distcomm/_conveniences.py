"""What users of accelerate and Lightning Fabric reach for, on any communicator: a rank's shard of a
dataset (matching ``gather_in_order``), ``main_process_first`` (one process builds a cache while
the others wait), and a print on the main process only.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from ._errors import CollectiveError

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["main_process_first", "print_main", "shard", "shard_of"]


def shard_of(size: int, rank: int, world: int, sharding: Literal["contiguous", "interleaved"]) -> range:
    """Rank ``rank``'s indices of ``range(size)`` among ``world`` ranks.

    "contiguous": one block of consecutive indices, the blocks in rank order, ``size // world``
    each and one more on the first ``size % world`` ranks (detectron2's InferenceSampler).
    "interleaved": ``rank, rank + world, ...`` (torch's DistributedSampler without shuffling or
    padding). Either way every index is on exactly one rank, and ``gather_in_order`` with the same
    ``sharding`` and ``size`` puts the ranks' results back in dataset order."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ValueError(f"size must be an int >= 0 (the dataset's length), got {size!r}")
    if sharding == "interleaved":
        return range(rank, size, world)
    if sharding != "contiguous":
        raise ValueError(f"sharding must be 'contiguous' or 'interleaved', got {sharding!r}")
    each, extra = divmod(size, world)
    start = rank * each + min(rank, extra)
    return range(start, start + each + (rank < extra))


def shard(comm: Communicator, size: int, sharding: Literal["contiguous", "interleaved"]) -> range:
    return shard_of(size, comm.rank, comm.world_size, sharding)


@contextlib.contextmanager
def main_process_first(comm: Communicator, local: bool,
                       timeout: float | datetime.timedelta | None) -> Iterator[None]:
    """The block runs on the main process (rank 0; with ``local``, local rank 0 of each machine)
    first, then on the others at once. If it raises there, the others raise too, naming it, instead
    of running a block whose cache was never built."""
    first = (comm.local_rank if local else comm.rank) == 0
    if not first:
        outcomes = comm.all_gather(None, timeout=timeout)  # returns once the first ones are through
        _raise_if_failed(comm, outcomes)
        yield
        return
    try:
        yield
    except BaseException as e:
        comm.all_gather(f"{type(e).__name__}: {e}", timeout=timeout)
        raise
    _raise_if_failed(comm, comm.all_gather(None, timeout=timeout))


def _raise_if_failed(comm: Communicator, outcomes: list[Any]) -> None:
    failed = [(r, text) for r, text in enumerate(outcomes) if text is not None]
    if failed:
        r, text = failed[0]
        raise CollectiveError(f"main_process_first: rank {r} raised inside the block ({text}); this rank skipped it",
                              op="main_process_first", ranks=[r for r, _ in failed])


def print_main(comm: Communicator, *objects: Any, **kwargs: Any) -> None:
    if comm.is_main_process:
        builtins.print(*objects, **kwargs)
