"""What users of accelerate and Lightning Fabric reach for, on any communicator: a rank's shard of a
dataset (matching ``gather_in_order``), ``main_process_first`` (one process builds a cache while
the others wait), and a print on the main process only.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from ._errors import CollectiveError
from ._ordering import results_problem, shard_range

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["main_process_first", "print_main", "shard"]


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
