"""What users of accelerate and Lightning Fabric reach for, on any communicator: a rank's shard of a
dataset (matching ``gather_in_order``), ``main_process_first`` (one process builds a cache while
the others wait), and a print on the main process only.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import weakref
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal

from ._errors import CollectiveError
from ._ordering import gather_in_order, results_problem, shard_range
from ._transfer.transport import front_door

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["ObjectConveniences", "main_process_first", "print_main", "shard"]


def shard(comm: Communicator, size: int, sharding: Literal["contiguous", "interleaved"]) -> range:
    """This rank's indices of ``range(size)``, as ``gather_in_order`` takes them (the same checks)."""
    problem = results_problem((), size, sharding) if size is not None else "size must be an int >= 0, got None"
    if problem is not None:
        raise ValueError(f"shard: {problem.replace(' or None', '')}")
    return shard_range(int(size), comm.world_size, comm.rank, sharding)


_INSIDE: weakref.WeakSet[Communicator] = weakref.WeakSet()
"""Communicators inside a main_process_first block (nesting is refused: see below)."""


@contextlib.contextmanager
def main_process_first(comm: Communicator, local: bool,
                       timeout: float | datetime.timedelta | None) -> Iterator[None]:
    """The block runs on the main process (rank 0; with ``local``, local rank 0 of each machine)
    first, then on the others at once: one all_gather, which the first ones enter after their
    block and the others before theirs. If the block raises there, the others raise too, naming
    it, instead of running a block whose cache was never built. Nested blocks are refused on every
    rank before any call: their all_gathers would pair the wrong levels across ranks."""
    if not isinstance(local, bool):
        raise TypeError(f"local must be a bool, got {type(local).__name__}")
    if comm in _INSIDE:
        raise RuntimeError("main_process_first blocks don't nest (on the same communicator)")
    first = (comm.local_rank if local else comm.rank) == 0
    _INSIDE.add(comm)
    try:
        if not first:
            _raise_if_failed(comm.all_gather(None, timeout=timeout), skipped=True)
            yield
            return
        try:
            yield
        except GeneratorExit:  # a generator around the block was closed: the block ended, as planned
            comm.all_gather(None, timeout=timeout)
            raise
        except Exception as e:  # (an interrupt is not waited on: the peers see this process end)
            comm.all_gather(f"{type(e).__name__}: {e}", timeout=timeout)
            raise
        _raise_if_failed(comm.all_gather(None, timeout=timeout), skipped=False)
    finally:
        _INSIDE.discard(comm)


def _raise_if_failed(outcomes: list[Any], skipped: bool) -> None:
    failed = [(r, text) for r, text in enumerate(outcomes) if text is not None]
    if failed:
        r, text = failed[0]
        raise CollectiveError(f"main_process_first: rank {r} raised inside the block ({text})"
                              + ("; this rank skipped it" if skipped else ""),
                              op="main_process_first", ranks=[r for r, _ in failed])


def print_main(comm: Communicator, *objects: Any, **kwargs: Any) -> None:
    if comm.is_main_process:
        builtins.print(*objects, **kwargs)


class ObjectConveniences:
    """The front door's conveniences: results back in dataset order, a rank's shard, a block the
    main process runs first, a print on it alone (``Communicator`` inherits them; ``self`` is always one)."""

    def gather_in_order(self, results: Sequence[Any], *, size: int | None = None,
                        sharding: Literal["contiguous", "interleaved"] = "contiguous", dst: int = 0,
                        timeout: float | datetime.timedelta | None = None) -> list[Any] | None:
        """Every rank's ``results`` (its shard of a dataset, in its shard's order) on ``dst`` as one
        list in dataset order; None on the other ranks. The evaluation step after sharded inference.

        ``sharding``: how the ranks' indices were drawn: "contiguous" (rank r one block of
        consecutive indices, the blocks in rank order: detectron2's InferenceSampler) or
        "interleaved" (rank r: r, r + world_size, ...: torch's DistributedSampler and mmengine's
        DefaultSampler without shuffling). ``size``: the dataset's length; where given, the result
        has exactly ``size`` entries, and the padding DistributedSampler adds with drop_last=False
        (its first indices again, on the last ranks) is dropped. Results that are None keep their
        place. Every rank must call it; counts of results that ``sharding`` of ``size`` can't give,
        an unknown sharding or ranks that pass different ones raise the same error on every rank,
        before the results move.
        """
        comm = front_door(self)
        comm._check_usable()
        comm._check_root("dst", dst)
        return gather_in_order(comm, results, size, sharding, int(dst), comm._op_timeout(timeout))

    def shard(self, size: int, *, sharding: Literal["contiguous", "interleaved"] = "contiguous") -> range:
        """This rank's indices of a dataset of ``size`` items: "contiguous" (one block, the blocks in
        rank order, sizes differing by at most one) or "interleaved" (``rank, rank + world_size, ...``).
        Every index is on exactly one rank; ``gather_in_order`` with the same ``sharding`` and ``size``
        brings the results back in dataset order. No communication."""
        comm = front_door(self)
        return shard(comm, size, sharding)

    def main_process_first(self, *, local: bool = False,
                           timeout: float | datetime.timedelta | None = None) -> AbstractContextManager[None]:
        """A block that runs on rank 0 first (``local``: on local rank 0 of each machine), then on
        the other ranks: a download or a cache one process builds and the others read. If it raises
        on the main process, the others raise ``CollectiveError`` naming it instead of running it.
        Every rank must enter it; ``timeout``: how long the others wait for the main one's block."""
        comm = front_door(self)
        return main_process_first(comm, local, timeout)

    def print(self, *objects: Any, **kwargs: Any) -> None:
        """``print`` on the main process (rank 0) only: one copy of a message, not one per rank."""
        comm = front_door(self)
        print_main(comm, *objects, **kwargs)
