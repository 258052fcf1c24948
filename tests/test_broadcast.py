"""Broadcast: the split tree and its chunks, the root's steps, small payloads as one buffer."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm._transfer.routes.broadcast import broadcast_tree
from distcomm._wire import frame as _frame
from distcomm.testing import run_threaded, spawn
from tests._helpers import _ONE_KIB_OOB, MiB, _header_bytes, _one


def _tree_contents(comm: distcomm.Communicator) -> list[float]:
    payload = {"a": np.arange(3 * MiB // 8, dtype=np.float64), "t": torch.arange(MiB // 4, dtype=torch.float32)}
    comm.reset_stats()
    got = comm.broadcast(payload if comm.rank == 4 else None, src=4)
    st = comm.stats["broadcast"]
    return [float(got["a"].sum()), float(got["t"].sum()), float(got["a"][-1]), st.bytes_sent, st.bytes_received]


@pytest.mark.parametrize("world_size", [5, 6, 7, 13])
def test_tree_broadcast_in_chunks(world_size: int) -> None:
    """Several segments, each cut into chunks and forwarded down the split tree: every byte arrives,
    at every rank, once; the root sends the payload once, no rank more than 1.5 times."""
    distcomm.Communicator._TREE_CHUNK = 256 * 1024
    try:
        results = run_threaded(_tree_contents, world_size, timeout=120)
    finally:
        distcomm.Communicator._TREE_CHUNK = 4 << 20
    a = np.arange(3 * MiB // 8, dtype=np.float64)
    want = [float(a.sum()), float(torch.arange(MiB // 4, dtype=torch.float32).sum()), float(a[-1])]
    assert [r[:3] for r in results] == [want] * world_size
    slots = (world_size - 1) * (_frame.HEADER_SLOT if world_size > _frame.SMALL_WORLD else 4096)
    payload = 4 * MiB
    for r, (*_, sent, received) in enumerate(results):
        if r == 4:
            assert payload <= sent - slots <= payload + 4096 and received == slots
        else:
            assert payload <= received - slots <= payload + 4096 and sent - slots <= 1.5 * (payload + 4096)


@pytest.mark.parametrize("world_size", range(2, 40))
def test_split_broadcast_tree_shape(world_size: int) -> None:
    """Every rank gets one half from its parent (in its half's tree) and the other from a rank of
    the other tree; the root sends each half once, no rank more than three halves."""
    trees = [broadcast_tree(world_size, v, split=True) for v in range(world_size)]
    halves_sent = [2] + [0] * (world_size - 1)
    for v, t in enumerate(trees[1:], 1):
        assert t.parent is not None and (t.parent == 0 or trees[t.parent].second == t.second)
        assert v in trees[t.parent].children
        for c in t.children:
            assert trees[c].parent == v
        for m in t.mates:
            assert trees[m].other == v and trees[m].second != t.second
        if world_size > 2:
            assert t.other is not None and v in trees[t.other].mates
        halves_sent[v] = len(t.children) + len(t.mates)
    assert sorted(trees[0].children) == ([1] if world_size == 2 else [1, world_size // 2 + 1])
    assert max(halves_sent) <= 3


def _root_steps(comm: distcomm.Communicator) -> list[int]:
    """How many chunks the broadcast root posts per step (each step waits within the timeout)."""
    steps: list[int] = []
    real = comm._exchange_counted  # type: ignore[attr-defined]

    def spy(sends: Any, recvs: Any, timeout: Any) -> None:
        steps.append(len(sends))
        real(sends, recvs, timeout)

    comm._exchange_counted = spy  # type: ignore[attr-defined]
    comm.broadcast(np.ones(2 * MiB // 8) if comm.rank == 0 else None, src=0)
    return steps


def test_broadcast_root_posts_a_chunk_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large broadcast's root sends one chunk to each tree per step, each waited on within the
    timeout, as its receivers do: never the whole payload under one deadline."""
    monkeypatch.setattr(distcomm.Communicator, "_TREE_CHUNK", 256 * 1024)
    steps = run_threaded(_root_steps, 5, timeout=60)[0]
    # 2 MiB and a pickle stream: halves of five 256 KiB chunks, one to each tree per step
    assert steps == [2] * 5


def _small_broadcast(comm: distcomm.Communicator) -> dict[str, Any]:
    """A broadcast too big for the slots and small enough to travel as one buffer: a pickle stream
    and out-of-band buffers of odd sizes (the serializer's threshold lowered to 1 KiB), which land
    in that buffer at unaligned offsets and are copied out to aligned memory of their own."""
    root = comm.world_size - 2
    payload = {"a": np.arange(1001, dtype=np.float64), "b": np.arange(1037, dtype=np.int8),
               "t": torch.arange(3001, dtype=torch.float32), "s": "x" * 5000}
    segments = comm.serializer.dumps(payload)
    assert len(segments) == 4 and sum(s.nbytes for s in segments) < distcomm.Communicator._BCAST_ONE_BUFFER
    comm.reset_stats()
    got = comm.broadcast(payload if comm.rank == root else None, src=root)
    got["a"][0] = -1.0  # a result is the receiver's own, writable
    return {"sums": [float(got["a"][1:].sum()), int(got["b"].sum()), float(got["t"].sum()), len(got["s"])],
            "aligned": [got[k].__array_interface__["data"][0] % 64 == 0 if k != "t" else got[k].data_ptr() % 64 == 0
                        for k in ("a", "b", "t")],
            "moved": (comm.stats["broadcast"].bytes_sent, comm.stats["broadcast"].bytes_received), "root": root}


def _check_small_broadcast(results: list[dict[str, Any]], binomial: bool) -> None:
    n = len(results)
    want = [float(np.arange(1001, dtype=np.float64)[1:].sum()), int(np.arange(1037, dtype=np.int8).sum()),
            float(torch.arange(3001, dtype=torch.float32).sum()), 5000]
    root = results[0]["root"]

    def header(r: int) -> tuple[int, int]:
        small = (n - 1) * 4096
        return (small, small) if n <= _frame.SMALL_WORLD else _header_bytes(r, n, _one(n) if binomial else None)

    receiver = (root + 1) % n
    later = results[receiver]["moved"][1] - header(receiver)[1]  # what a receiver got after the slots
    assert 8 * 1001 + 1037 + 4 * 3001 <= later <= distcomm.Communicator._BCAST_ONE_BUFFER
    for r, got in enumerate(results):
        if r != root:
            assert got["sums"] == want and got["aligned"] == [True, True, True]
            assert got["moved"][1] == header(r)[1] + later
    # the root sends one copy per child: log2(world) children in gloo's binomial tree, 2 in the doubles' tree
    children = (n - 1).bit_length() if binomial else min(2, n - 1)
    assert results[root]["moved"][0] == header(root)[0] + children * later


@pytest.mark.slow  # gloo worlds of their own (3 and 6 ranks: 8 and 12 s on 2 cores)
@pytest.mark.parametrize("world_size", [3, 6])
def test_small_broadcast_travels_as_one_buffer_gloo(world_size: int) -> None:
    _check_small_broadcast(spawn(_small_broadcast, world_size, timeout=120, serializer=_ONE_KIB_OOB), binomial=True)


@pytest.mark.parametrize("world_size", [3, 9])
def test_small_broadcast_travels_as_one_buffer_threaded(world_size: int) -> None:
    _check_small_broadcast(run_threaded(_small_broadcast, world_size, timeout=120, serializer=_ONE_KIB_OOB),
                           binomial=False)
