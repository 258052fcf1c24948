"""gather_in_order: every rank's results over its shard of a dataset, back on one rank in dataset
order (the evaluation step after a sharded inference loop).

Two shardings, as the common samplers make them:

- ``"contiguous"``: rank r evaluates one block of consecutive indices, the blocks in rank order
  (detectron2's InferenceSampler: ``size // world`` each, the first ``size % world`` ranks one
  more; an older ceil(size / world) split is contiguous too). The dataset order is the ranks'
  results end to end.
- ``"interleaved"``: rank r evaluates r, r + world, r + 2 world, ... (torch's DistributedSampler
  and mmengine's DefaultSampler without shuffling). With ``drop_last=False`` (round_up) they pad
  every rank to ceil(size / world) indices by repeating the first ones; the padding lands past
  ``size`` in the interleaved order and is dropped when ``size`` is given.

Each rank's count of results is checked first, in a header-only exchange (every rank's count
rides in its slot), so counts that no sharding of ``size`` gives raise the same error on every rank
before anything large moves; then the results go to ``dst`` in one gather. Results that are None
are kept in their place.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._agreement import digest_of, odd_ones
from ._calls import CallSpec, Op
from ._errors import CollectiveError, CollectiveMismatchError

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["SHARDINGS", "counts_problem", "dataset_order", "gather_in_order", "results_problem", "shard_indices",
           "shard_range"]

SHARDINGS = ("contiguous", "interleaved")

_LABEL = Op.GATHER_IN_ORDER.label


def shard_range(size: int, world: int, rank: int, sharding: str) -> range:
    """The dataset indices rank ``rank`` of ``world`` evaluates under ``sharding``, as the samplers
    above make them without padding (``Communicator.shard``)."""
    if sharding == "contiguous":
        base, extra = divmod(size, world)
        begin = rank * base + min(rank, extra)
        return range(begin, begin + base + (rank < extra))
    if sharding != "interleaved":
        raise ValueError(f"sharding must be one of {', '.join(map(repr, SHARDINGS))}, got {sharding!r}")
    return range(rank, size, world)


def shard_indices(size: int, world: int, rank: int, sharding: str, *, padded: bool = False) -> list[int]:
    """``shard_range`` as a list; ``padded``: interleaved, padded as DistributedSampler with
    drop_last=False."""
    if not padded or size == 0 or sharding != "interleaved":
        return list(shard_range(size, world, rank, sharding))
    total = -(-size // world) * world
    return [i % size for i in range(rank, total, world)]  # the padding repeats the first indices


def counts_problem(counts: Sequence[int], size: int | None, sharding: str) -> str | None:
    """Why every rank's count of results (``counts``, by rank) can't be ``sharding`` of a dataset of
    ``size`` (None: of their sum); None when they can."""
    world, total = len(counts), sum(counts)
    n = total if size is None else size
    got = ", ".join(f"rank {r}: {c}" for r, c in enumerate(counts))
    if sharding == "contiguous":
        if total == n:
            return None
        return (f"{_LABEL}: the ranks hold {total} results in all ({got}), not the {n} of size={n}; a contiguous "
                f"sharding gives every index to one rank")
    plain = [len(range(r, n, world)) for r in range(world)]
    each = -(-n // world)
    if list(counts) == plain or (size is not None and all(c == each for c in counts)):
        return None
    padded = f" or {each} on every rank (padded, as DistributedSampler with drop_last=False)" if size is not None \
        else "; pass size= where a sampler padded them"
    return (f"{_LABEL}: the ranks' counts of results ({got}) can't be an interleaved sharding of {n} indices: "
            f"expected {plain} (rank r: r, r + {world}, ...){padded}")


def dataset_order(parts: Sequence[Sequence[Any]], size: int | None, sharding: str) -> list[Any]:
    """Every rank's results (``parts``, by rank, each in its shard's order) in dataset order, the
    first ``size`` (None: all); the counts as ``counts_problem`` accepts them."""
    world = len(parts)
    if sharding == "contiguous":
        return [x for p in parts for x in p]
    n = sum(len(p) for p in parts) if size is None else size
    return [parts[i % world][i // world] for i in range(n)]


def results_problem(results: Any, size: Any, sharding: Any) -> str | None:
    """What is wrong with this rank's arguments (None: nothing), reported on every rank."""
    if sharding not in SHARDINGS:
        return f"sharding must be one of {', '.join(map(repr, SHARDINGS))}, got {sharding!r}"
    if size is not None and (isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0):
        return f"size must be an int >= 0 (the dataset's length) or None, got {size!r}"
    if isinstance(results, (str, bytes, dict)) or not isinstance(results, (Sequence, torch.Tensor, np.ndarray)):
        return f"results must be a sequence (this rank's results, in its shard's order), got {type(results).__name__}"
    if isinstance(results, (torch.Tensor, np.ndarray)) and results.ndim == 0:
        return "results must be a sequence (this rank's results, in its shard's order), got a 0-d array"
    return None


def gather_in_order(comm: Communicator, results: Any, size: int | None, sharding: str, dst: int,
                    timeout: float | None) -> list[Any] | None:
    """Every rank's ``results`` on ``dst``, in dataset order (see the module); None elsewhere."""
    problem = results_problem(results, size, sharding)
    if comm._returns_at_once():
        if problem is None:
            problem = counts_problem([len(results)], size, sharding)
        if problem is not None:
            raise comm._world_of_one_error(Op.GATHER_IN_ORDER, problem)
        return dataset_order([results], size, sharding)
    n = None if size is None else int(size)
    asked = (sharding, n)
    word = struct.pack("<q", len(results) if problem is None else 0)
    counts = comm._run(CallSpec(Op.GATHER_IN_ORDER, dst, None, timeout, serialize=False, digest=digest_of(asked),
                                problem=problem, inline=word,
                                on_digest_mismatch=lambda: _mismatch(comm, dst, asked, timeout)))
    problem = counts_problem(counts, n, sharding)
    if problem is not None:  # every rank read the same counts: the same error everywhere
        raise CollectiveError(problem, op=_LABEL, ranks=list(range(comm.world_size)))
    parts = comm._run(CallSpec(Op.GATHER, dst, results, timeout, stat=Op.GATHER_IN_ORDER))
    if comm.rank != dst:
        return None
    return dataset_order(parts, n, sharding)


def _mismatch(comm: Communicator, dst: int, asked: tuple[str, int | None], timeout: float | None) -> None:
    """The ranks passed different shardings or sizes: every rank's, in one more exchange."""
    everyone = comm._run(CallSpec(Op.GATHER_IN_ORDER, dst, asked, timeout, stat=Op.GATHER_IN_ORDER))
    rows = "\n".join(f"  rank {r}: sharding={s!r}, size={n!r}" for r, (s, n) in enumerate(everyone))
    raise CollectiveMismatchError(f"{_LABEL}: the ranks passed different shardings or sizes:\n{rows}", op=_LABEL,
                                  ranks=odd_ones(everyone))
