"""What each rank sends and receives per call, in worlds of 8.

Byte counts come from ``comm.stats``, which counts every byte this rank's transport sends and
receives for the call (slots, segments, forwarded chunks). The kernel's counters agree within
TCP/IP framing: see ``benchmarks/wire.py`` and the README.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import distcomm
from distcomm._wire import frame as _frame
from distcomm.testing import run_threaded, spawn
from tests._helpers import MiB, _header_bytes, _one


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


def _check_bytes(r: int, n: int, got: dict[str, tuple[int, int]], blocks: list[list[int]] | None = None) -> None:
    # what the header exchange costs this rank: when the slots are alike but for one, and otherwise
    hs, hr = _header_bytes(r, n, blocks)
    ts, tr = _header_bytes(r, n, blocks, table=True)
    overhead = 8 * 1024  # the pickle streams of the arrays, small tables
    assert got["synchronize"] == (hs, hr)
    sent, received = got["reduce_dict"]
    values = 8 * 8
    if blocks is None:  # the doubles count a ring's share
        ring = 2 * (n - 1) * values // n
        assert (sent, received) == (hs + ring, hr + ring)
    else:  # beyond 4 ranks, gathered on the root
        assert (sent, received) == ((hs, hr + (n - 1) * values) if r == 0 else (hs + values, hr))
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
