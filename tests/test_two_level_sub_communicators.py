"""Sub-communicators of communicators whose header exchange runs in two levels: every rank joins
as many groups, so they meet, and meet again when made again."""

from __future__ import annotations

from typing import Any

import pytest

import distcomm
from distcomm.testing import spawn
from tests._helpers import two_levels_from_five_ranks


def _groups_in_two_levels(comm: distcomm.Communicator) -> list[Any]:
    """Communicators whose header exchange runs in two levels (hosts of one rank each: runs of
    sqrt(world) ranks after rank 0, alone; machines of 4 and 3 ranks), then a sub-communicator
    across their blocks: each rank's count of process groups before and after, and the sub's result."""
    import torch.distributed.distributed_c10d as c10d

    out: list[Any] = []
    for machine in (comm.rank, comm.rank // 4):
        before = len(c10d._world.pg_names)
        with two_levels_from_five_ranks(), distcomm.GlooCommunicator(machine=machine, timeout=30) as c:
            grew = len(c10d._world.pg_names) - before
            with c.split(c.rank % 2) as sub:  # its groups are named by torch from each member's count
                out.append((c._blocks, grew, sub.all_gather(c.rank)))  # type: ignore[attr-defined]
    return out


@pytest.mark.slow  # a world of 7 of its own (10 s on 2 cores)
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
    with two_levels_from_five_ranks(), distcomm.GlooCommunicator(machine=r, timeout=30) as c:
        for _ in range(3):
            with c.split(0) as sub:
                out.append(sub.all_gather(r))
            sub2 = c.new_group([1, 2, 3, 4, 5])  # None on rank 0
            out.append(None if sub2 is None else sub2.all_gather(r))
            if sub2 is not None:
                sub2.close()
    return out


@pytest.mark.slow  # a world of 6 of its own (10-20 s on 2 cores)
def test_sub_communicators_made_again_meet_again() -> None:
    """torch names a sub-communicator's groups from their ranks and its count of groups, which
    closing them brings back down: the next ones get the same names, and the store still holds
    the closed ones' addresses. Each closed group's keys are gone, so the next ones meet."""
    for r, got in enumerate(spawn(_sub_communicators_again_and_again, 6, timeout=150)):
        assert got == [list(range(6)), None if r == 0 else [1, 2, 3, 4, 5]] * 3
