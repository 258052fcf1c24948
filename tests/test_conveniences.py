"""shard, main_process_first and print: over gloo processes, the in-process world and the fakes."""

from __future__ import annotations

import io
import time
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import distcomm
from distcomm._ordering import shard_range
from distcomm.testing import FakeCommunicator, run_threaded, spawn


@pytest.mark.parametrize("sharding", ["contiguous", "interleaved"])
def test_every_index_is_on_exactly_one_rank(sharding: Any) -> None:
    for world in (1, 2, 3, 7, 64):
        for size in (0, 1, 5, 64, 1001):
            shards = [shard_range(size, world, r, sharding) for r in range(world)]
            assert sorted(i for s in shards for i in s) == list(range(size))
            counts = [len(s) for s in shards]
            assert max(counts) - min(counts) <= 1


def test_bad_sharding_and_size_are_refused() -> None:
    comm = FakeCommunicator(rank=0, world_size=2)
    with pytest.raises(ValueError, match="sharding must be one of 'contiguous', 'interleaved'"):
        comm.shard(10, sharding="blocks")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size must be an int >= 0"):
        comm.shard(-1)
    with pytest.raises(ValueError, match="size must be an int >= 0"):
        comm.shard(None)  # type: ignore[arg-type]
    assert comm.shard(np.int64(5)) == range(0, 3)  # as gather_in_order takes it


def _round_trip(comm: distcomm.Communicator) -> dict[str, Any]:
    out = {}
    for sharding in ("contiguous", "interleaved"):
        mine = [i * 10 for i in distcomm.shard(11, sharding)]  # type: ignore[arg-type]
        out[sharding] = comm.gather_in_order(mine, size=11, sharding=sharding)  # type: ignore[arg-type]
    return out


def test_shard_matches_gather_in_order_over_gloo() -> None:
    results = spawn(_round_trip, 3, timeout=120)
    assert results[0] == {"contiguous": [i * 10 for i in range(11)], "interleaved": [i * 10 for i in range(11)]}
    assert results[1] == results[2] == {"contiguous": None, "interleaved": None}


def _cache_first(comm: distcomm.Communicator, where: str, local: bool) -> tuple[bool, float, float]:
    if local:  # two machines of two ranks each
        with distcomm.GlooCommunicator(machine=str(comm.rank // 2)) as on_two_machines:
            return _build_or_read(on_two_machines, Path(where) / f"cache-{comm.rank // 2}", local)
    return _build_or_read(comm, Path(where) / "cache", local)


def _build_or_read(comm: distcomm.Communicator, cache: Path, local: bool) -> tuple[bool, float, float]:
    with comm.main_process_first(local=local, timeout=60):
        began = time.time()
        if not cache.exists():
            time.sleep(0.5)
            cache.write_text(str(comm.rank))
            return True, began, time.time()
    return False, began, time.time()


@pytest.mark.parametrize("local", [False, True])
def test_main_process_first_builds_once_then_the_others_read(tmp_path: Path, local: bool) -> None:
    results = spawn(lambda c: _cache_first(c, str(tmp_path), local), 4, timeout=120)
    built = [r for r, (made, _, _) in enumerate(results) if made]
    assert built == ([0, 2] if local else [0])
    for r, (made, began, _) in enumerate(results):
        if not made:
            first = 2 * (r // 2) if local else 0
            assert began >= results[first][2] - 0.05  # after the main one's block ended


def _main_fails(comm: distcomm.Communicator) -> str:
    try:
        with comm.main_process_first(timeout=60):
            if comm.rank == 0:
                raise OSError("download failed: no network")
            return "ran the block"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_a_failure_on_the_main_process_is_named_on_the_others(world: str) -> None:
    results = spawn(_main_fails, 3, timeout=120) if world == "gloo" else run_threaded(_main_fails, 3, timeout=60)
    assert results[0] == "OSError: download failed: no network"
    for said in results[1:]:
        assert said == ("CollectiveError: main_process_first: rank 0 raised inside the block (OSError: download "
                        "failed: no network); this rank skipped it")


def test_the_fake_takes_main_process_first() -> None:
    for rank in (0, 1):
        comm = FakeCommunicator(rank=rank, world_size=2)
        with comm.main_process_first():
            pass


def _printed(comm: distcomm.Communicator) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        comm.print("loss", 0.5, sep="=")
    return out.getvalue()


def test_print_on_the_main_process_only() -> None:
    assert spawn(_printed, 2, timeout=120) == ["loss=0.5\n", ""]


def _generator_closed_early(comm: distcomm.Communicator) -> str:
    def rows() -> Any:
        with comm.main_process_first(timeout=60):
            yield from range(10)

    taken = rows()
    next(taken)
    taken.close()  # the caller stops early: GeneratorExit inside the block, on every rank
    return f"{comm.all_gather(comm.rank)}"  # the ranks still agree on what comes next


def _nested(comm: distcomm.Communicator) -> str:
    with comm.main_process_first(timeout=60):
        try:
            with comm.main_process_first(timeout=60):
                return "nested ran"
        except RuntimeError as e:
            return str(e)


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_a_generator_closed_inside_the_block_is_no_failure_and_nesting_is_refused(world: str) -> None:
    run = (lambda fn: spawn(fn, 2, timeout=120)) if world == "gloo" else (lambda fn: run_threaded(fn, 2, timeout=60))
    assert run(_generator_closed_early) == ["[0, 1]", "[0, 1]"]
    assert run(_nested) == ["main_process_first blocks don't nest (on the same communicator)"] * 2
