"""Small gathers up a binomial tree, large ones straight to the root: the results and the bytes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import distcomm
from distcomm._transfer.routes import gather as gather_route
from distcomm.testing import FakeCommunicator, run_threaded, spawn
from tests._helpers import _ONE_KIB_OOB, _header_bytes, _one


def _tree_gather(comm: distcomm.Communicator) -> dict[str, Any]:
    """Gathers of per-rank payloads of different sizes, with out-of-band buffers of odd sizes (the
    serializer's threshold lowered to 1 KiB), to a root in the middle: up the binomial tree when
    small, straight to the root when over ``_TREE_GATHER_BYTES``."""
    r, n = comm.rank, comm.world_size
    root = n - 3
    mine = {"r": r, "a": np.arange(900 + 37 * r, dtype=np.float64), "s": "y" * (5 * r)}
    comm.reset_stats()
    got = comm.gather(mine, dst=root)
    moved = (comm.stats["gather"].bytes_sent, comm.stats["gather"].bytes_received)
    out: dict[str, Any] = {"moved": moved, "own": sum(s.nbytes for s in comm.serializer.dumps(mine))}
    if r == root:
        got[0]["a"][0] = -1.0  # a result is the receiver's own, writable
        out["got"] = [(g["r"], float(g["a"][1:].sum()), len(g["a"]), g["s"]) for g in got]
        out["aligned"] = all(g["a"].__array_interface__["data"][0] % 64 == 0 for i, g in enumerate(got) if i != root)
    return out


def _check_tree_gather(results: list[dict[str, Any]], blocks: list[list[int]] | None = None) -> None:
    n = len(results)
    root = n - 3
    want = [(i, float(np.arange(900 + 37 * i, dtype=np.float64)[1:].sum()), 900 + 37 * i, "y" * (5 * i))
            for i in range(n)]
    assert results[root]["got"] == want and results[root]["aligned"]
    hs, hr = _header_bytes(root, n, blocks, table=True)  # (the slots differ: every rank's sizes differ)
    # the root receives every other rank's bytes once, and sends nothing after the slots
    assert results[root]["moved"] == (hs, hr + sum(res["own"] for i, res in enumerate(results) if i != root))
    for i, res in enumerate(results):
        v = (i - root) % n
        hs, hr = _header_bytes(i, n, blocks, table=True)
        if v % 2:  # a leaf of the binomial tree sends its own bytes, once, and receives nothing more
            assert res["moved"] == (hs + res["own"], hr)
        if i != root:  # an inner rank forwards its subtree's bytes: never more than the tree's limit
            assert res["moved"][1] - hr <= distcomm.Communicator._TREE_GATHER_BYTES


@pytest.mark.parametrize("world_size", [9, 13])
@pytest.mark.parametrize("tree", [True, False])
def test_small_gather_goes_up_a_binomial_tree_threaded(world_size: int, tree: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = gather_route.tree_gather

    def spy(comm: distcomm.Communicator, *args: Any) -> Any:
        calls.append(comm.rank)
        return real(comm, *args)

    monkeypatch.setattr(gather_route, "tree_gather", spy)
    if not tree:  # over the limit: straight to the root, the same results and bytes
        monkeypatch.setattr(distcomm.Communicator, "_TREE_GATHER_BYTES", 0)
    _check_tree_gather(run_threaded(_tree_gather, world_size, timeout=120, serializer=_ONE_KIB_OOB))
    assert sorted(calls) == (list(range(world_size)) if tree else [])


@pytest.mark.slow
def test_small_gather_goes_up_a_binomial_tree_gloo() -> None:
    _check_tree_gather(spawn(_tree_gather, 6, timeout=120, serializer=_ONE_KIB_OOB), _one(6))


@pytest.mark.parametrize("rank", [0, 3, 6, 7, 10, 12])  # 10: the root, fed by its children's subtrees
def test_fake_gather_runs_the_tree_as_its_peers_would(rank: int) -> None:
    n, root = 13, 10
    objs = [{"r": i, "a": np.arange(700 + 11 * i, dtype=np.float64)} for i in range(n)]
    comm = FakeCommunicator(rank, n, peers=lambda op, r, obj: objs[r], serializer=_ONE_KIB_OOB)
    got = comm.gather(objs[rank], dst=root)
    if rank == root:
        assert [g["r"] for g in got] == list(range(n))
        assert all(np.array_equal(g["a"], o["a"]) for g, o in zip(got, objs, strict=True))
    else:
        assert got == []
