"""max and min of floats holding NaN: distcomm's result is torch's gloo all_reduce's (and reduce's)
on the same group, at every world size, whichever way distcomm moves the values.

torch's gloo reduces in a ring of chunks: a NaN comes through where its rank's value starts its
chunk's fold and is passed over elsewhere, so the positions that come back NaN depend on the NaN's
rank, the tensor's length and the world size. These tests compare positions, not a rule of their own.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import distcomm
from distcomm.testing import spawn

_TORCH_OP = {"max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _inputs(comm: distcomm.Communicator) -> list[torch.Tensor]:
    """Each rank's values for every case: NaN on one rank (each in turn), or on two, at every position."""
    n, r = comm.world_size, comm.rank
    cases = []
    for m, dtype in ((1, torch.float32), (5, torch.float32), (64, torch.float32), (7, torch.float64)):
        for nan_at in [{k} for k in range(n)] + [{0, n - 1}, set(range(n))]:
            t = torch.arange(m, dtype=dtype) + r
            if r in nan_at:
                t[:] = float("nan")
            cases.append(t)
    return cases


def _against_torch(comm: distcomm.Communicator) -> list[str]:
    """Where distcomm's all_reduce and reduce differ from torch's on the same group (none: [])."""
    differ = []
    for i, t in enumerate(_inputs(comm)):
        for op in ("max", "min"):
            ours, theirs = t.clone(), t.clone()
            comm.all_reduce(ours, op=op)
            dist.all_reduce(theirs, op=_TORCH_OP[op], group=comm.group)
            if not torch.equal(ours.isnan(), theirs.isnan()) or not torch.equal(ours.nan_to_num(), theirs.nan_to_num()):
                differ.append(f"all_reduce {op} case {i}: {ours.tolist()} != torch's {theirs.tolist()}")
            ours, theirs = t.clone(), t.clone()
            comm.reduce(ours, dst=1, op=op)
            dist.reduce(theirs, 1, op=_TORCH_OP[op], group=comm.group)  # (spawn's group: the default one)
            if comm.rank == 1 and (not torch.equal(ours.isnan(), theirs.isnan())
                                   or not torch.equal(ours.nan_to_num(), theirs.nan_to_num())):
                differ.append(f"reduce {op} case {i}: {ours.tolist()} != torch's {theirs.tolist()}")
    return differ


@pytest.mark.parametrize("world", [2, 4, 5])
def test_nan_in_max_and_min_as_torch_has_it(world: int) -> None:
    for r, differ in enumerate(spawn(_against_torch, world, timeout=240)):
        assert differ == [], (r, differ[:3])


@pytest.mark.slow
def test_nan_in_max_and_min_as_torch_has_it_beyond_the_gathered_worlds() -> None:
    """33 ranks: torch's ring on both sides (beyond the worlds where small reductions go through a root)."""
    for r, differ in enumerate(spawn(_against_torch, 33, timeout=600)):
        assert differ == [], (r, differ[:3])
