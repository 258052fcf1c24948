"""The contract suite over every communicator kind: Local, Fake, threaded worlds, real gloo worlds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded, spawn
from tests.contract import check, exercise, exercise_alltoall, exercise_in_blocks, exercise_point_to_point, peers


def test_local() -> None:
    with distcomm.LocalCommunicator() as comm:
        check(exercise(comm), local=(0, 1))


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_fake_every_rank(world_size: int) -> None:
    for rank in range(world_size):
        comm = FakeCommunicator(rank, world_size, peers=peers)
        check(exercise(comm), local=(rank, world_size))


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_threaded(world_size: int) -> None:
    results = run_threaded(exercise, world_size, timeout=60)
    for r, result in enumerate(results):
        check(result, local=(r, world_size))


@pytest.mark.parametrize("world_size", [2, 4, pytest.param(6, marks=pytest.mark.slow),
                                        pytest.param(8, marks=pytest.mark.slow)])
def test_gloo(world_size: int) -> None:
    """6 and 8 processes: beyond small worlds (header slots gathered on rank 0, as on one machine,
    tree broadcast, scatter slots)."""
    results = spawn(exercise, world_size, timeout=180)
    for r, result in enumerate(results):
        check(result, local=(r, world_size))


def _exercise_agreeing_by_reduction(comm: distcomm.Communicator) -> dict[str, Any]:
    comm._agrees_by_reduction = True  # type: ignore[misc]  # NcclCommunicator's way (docs/at-scale.md)
    return exercise(comm)


@pytest.mark.parametrize("world_size", [3, pytest.param(6, marks=pytest.mark.slow)])
def test_gloo_agreeing_by_reduction(world_size: int) -> None:
    """Every collective starts with a sum of a fixed-size vector; agreement-only calls stop there."""
    for r, result in enumerate(spawn(_exercise_agreeing_by_reduction, world_size, timeout=180)):
        check(result, local=(r, world_size))


@pytest.mark.slow
def test_gloo_header_exchange_in_two_levels() -> None:
    """8 processes laid out as hosts of one rank each: rank 0 alone, then header slots gathered in blocks of
    3, 3 and 1."""
    for r, result in enumerate(spawn(exercise_in_blocks, 8, timeout=180)):
        check(result, local=(r, 8))


_STEP2 = {"point_to_point": exercise_point_to_point, "alltoall": exercise_alltoall}


@pytest.mark.parametrize("step2", sorted(_STEP2))
@pytest.mark.parametrize("world_size", [2, 4])
def test_step2_modes_fake_and_threaded(step2: str, world_size: int) -> None:
    """The transfers after the slots, forced point to point or into one all-to-all: same results."""
    fn = _STEP2[step2]
    for rank in range(world_size):
        check(fn(FakeCommunicator(rank, world_size, peers=peers)), local=(rank, world_size))
    for r, result in enumerate(run_threaded(fn, world_size, timeout=60)):
        check(result, local=(r, world_size))


@pytest.mark.slow
@pytest.mark.parametrize("step2", sorted(_STEP2))
def test_step2_modes_gloo(step2: str) -> None:
    for r, result in enumerate(spawn(_STEP2[step2], 4, timeout=120)):
        check(result, local=(r, 4))


@pytest.mark.parametrize("slot_bytes", [256, pytest.param(1 << 16, marks=pytest.mark.slow)])  # a world each
def test_gloo_slot_sizes(slot_bytes: int) -> None:
    """A tiny slot packs segment tables; a large one inlines everything: same results."""
    results = spawn(exercise, 2, timeout=120, slot_bytes=slot_bytes)
    for r, result in enumerate(results):
        check(result, local=(r, 2))


def test_threaded_tiny_slot_and_no_oob() -> None:
    ser = distcomm.PickleSerializer(oob_threshold=0)
    results = run_threaded(exercise, 3, timeout=60, slot_bytes=256, serializer=ser)
    for r, result in enumerate(results):
        check(result, local=(r, 3))


def _results_outlive_the_next_call(comm: distcomm.Communicator) -> tuple[list[list[int]], list[bool]]:
    first = comm.all_gather(np.full(10, comm.rank))
    comm.all_gather(np.full(10, comm.rank + 100))  # reuses the transport's slot buffer
    return [a.tolist() for a in first], [bool(a.flags.writeable) for a in first]


@pytest.mark.parametrize("world", ["gloo", "threaded"])
@pytest.mark.parametrize("slot_bytes", [pytest.param(256, marks=pytest.mark.slow), 4096])  # a world each
def test_small_out_of_band_buffers_are_the_results_own(world: str, slot_bytes: int) -> None:
    """Buffers that came inline in the slot are copied out: later calls can't change results."""
    kwargs = {"serializer": distcomm.PickleSerializer(oob_threshold=0), "slot_bytes": slot_bytes}
    run = spawn if world == "gloo" else run_threaded
    for values, writable in run(_results_outlive_the_next_call, 2, timeout=120, **kwargs):
        assert values == [[0] * 10, [1] * 10]
        assert writable == [True, True]


def _write_into_results(comm: distcomm.Communicator) -> list[list[float]]:
    got = comm.all_gather([np.full(20_000, float(comm.rank)), np.full(10_000, comm.rank + 0.5)])  # out of band
    for entry in got:
        if entry is not got[comm.rank]:
            entry[0][:] = -1.0  # received memory is writable and each entry's own
    return [[float(a.sum()) for a in entry] for entry in got]


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_received_entries_do_not_overlap(world: str) -> None:
    """Results that arrived in one buffer are disjoint views of it: writing one leaves the others."""
    run = spawn if world == "gloo" else run_threaded
    for r, sums in enumerate(run(_write_into_results, 3, timeout=120)):
        assert sums == [[-20_000.0 if i != r else 20_000.0 * i, 10_000 * (i + 0.5)] for i in range(3)]
