"""gather_in_order: predictions back on one rank in dataset order. The index arithmetic against the
samplers themselves (torch's DistributedSampler, detectron2's InferenceSampler split), then the
collective over real gloo processes and the test doubles."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DistributedSampler

import distcomm
from distcomm._ordering import counts_problem, dataset_order, shard_indices
from distcomm.testing import FakeCommunicator, run_threaded, spawn
from tests.test_faults import outcome

CASES = [(n, w) for w in (1, 2, 3, 4, 7) for n in (0, 1, 2, 3, 5, 10, 13, 16, 21)]


def detectron2_indices(total_size: int, world_size: int, rank: int) -> range:
    """detectron2's InferenceSampler._get_local_indices, as written there."""
    shard_size = total_size // world_size
    left = total_size % world_size
    shard_sizes = [shard_size + int(r < left) for r in range(world_size)]
    begin = sum(shard_sizes[:rank])
    end = min(sum(shard_sizes[: rank + 1]), total_size)
    return range(begin, end)


def torch_indices(n: int, w: int, r: int, drop_last: bool = False) -> list[int]:
    return list(DistributedSampler(range(n), num_replicas=w, rank=r, shuffle=False, drop_last=drop_last))


@pytest.mark.parametrize(("n", "w"), CASES)
def test_shards_are_the_samplers(n: int, w: int) -> None:
    for r in range(w):
        assert shard_indices(n, w, r, "contiguous") == list(detectron2_indices(n, w, r))
        assert shard_indices(n, w, r, "interleaved") == list(range(r, n, w))
        if n:  # torch's sampler can't pad an empty dataset
            assert shard_indices(n, w, r, "interleaved", padded=True) == torch_indices(n, w, r)


@pytest.mark.parametrize(("n", "w"), CASES)
def test_every_sharding_comes_back_in_dataset_order(n: int, w: int) -> None:
    shardings = [("contiguous", False, False), ("interleaved", False, False), ("interleaved", True, True)]
    for sharding, padded, needs_size in shardings:
        shards = [shard_indices(n, w, r, sharding, padded=padded) for r in range(w)]
        parts = [[("result of", i) for i in s] for s in shards]  # what each rank computed, in its shard's order
        counts = [len(p) for p in parts]
        assert counts_problem(counts, n, sharding) is None
        assert dataset_order(parts, n, sharding) == [("result of", i) for i in range(n)]
        if not needs_size or n % w == 0:  # nothing was padded: the counts alone say how many
            assert counts_problem(counts, None, sharding) is None
            assert dataset_order(parts, None, sharding) == [("result of", i) for i in range(n)]


def test_an_older_ceil_split_is_contiguous_too() -> None:
    n, w = 10, 4  # ceil(10 / 4) = 3: 3, 3, 3, 1
    parts = [list(range(r * 3, min(r * 3 + 3, n))) for r in range(w)]
    assert counts_problem([len(p) for p in parts], n, "contiguous") is None
    assert dataset_order(parts, n, "contiguous") == list(range(n))


def test_none_results_keep_their_place() -> None:
    # mmengine's collect_results drops None results (and shifts the rest): here they stay
    n, w = 7, 3
    parts = [[None if i % 3 == 0 else i for i in shard_indices(n, w, r, "interleaved", padded=True)] for r in range(w)]
    assert dataset_order(parts, n, "interleaved") == [None, 1, 2, None, 4, 5, None]
    parts = [[None] * len(shard_indices(n, w, r, "contiguous")) for r in range(w)]
    assert dataset_order(parts, n, "contiguous") == [None] * n


def test_counts_no_sharding_gives_are_named() -> None:
    text = counts_problem([3, 3, 3], 10, "contiguous")
    assert text is not None and "9 results in all (rank 0: 3, rank 1: 3, rank 2: 3), not the 10 of size=10" in text
    text = counts_problem([4, 3, 4], 10, "interleaved")
    assert text is not None and "expected [4, 3, 3]" in text and "or 4 on every rank (padded" in text
    assert counts_problem([3, 3, 3], 10, "interleaved") is not None  # drop_last=True: the tail was never run
    text = counts_problem([1, 2], None, "interleaved")
    assert text is not None and "expected [2, 1]" in text and "pass size=" in text


# ---------------------------------------------------------------- the collective
def evaluation(comm: distcomm.Communicator) -> dict[str, Any]:
    """The samplers' shards of a dataset of 10 (and of 2, fewer than the ranks), each rank's
    predictions (every third one None), back in dataset order; then bad input."""
    r, w = comm.rank, comm.world_size

    def predict(shard: list[int]) -> list[Any]:
        return [None if i % 3 == 0 else {"id": i, "score": torch.tensor(float(i))} for i in shard]

    out: dict[str, Any] = {}
    for n in (10, 2):
        mine = predict(list(detectron2_indices(n, w, r)))
        out[f"contiguous{n}"] = comm.gather_in_order(mine, size=n)
        mine = predict(torch_indices(n, w, r))
        out[f"interleaved{n}"] = comm.gather_in_order(mine, size=n, sharding="interleaved", dst=w - 1)
        out[f"helper{n}"] = distcomm.gather_in_order(mine, size=n, sharding="interleaved")
    out["no_size"] = comm.gather_in_order(list(range(r, 10, w)), sharding="interleaved")
    out["tensor_rows"] = comm.gather_in_order(torch.arange(r * 3, r * 3 + 3), size=3 * w)
    # bad input: every rank raises the same error, and the communicator goes on
    out["bad_counts"] = outcome(lambda: comm.gather_in_order([0] * (r + 1), size=4 * w, sharding="interleaved"))
    out["bad_sharding"] = outcome(lambda: comm.gather_in_order([r], sharding="blocks" if r == 1 else "contiguous"))
    out["sizes_differ"] = outcome(lambda: comm.gather_in_order([r], size=w + (r == 0)))
    out["not_a_list"] = outcome(lambda: comm.gather_in_order(5 if r == w - 1 else [r]))  # type: ignore[arg-type]
    out["after"] = comm.gather_in_order([r], size=w)
    return out


def _as_plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _as_plain(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_as_plain(x) for x in v]
    if isinstance(v, torch.Tensor):
        return v.tolist()
    return v


def check_evaluation(results: list[dict[str, Any]]) -> None:
    w = len(results)

    def want(n: int) -> list[Any]:
        return [None if i % 3 == 0 else {"id": i, "score": float(i)} for i in range(n)]

    for r, got in enumerate(results):
        for n in (10, 2):
            assert _as_plain(got[f"contiguous{n}"]) == (want(n) if r == 0 else None)
            assert _as_plain(got[f"interleaved{n}"]) == (want(n) if r == w - 1 else None)
            assert _as_plain(got[f"helper{n}"]) == (want(n) if r == 0 else None)
        assert got["no_size"] == (list(range(10)) if r == 0 else None)
        assert _as_plain(got["tensor_rows"]) == (list(range(3 * w)) if r == 0 else None)
        kind, text, ranks, _ = got["bad_counts"]
        assert kind == "CollectiveError" and "can't be an interleaved sharding of 12 indices" in text
        assert text == results[0]["bad_counts"][1]  # the same on every rank
        kind, text, ranks, _ = got["bad_sharding"]
        assert kind == "CollectiveError" and "sharding must be one of 'contiguous', 'interleaved', got 'blocks'" in text
        assert tuple(ranks) == (1,)
        kind, text, ranks, _ = got["sizes_differ"]
        assert kind == "CollectiveMismatchError" and "rank 0: sharding='contiguous', size=4" in text
        assert tuple(ranks) == (0,)
        kind, text, ranks, _ = got["not_a_list"]
        assert kind == "CollectiveError" and "results must be a sequence" in text and tuple(ranks) == (w - 1,)
        assert got["after"] == (list(range(w)) if r == 0 else None)


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_gather_in_order(world: str) -> None:
    results = spawn(evaluation, 3, timeout=180) if world == "gloo" else run_threaded(evaluation, 3)
    check_evaluation(results)


def test_fake_gathers_its_peers_results_in_order() -> None:
    n, w = 10, 4

    def peers(op: str, r: int, obj: Any) -> Any:  # each peer's shard of an interleaved, padded sampler
        return [f"p{i}" for i in torch_indices(n, w, r)]

    for rank in range(w):
        comm = FakeCommunicator(rank, w, peers=peers)
        got = comm.gather_in_order(peers("", rank, None), size=n, sharding="interleaved", dst=1)
        assert got == ([f"p{i}" for i in range(n)] if rank == 1 else None)
        assert [c.op for c in comm.calls] == ["gather_in_order"]
    bad = FakeCommunicator(0, 2, peers=lambda op, r, obj: [1, 2, 3])
    with pytest.raises(distcomm.CollectiveError, match="5 results in all"):
        bad.gather_in_order([1, 2], size=4)


def test_world_of_one() -> None:
    with distcomm.LocalCommunicator() as comm:
        assert comm.gather_in_order([None, 1, 2], size=3) == [None, 1, 2]
        assert comm.gather_in_order([0, 1, 2], size=3, sharding="interleaved") == [0, 1, 2]
        with pytest.raises(distcomm.CollectiveError, match="not the 5 of size=5"):
            comm.gather_in_order([1], size=5)
        with pytest.raises(distcomm.CollectiveError, match="sharding must be one of"):
            comm.gather_in_order([1], sharding="rows")  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="dst=1 is out of range"):
            comm.gather_in_order([1], dst=1)
