"""Scatter: what each rank receives (its own part, in the slots or after them), at 3 to 1,024 ranks."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

import distcomm
from distcomm._wire import frame as _frame
from distcomm.testing import FakeCommunicator, run_threaded, spawn
from tests._helpers import _header_bytes, _one


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


@pytest.mark.slow  # a world of 4 of its own, unless test_contract's is still kept (4-13 s)
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
