"""Cluster scale: large worlds, and what each rank sends and receives per call.

Byte counts come from ``comm.stats``, which counts every byte this rank's transport sends and
receives for the call (slots, segments, forwarded chunks). The kernel's counters agree within
TCP/IP framing: see ``benchmarks/wire.py`` and the README.
"""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm import _frame
from distcomm._communicator import _broadcast_tree
from distcomm._torch import SUMMARY_CARRY, SUMMARY_CARRY_ACROSS, _summary_size
from distcomm.testing import FakeCommunicator, run_threaded, spawn
from tests.contract import header_blocks

MiB = 1 << 20


def _small_world(comm: distcomm.Communicator) -> dict[str, Any]:
    r, n = comm.rank, comm.world_size
    comm.synchronize()
    out: dict[str, Any] = {
        "all_gather": comm.all_gather(r),
        "gather": comm.gather({"r": r}, dst=n - 1),
        "broadcast": comm.broadcast({"from": r, "v": list(range(5))} if r == 3 else None, src=3),
        "scatter": comm.scatter([f"part {i}" for i in range(n)] if r == 1 else None, src=1),
        "reduce": float(comm.all_reduce_dict({"x": torch.tensor(float(r))}, average=False)["x"]),
    }
    return out


@pytest.mark.parametrize("world_size", [256, 1024])  # in make test: about 35 s at 1,024
def test_threaded_world_runs_every_collective_at_scale(world_size: int) -> None:
    results = run_threaded(_small_world, world_size, timeout=200)
    n = world_size
    for r, got in enumerate(results):
        assert got["all_gather"] == list(range(n))
        assert got["gather"] == ([{"r": i} for i in range(n)] if r == n - 1 else [])
        assert got["broadcast"] == {"from": 3, "v": [0, 1, 2, 3, 4]}
        assert got["scatter"] == f"part {r}"
        assert got["reduce"] == float(sum(range(n)))


@pytest.mark.parametrize("rank", [0, 517, 1023])
def test_fake_scatter_at_1024(rank: int) -> None:
    parts = [{"i": i, "a": np.full(3, i)} for i in range(1024)]
    comm = FakeCommunicator(rank, 1024, peers=lambda op, r, obj: parts if op == "scatter" else obj)
    got = comm.scatter(parts if rank == 0 else None, src=0)
    assert got["i"] == rank and got["a"].tolist() == [rank] * 3
    # a receiver gets the header slots, then one slot that holds its own part whole, sized by the
    # largest part (a few bytes over its own here): nothing of the others'
    if rank:
        received = comm.stats["scatter"].bytes_received
        own = _frame.table_size([1]) + len(pickle.dumps(parts[rank], protocol=5))
        assert own <= received - 1023 * _frame.HEADER_SLOT <= own + 16


def _scatters(comm: distcomm.Communicator) -> dict[str, Any]:
    """Two scatters: small parts, and small parts but one over ``slot_bytes`` (from 4 ranks); what
    each rank got, sent and received, and the bytes of each serialized part."""
    r, n = comm.rank, comm.world_size
    out: dict[str, Any] = {}
    for name, src, parts in (("small", 2, [{"i": i, "v": [0.5] * 8} for i in range(n)]),
                             ("mixed", 0, ["x" * (5000 if i == 3 else 10 + i) for i in range(n)])):
        comm.reset_stats()
        got = comm.scatter(parts if r == src else None, src=src)
        s = comm.stats["scatter"]
        sizes = [sum(seg.nbytes for seg in comm.serializer.dumps(p)) for p in parts]
        out[name] = (src, got == parts[r], s.bytes_sent, s.bytes_received, sizes)
    return out


def _check_scatters(r: int, n: int, out: dict[str, Any], blocks: list[list[int]] | None) -> None:
    """Each rank receives the headers and one slot of the size the root announced, large enough for
    the largest part that fits ``slot_bytes`` whole; a part that doesn't fit follows its slot."""
    hs, hr = _header_bytes(r, n, blocks)  # the root's slot is the odd one: the summary, no table
    for name, (src, ok, sent, received, sizes) in out.items():
        assert ok, name
        fits = [m for i, m in enumerate(sizes) if i != src and _frame.table_size([1]) + m <= 4096]
        slot = -(-(_frame.table_size([1]) + max(fits)) // 8) * 8
        later = sum(m for i, m in enumerate(sizes) if i != src and _frame.table_size([1]) + m > 4096)
        if r == src:
            assert sent == hs + (n - 1) * slot + later, name
        else:
            own = sizes[r] if _frame.table_size([1]) + sizes[r] > 4096 else 0
            assert received == hr + slot + own, name
            assert sent == hs, name


@pytest.mark.parametrize("rank", [0, 1, 7, 700])
def test_a_few_large_parts_dont_pad_every_ranks_scatter_slot(rank: int) -> None:
    """One part just under ``slot_bytes`` among 1,023 of 10 bytes: the slots are sized for the
    small ones, and the large one follows its slot, so no rank receives more than its own part and
    a small slot, and the root sends about what the parts weigh (with a large ``slot_bytes`` too)."""
    for slot_bytes in (4096, 1 << 20):
        parts = ["x" * (4096 - 200) if i == 7 else f"{i:010d}" for i in range(1024)]
        comm = FakeCommunicator(rank, 1024, peers=lambda op, r, obj: parts if op == "scatter" else obj,
                                slot_bytes=slot_bytes)
        assert comm.scatter(parts if rank == 0 else None, src=0) == parts[rank]
        s = comm.stats["scatter"]
        headers = 1023 * _frame.HEADER_SLOT
        if rank == 0:
            assert s.bytes_sent <= headers + 1023 * 96 + 4096
        else:
            extra = 4096 - 200 + 64 if rank == 7 else 0
            assert s.bytes_received - headers <= 96 + extra


@pytest.mark.parametrize("n", [5, 8, 13])
def test_small_scatter_parts_travel_in_their_slots_threaded(n: int) -> None:
    for r, out in enumerate(run_threaded(_scatters, n, timeout=60)):
        _check_scatters(r, n, out, None)


@pytest.mark.slow
def test_small_scatter_parts_travel_in_their_slots_gloo() -> None:
    for r, out in enumerate(spawn(_scatters, 8, timeout=120)):
        _check_scatters(r, 8, out, _one(8))


def _check_small_world_scatters(r: int, n: int, out: dict[str, Any]) -> None:
    """Up to 4 ranks a scatter takes one exchange: the root's slot that each rank receives holds
    that rank's part (where it fits ``slot_bytes``), and only a part that doesn't fit follows."""
    slots = (n - 1) * 4096
    for name, (src, ok, sent, received, sizes) in out.items():
        assert ok, name
        over = [m if _frame.table_size([1]) + m > 4096 else 0 for m in sizes]
        if r == src:
            assert (sent, received) == (slots + sum(m for i, m in enumerate(over) if i != src), slots), name
        else:
            assert (sent, received) == (slots, slots + over[r]), name


@pytest.mark.parametrize("n", [3, 4])
def test_scatter_parts_travel_in_the_first_exchange_in_small_worlds_threaded(n: int) -> None:
    for r, out in enumerate(run_threaded(_scatters, n, timeout=60)):
        _check_small_world_scatters(r, n, out)


def test_scatter_parts_travel_in_the_first_exchange_in_small_worlds_gloo() -> None:
    for r, out in enumerate(spawn(_scatters, 4, timeout=120)):
        _check_small_world_scatters(r, 4, out)


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_fake_scatter_in_a_small_world_as_its_root_would(rank: int) -> None:
    parts = [{"i": i, "s": "x" * (5000 if i == 1 else 10)} for i in range(3)]
    comm = FakeCommunicator(rank, 3, peers=lambda op, r, obj: parts if op == "scatter" else obj)
    for src in (0, 2):
        comm.reset_stats()
        assert comm.scatter(parts if rank == src else None, src=src) == parts[rank]
        s = comm.stats["scatter"]
        sizes = [sum(seg.nbytes for seg in comm.serializer.dumps(p)) for p in parts]
        _check_small_world_scatters(rank, 3, {"x": (src, True, s.bytes_sent, s.bytes_received, sizes)})


def _bytes_per_call(comm: distcomm.Communicator) -> dict[str, tuple[int, int]]:
    r, n = comm.rank, comm.world_size
    comm.reset_stats()
    comm.synchronize()
    comm.reduce_dict({f"k{i}": torch.tensor(float(r)) for i in range(8)})
    comm.gather(np.full(MiB // 8, float(r)), dst=0)
    comm.broadcast(np.ones(8 * MiB // 8) if r == 2 else None, src=2)
    comm.scatter([np.full(MiB // 8, float(i)) for i in range(n)] if r == 1 else None, src=1)
    comm.all_gather({f"m{i}": float(r) for i in range(8)})
    return {op: (s.bytes_sent, s.bytes_received) for op, s in comm.stats.items()}


def _children(m: int, v: int) -> int:
    """gloo's binomial broadcast in a group of m: how many ranks rank v (from the root) sends to."""
    return sum(1 for k in range(m.bit_length()) if 2**k > v and v + 2**k < m)


def _one(n: int) -> list[list[int]]:
    """The header exchange's blocks in a gloo world on one machine: one block, a gather on rank 0."""
    return [list(range(n))]


def _header_bytes(r: int, n: int, blocks: list[list[int]] | None, table: bool = False,
                  carry: int = SUMMARY_CARRY) -> tuple[int, int]:
    """What the header exchange costs rank r of n, sent and received: Bruck's all-gather (the
    doubles: ``blocks`` None), or gloo's exchange over ``blocks``. Up: a gather in each block to its
    first rank, and one of the blocks' tables (padded to the widest block) from those ranks to rank
    0. Down: gloo's binomial broadcasts of a summary (the common slot and the odd one) to the
    blocks' first ranks, then within each block, and when the slots differ more (``table``) of the
    whole table after it. ``carry``: the summary's room for a broadcast (one machine's, by default)."""
    slot = _frame.HEADER_SLOT
    if blocks is None:
        return (n - 1) * slot, (n - 1) * slot
    i, block = next((i, b) for i, b in enumerate(blocks) if r in b)
    pos, leaders, wide = block.index(r), len(blocks), max(len(b) for b in blocks) * slot
    sent = received = 0
    if len(block) > 1:
        if pos == 0:
            received += (len(block) - 1) * slot
        else:
            sent += slot
    lead = pos == 0 and leaders > 1
    if lead:
        if i == 0:
            received += (leaders - 1) * wide
        else:
            sent += wide
    for down in [_summary_size(slot, carry)] + ([n * slot] if table else []):
        if lead:
            sent += _children(leaders, i) * down
            received += down if i else 0
        if len(block) > 1:
            sent += _children(len(block), pos) * down
            received += down if pos else 0
    return sent, received


def _check_bytes(r: int, n: int, got: dict[str, tuple[int, int]], blocks: list[list[int]] | None = None) -> None:
    # what the header exchange costs this rank: when the slots are alike but for one, and otherwise
    hs, hr = _header_bytes(r, n, blocks)
    ts, tr = _header_bytes(r, n, blocks, table=True)
    overhead = 8 * 1024  # the pickle streams of the arrays, small tables
    assert got["barrier"] == (hs, hr)
    sent, received = got["reduce_dict"]
    assert sent <= ts + 2 * 8 * 8 and received <= tr + 2 * 8 * 8
    # gather: only the root receives the arrays; nobody else receives anything but the headers
    sent, received = got["gather"]
    if r == 0:
        assert (n - 1) * MiB <= received <= (n - 1) * (MiB + overhead) + tr
    else:
        assert received in (hr, tr) and MiB <= sent <= MiB + overhead + ts  # (equal sizes: alike slots)
    # broadcast: the root sends the payload once, no rank more than 1.5 times; everyone receives it once
    sent, received = got["broadcast"]
    assert sent <= (8 * MiB + overhead) + hs if r == 2 else sent <= 1.5 * (8 * MiB + overhead) + hs
    assert received == hr if r == 2 else 8 * MiB <= received <= 8 * MiB + hr + overhead
    # scatter: each rank receives its own part only
    sent, received = got["scatter"]
    if r == 1:
        assert (n - 1) * MiB <= sent <= (n - 1) * (MiB + overhead) + hs
    else:
        assert MiB <= received <= MiB + overhead + hr + _frame.HEADER_SLOT
    # a small all_gather: headers, then each rank's few hundred bytes to each peer
    sent, received = got["all_gather"]
    assert sent <= ts + (n - 1) * 512 and received <= tr + (n - 1) * 512


def test_bytes_per_rank_threaded_world_of_8() -> None:
    for r, got in enumerate(run_threaded(_bytes_per_call, 8, timeout=120)):
        _check_bytes(r, 8, got)


@pytest.mark.slow
def test_bytes_per_rank_gloo_world_of_8() -> None:
    for r, got in enumerate(spawn(_bytes_per_call, 8, timeout=180)):
        _check_bytes(r, 8, got, _one(8))


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
    trees = [_broadcast_tree(world_size, v, split=True) for v in range(world_size)]
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


_ONE_KIB_OOB = distcomm.PickleSerializer(oob_threshold=1024)


LAYOUTS = {  # the header exchange's blocks in a gloo world of 6 (see _header_blocks)
    "one machine": [[0, 1, 2, 3, 4, 5]],
    "hosts of one rank": [[0], [1, 2, 3], [4, 5]],
    "machines of 2": [[0, 1], [2, 3], [4, 5]],
    "uneven": [[0, 1], [2], [3, 4, 5]],
}


@contextlib.contextmanager
def _header_layout(comm: distcomm.Communicator, layout: str) -> Iterator[None]:
    """Lay the header exchange out as ``layout`` for the block's duration; then back as it was."""
    c: Any = comm
    if layout == "machines of 2":  # as set-up lays out machines of two ranks each, their groups reused
        c._set_machines([[0, 1], [2, 3], [4, 5]])
        try:
            assert c._blocks == LAYOUTS[layout] and c._block_group is c._local_group
            yield
        finally:
            c._set_machines([list(range(6))])
        return
    with header_blocks(comm, LAYOUTS[layout]):
        yield


def _headers_in(comm: distcomm.Communicator, layout: str) -> dict[str, Any]:
    """Beyond 4 ranks the gloo communicator exchanges header slots in native gathers and broadcasts
    over blocks of ranks: the same results and errors whatever the blocks, and the bytes they cost."""
    with _header_layout(comm, layout):
        r = comm.rank
        comm.reset_stats()
        comm.synchronize()
        out: dict[str, Any] = {"barrier": (comm.stats["barrier"].bytes_sent, comm.stats["barrier"].bytes_received)}
        got = comm.all_gather({"r": r, "s": "x" * r})
        out["all_gather"] = (got, comm.stats["all_gather"].bytes_received)
        out["broadcast"] = comm.broadcast({"from": r} if r == 3 else None, src=3)
        out["gather"] = comm.gather(r * 10, dst=2)
        out["scatter"] = comm.scatter([f"part {i}" for i in range(6)] if r == 4 else None, src=4)
        out["reduce_dict"] = {k: float(v) for k, v in comm.reduce_dict({"a": torch.tensor(float(r))}).items()}
        try:  # rank 0 calls another collective than its peers: every rank raises the same error
            comm.gather(r) if r == 0 else comm.all_gather(r)
        except distcomm.CollectiveMismatchError as e:
            out["mismatch"] = str(e)
        try:  # rank 5 alone calls another collective: the one odd slot, in the summary
            comm.gather(r) if r == 5 else comm.all_gather(r)
        except distcomm.CollectiveMismatchError as e:
            out["odd mismatch"] = str(e)
        out["after"] = comm.all_gather(r)
        return out


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_header_exchange_over_blocks_gloo(layout: str) -> None:
    n, blocks = 6, LAYOUTS[layout]
    carry = SUMMARY_CARRY_ACROSS if layout == "machines of 2" else SUMMARY_CARRY  # (machines, or one machine)
    results = spawn(lambda comm: _headers_in(comm, layout), n, timeout=120)
    for r, got in enumerate(results):
        assert got["barrier"] == _header_bytes(r, n, blocks, carry=carry)
        assert got["all_gather"][0] == [{"r": i, "s": "x" * i} for i in range(n)]
        assert got["all_gather"][1] >= _header_bytes(r, n, blocks, table=True, carry=carry)[1]  # (the sizes differ)
        assert got["broadcast"] == {"from": 3}
        assert got["gather"] == ([i * 10 for i in range(n)] if r == 2 else [])
        assert got["scatter"] == f"part {r}"
        assert got["reduce_dict"] == ({"a": 15 / n} if r == 0 else {"a": float(r)})
        assert got["mismatch"] == results[0]["mismatch"] and "rank 0" in got["mismatch"]
        assert got["odd mismatch"] == results[0]["odd mismatch"] and "rank 5" in got["odd mismatch"]
        assert got["after"] == list(range(n))


def _groups_in_two_levels(comm: distcomm.Communicator) -> list[Any]:
    """Communicators whose header exchange runs in two levels (hosts of one rank each: runs of
    sqrt(world) ranks after rank 0, alone; machines of 4 and 3 ranks), then a sub-communicator
    across their blocks: each rank's count of process groups before and after, and the sub's result."""
    import torch.distributed.distributed_c10d as c10d

    out: list[Any] = []
    for machine in (comm.rank, comm.rank // 4):
        before = len(c10d._world.pg_names)
        with distcomm.GlooCommunicator(machine=machine, timeout=30) as c:
            grew = len(c10d._world.pg_names) - before
            with c.split(c.rank % 2) as sub:  # its groups are named by torch from each member's count
                out.append((c._blocks, grew, sub.all_gather(c.rank)))  # type: ignore[attr-defined]
    return out


def test_every_rank_joins_as_many_groups_so_sub_communicators_meet() -> None:
    results = spawn(_groups_in_two_levels, 7, timeout=120)
    for r, got in enumerate(results):
        (blocks, grew, sub), (mblocks, mgrew, msub) = got
        assert blocks == [[0], [1, 2, 3], [4, 5, 6]] and mblocks == [[0, 1, 2, 3], [4, 5, 6]]
        assert grew == results[0][0][1] and mgrew == results[0][1][1]  # the same count on every rank
        assert sub == msub == list(range(r % 2, 7, 2))


def _sub_communicators_again_and_again(comm: distcomm.Communicator) -> list[Any]:
    """Sub-communicators with header blocks of their own (hosts of one rank), made and closed again
    and again: each time the same ranks, so the same group names in torch's store."""
    r, out = comm.rank, []
    with distcomm.GlooCommunicator(machine=r, timeout=30) as c:
        for _ in range(3):
            with c.split(0) as sub:
                out.append(sub.all_gather(r))
            sub2 = c.new_group([1, 2, 3, 4, 5])  # None on rank 0
            out.append(None if sub2 is None else sub2.all_gather(r))
            if sub2 is not None:
                sub2.close()
    return out


def test_sub_communicators_made_again_meet_again() -> None:
    """torch names a sub-communicator's groups from their ranks and its count of groups, which
    closing them brings back down: the next ones get the same names, and the store still holds
    the closed ones' addresses. Each closed group's keys are gone, so the next ones meet."""
    for r, got in enumerate(spawn(_sub_communicators_again_and_again, 6, timeout=150)):
        assert got == [list(range(6)), None if r == 0 else [1, 2, 3, 4, 5]] * 3


@pytest.mark.parametrize(("world", "machines", "blocks"), [
    (4, [[0, 1, 2, 3]], [[0, 1, 2, 3]]),  # small worlds: one block (set-up; the slots go all to all)
    (16, [list(range(16))], [list(range(16))]),  # one machine: one block
    # hosts of one rank: rank 0 alone, the others in runs of ceil(sqrt(world - 1))
    (16, [[r] for r in range(16)], [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15]]),
    (10, [[r] for r in range(10)], [[0], [1, 2, 3], [4, 5, 6], [7, 8, 9]]),
    (5, [[r] for r in range(5)], [[0], [1, 2], [3, 4]]),
    (24, [list(range(0, 24, 2)), list(range(1, 24, 2))], [list(range(0, 24, 2)), list(range(1, 24, 2))]),
    (12, [[0, 1, 2, 3, 4], [5], [6, 7, 8, 9, 10, 11]], [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]),
    (130, [list(range(65)), list(range(65, 130))],
     [[0]] + [list(range(i, min(i + 12, 130))) for i in range(1, 130, 12)]),
])
def test_header_blocks_follow_the_machines_else_sqrt_runs(world: int, machines: list[list[int]],
                                                          blocks: list[list[int]]) -> None:
    from distcomm._torch import _header_blocks

    assert _header_blocks(world, machines) == blocks


def test_header_blocks_at_1024_ranks() -> None:
    """Machines of 8 GPUs: 128 blocks of 8 (rank 0 gathers 7 slots, then 127 tables); hosts of one
    rank: rank 0 alone, then 31 blocks of 32 and one of 31 (rank 0 gathers 32 tables, nothing else)."""
    from distcomm._torch import _header_blocks

    machines = [list(range(m, m + 8)) for m in range(0, 1024, 8)]
    assert _header_blocks(1024, machines) == machines
    assert _header_blocks(1024, [[r] for r in range(1024)]) == [[0]] + [list(range(m, min(m + 32, 1024)))
                                                                        for m in range(1, 1024, 32)]


@pytest.mark.parametrize("world_size", [3, 6])
def test_small_broadcast_travels_as_one_buffer_gloo(world_size: int) -> None:
    _check_small_broadcast(spawn(_small_broadcast, world_size, timeout=120, serializer=_ONE_KIB_OOB), binomial=True)


@pytest.mark.parametrize("world_size", [3, 9])
def test_small_broadcast_travels_as_one_buffer_threaded(world_size: int) -> None:
    _check_small_broadcast(run_threaded(_small_broadcast, world_size, timeout=120, serializer=_ONE_KIB_OOB),
                           binomial=False)


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
    real = distcomm.Communicator._tree_gather

    def spy(self: distcomm.Communicator, *args: Any) -> Any:
        calls.append(self.rank)
        return real(self, *args)

    monkeypatch.setattr(distcomm.Communicator, "_tree_gather", spy)
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


@pytest.mark.parametrize("odd", [[], [0], [1], [5], [6], [0, 1], [2, 4], [0, 6]])
def test_header_summary_names_the_one_odd_slot_or_asks_for_the_table(odd: list[int]) -> None:
    from distcomm._torch import _summarize

    world, size = 7, _frame.HEADER_SLOT
    table = bytearray(b"c" * size * world)
    for r in odd:
        table[r * size : (r + 1) * size] = bytes([r]) * size
    out = memoryview(bytearray(8 + 2 * size))
    _summarize(memoryview(table), world, size, out)
    word = int.from_bytes(out[:8], "little", signed=True)
    if len(odd) > 1:
        assert word == -1
    else:
        assert word == (odd[0] + 1 if odd else 0) and bytes(out[8 : 8 + size]) == b"c" * size
        if odd:
            assert bytes(out[8 + size :]) == bytes([odd[0]]) * size


def _root_steps(comm: distcomm.Communicator) -> list[int]:
    """How many chunks the broadcast root posts per step (each step waits within the timeout)."""
    steps: list[int] = []
    real = comm._xchg  # type: ignore[attr-defined]

    def spy(sends: Any, recvs: Any, timeout: Any) -> None:
        steps.append(len(sends))
        real(sends, recvs, timeout)

    comm._xchg = spy  # type: ignore[attr-defined]
    comm.broadcast(np.ones(2 * MiB // 8) if comm.rank == 0 else None, src=0)
    return steps


def test_broadcast_root_posts_a_chunk_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """A large broadcast's root sends one chunk to each tree per step, each waited on within the
    timeout, as its receivers do: never the whole payload under one deadline."""
    monkeypatch.setattr(distcomm.Communicator, "_TREE_CHUNK", 256 * 1024)
    steps = run_threaded(_root_steps, 5, timeout=60)[0]
    # 2 MiB and a pickle stream: halves of five 256 KiB chunks, one to each tree per step
    assert steps == [2] * 5


@pytest.mark.parametrize("blocks", [
    [[0, 1], [2, 3], [4, 5]],  # consecutive, in order, all of one length: the tables are the table
    [[0], [1, 2, 3], [4, 5]],  # rank 0 alone, then runs (hosts of one rank)
    [[0, 1], [2], [3, 4, 5]],  # uneven machines
    [[0, 2, 4], [1, 3, 5]],  # machines whose ranks interleave
    [[0, 1, 2], [3, 4]],  # a shorter last block
])
def test_rank_0_assembles_the_table_from_the_blocks_tables(blocks: list[list[int]]) -> None:
    """Rank 0 gets each block's slots from its first rank in one buffer per block (as long as the
    longest block); the table it makes of them holds every rank's slot in its row, in one pass."""
    from distcomm._torch import _table_index

    world, size = sum(len(b) for b in blocks), 8
    per = max(len(b) for b in blocks)
    tables = np.zeros((len(blocks), per, size), dtype=np.uint8)
    for i, b in enumerate(blocks):
        for j, r in enumerate(b):
            tables[i, j] = r + 1
    index = _table_index(blocks, world)
    table = tables.reshape(-1, size)[: world] if index is None else np.take(tables.reshape(-1, size), index, axis=0)
    assert (index is None) == (blocks == [[0, 1], [2, 3], [4, 5]])
    assert table.tolist() == [[r + 1] * size for r in range(world)]


def test_rank_0_takes_the_tables_of_machines_of_8_in_place() -> None:
    """At 1,024 ranks on machines of 8 the blocks' tables land in rank 0's table as they are (no
    copy); on hosts of one rank it takes them in one pass over a precomputed index."""
    from distcomm._torch import _header_blocks, _table_index

    machines = [list(range(m, m + 8)) for m in range(0, 1024, 8)]
    assert _table_index(_header_blocks(1024, machines), 1024) is None
    index = _table_index(_header_blocks(1024, [[r] for r in range(1024)]), 1024)
    assert index is not None and index[0] == 0 and index[1] == 32 and index[1023] == 32 * 32 + 30


_TINY_OOB = distcomm.PickleSerializer(oob_threshold=1)


def _results_outlive_the_header_buffers(comm: distcomm.Communicator) -> Any:
    """What each call returned stays as it was after later calls reuse the header exchange's
    buffers, with every array out of band (a 1-byte threshold: a stream and a 4-byte buffer per
    object, the most segments a 64-byte slot's table holds)."""
    r = comm.rank
    # a timeout of each call's own, as a deadline gives: the exchange's calls take it up each time
    kept = [comm.all_gather(np.array([r * 10 + i], dtype=np.int32), timeout=60 + i) for i in range(3)]
    kept.append(comm.broadcast(np.array([7], dtype=np.int32) if r == 0 else None))
    comm.all_gather(np.array([-1], dtype=np.int32))  # one more call over the same buffers
    return [[int(a[0]) for a in got] for got in kept[:3]], int(kept[3][0])


@pytest.mark.parametrize("layout", ["one machine", "hosts of one rank", "machines of 2"])
def test_results_outlive_the_reused_header_buffers(layout: str) -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        with _header_layout(comm, layout):
            return _results_outlive_the_header_buffers(comm)

    for gathered, sent in spawn(fn, 6, timeout=120, serializer=_TINY_OOB):
        assert gathered == [[q * 10 + i for q in range(6)] for i in range(3)] and sent == 7


def _sized(comm: distcomm.Communicator, n: int) -> bytes:
    """A bytes object whose serialized segments add up to exactly ``n`` bytes."""
    k = n
    while sum(s.nbytes for s in comm.serializer.dumps(b"x" * k)) > n:
        k -= 1
    obj = b"x" * k
    assert sum(s.nbytes for s in comm.serializer.dumps(obj)) == n
    return obj


def _carried_broadcasts(comm: distcomm.Communicator, room: int) -> dict[str, Any]:
    """Broadcasts of small payloads beyond 4 ranks, where the summary has ``room`` bytes for them:
    what each rank got, and its bytes for each call beside a barrier's (the header exchange alone)."""
    r = comm.rank
    assert comm._summary_carry == room  # type: ignore[attr-defined]
    cases: dict[str, tuple[Any, int]] = {
        "fits": (_sized(comm, room), 0),
        "one byte over": (_sized(comm, room + 1), 0),
        "from rank 3": (_sized(comm, 100), 3),
        "out of band": ({"a": np.arange(9, dtype=np.int16), "s": "seed"}, 0),  # a stream and a buffer
        "seed": (None, 0),
    }
    comm.reset_stats()
    comm.synchronize()
    out: dict[str, Any] = {"barrier": (comm.stats["barrier"].bytes_sent, comm.stats["barrier"].bytes_received)}
    kept = []
    for name, (obj, root) in cases.items():
        comm.reset_stats()
        if name == "seed":
            got = comm.shared_random_seed()
            st = comm.stats["shared_random_seed"]
            kept.append(got)
            out[name] = (comm.all_gather(got), (st.bytes_sent, st.bytes_received))
            continue
        got = comm.broadcast(obj if r == root else None, src=root)
        st = comm.stats["broadcast"]
        kept.append(got)
        value = got if not isinstance(got, dict) else (got["a"].tolist(), got["s"])
        out[name] = (value, (st.bytes_sent, st.bytes_received))
    comm.all_gather(b"y" * room)  # later calls reuse the summary: the results are the ranks' own
    comm.broadcast(b"z" * 200 if r == 0 else None)
    out["kept"] = [k if not isinstance(k, dict) else (k["a"].tolist(), k["s"]) for k in kept]
    out["sizes"] = {name: sum(s.nbytes for s in comm.serializer.dumps(obj)) for name, (obj, _) in cases.items()}
    # a rank in another collective: the summary is the same size in every op, so every rank learns it
    for other in (lambda: comm.gather(r), lambda: comm.broadcast(b"s", src=5)):
        try:
            other() if r == 5 else comm.broadcast(b"s" * 10 if r == 0 else None)
        except distcomm.CollectiveMismatchError as e:
            out.setdefault("mismatch", []).append("rank 5: " in str(e))
    try:  # rank 0 alone broadcasts (its payload in the summary's room), the others in a barrier
        comm.broadcast(b"s" * 10) if r == 0 else comm.synchronize()
    except distcomm.CollectiveMismatchError as e:
        out.setdefault("mismatch", []).append("rank 0: broadcast" in str(e))
    out["after"], out["room"] = comm.all_gather(r), room
    return out


@pytest.mark.parametrize("layout", ["one machine", "hosts of one rank", "machines of 2"])
def test_small_broadcast_from_rank_0_rides_in_the_header_summary(layout: str) -> None:
    """A broadcast from rank 0 whose segments fit the summary's room (``SUMMARY_CARRY`` on one
    machine, ``SUMMARY_CARRY_ACROSS`` across machines) travels in the header exchange's summary: no
    rank sends or receives more than in a barrier. One byte more, or another root, and it goes in a
    broadcast of its own after the exchange. Every rank gets the payload either way."""
    def fn(comm: distcomm.Communicator) -> Any:
        if layout == "machines of 2":  # declared machines: the summary crosses the network
            comm.create_local_groups(2)
            return _carried_broadcasts(comm, SUMMARY_CARRY_ACROSS)
        with _header_layout(comm, layout):  # blocks laid out so, on this one machine
            return _carried_broadcasts(comm, SUMMARY_CARRY)

    results = spawn(fn, 6, timeout=120, serializer=_TINY_OOB)
    want = results[0]
    assert want["fits"][0] == b"x" * len(want["fits"][0]) and want["out of band"][0] == (list(range(9)), "seed")
    seeds = {got["seed"][0][0] for got in results}
    assert len(seeds) == 1 and results[0]["seed"][0] == [seeds.pop()] * 6
    for r, got in enumerate(results):
        assert got["mismatch"] == [True, True, True] and got["after"] == list(range(6)), r
        for name in ("fits", "one byte over", "from rank 3", "out of band"):
            assert got[name][0] == want[name][0], (r, name)
        assert got["kept"] == [want[k][0] for k in ("fits", "one byte over", "from rank 3", "out of band")] + \
            [want["seed"][0][0]]
        for name, root in (("fits", 0), ("one byte over", 0), ("from rank 3", 3), ("out of band", 0), ("seed", 0)):
            sent, received = got[name][1]
            if name == "seed" or (root == 0 and want["sizes"][name] <= want["room"]):
                assert (sent, received) == got["barrier"], (r, name)  # carried: the exchange's bytes, no more
            elif r == root:  # a broadcast of its own after the exchange
                assert sent > got["barrier"][0] and received == got["barrier"][1], (r, name)
            else:
                assert received == got["barrier"][1] + want["sizes"][name], (r, name)
    assert want["sizes"]["out of band"] > SUMMARY_CARRY_ACROSS  # (carried on one machine only)
