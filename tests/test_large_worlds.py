"""Every collective in worlds of 256 and 1,024 ranks (threads in this process)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distcomm
from distcomm.testing import run_threaded


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


@pytest.mark.parametrize("world_size", [256, pytest.param(1024, marks=pytest.mark.slow)])  # 1,024: 25-35 s
def test_threaded_world_runs_every_collective_at_scale(world_size: int) -> None:
    results = run_threaded(_small_world, world_size, timeout=200)
    n = world_size
    for r, got in enumerate(results):
        assert got["all_gather"] == list(range(n))
        assert got["gather"] == ([{"r": i} for i in range(n)] if r == n - 1 else [])
        assert got["broadcast"] == {"from": 3, "v": [0, 1, 2, 3, 4]}
        assert got["scatter"] == f"part {r}"
        assert got["reduce"] == float(sum(range(n)))
