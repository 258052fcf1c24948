"""detectron2 code, written as detectron2 writes it, runs on distcomm: 2 processes, threads, one process."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distcomm
from distcomm.testing import run_threaded
from tests.d2style import train_net

ROOT = Path(__file__).resolve().parent.parent


def _check(results: list[dict[str, Any]], world: int) -> None:
    """What the reference module gives for this job."""
    seeds = {r["seed"] for r in results}
    assert len(seeds) == 1
    main = results[0]
    # reduce_dict: averaged onto rank 0, element-wise for non-scalar values; keys sorted
    steps = 3
    g = torch.Generator()
    g.manual_seed(main["seed"])
    stream = [i for _ in range(2) for i in torch.randperm(10, generator=g).tolist()]
    want = []
    for step in range(steps):
        per_rank = [stream[r::world][2 * step : 2 * step + 2] for r in range(world)]
        want.append({"loss_box": [sum(range(world)) / world, step + 1.0],
                     "loss_cls": sum(map(sum, per_rank)) / world})
    assert main["logged"] == want  # small integers: exact in float
    assert list(main["logged"][0]) == ["loss_box", "loss_cls"]
    for r, res in enumerate(results):
        assert res["rank"] == r and res["world"] == world and res["local_rank"] == r
        assert res["loaded"] == {"steps": steps}
        assert res["first"] == [stream[r]]
        assert res["logged"] == ([] if r else main["logged"])
        assert res["metrics"] == ({"n": 10, "ids": list(range(10)), "mean": 2.25} if r == 0 else {})


@pytest.mark.slow
def test_two_processes_through_launch_positionally(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "tests.d2style.train_net", str(tmp_path), "2"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["local_group_is_none"] for r in results] == [False, False]
    _check(results, 2)


def test_threaded_world(tmp_path: Path) -> None:
    cfg = {"size": 10, "steps": 3, "out": str(tmp_path)}
    results = run_threaded(lambda comm: train_net.main(cfg), 2)
    _check(json.loads(json.dumps(results)), 2)


def test_one_process_runs_in_the_caller(tmp_path: Path) -> None:
    """One machine, one process: main runs here (breakpoints work), with a LocalCommunicator installed."""
    seen: list[Any] = []
    cfg = {"size": 10, "steps": 3, "out": str(tmp_path)}
    distcomm.launch(lambda c: seen.append((os.getpid(), type(distcomm.current()).__name__, train_net.main(c))),
                    1, 1, 0, "auto", (cfg,), datetime.timedelta(minutes=30))
    pid, kind, result = seen[0]
    assert (pid, kind) == (os.getpid(), "LocalCommunicator")
    import threading

    helper: list[Any] = []
    distcomm.launch(lambda: [t.start() or t.join() for t in [threading.Thread(
        target=lambda: helper.append(distcomm.current() is distcomm.current()))]], 1)
    assert helper == [True]  # the world-of-one communicator is every thread's default too
    _check([result], 1)


def test_launch_keywords_and_errors() -> None:
    seen: list[int] = []
    distcomm.launch(lambda: seen.append(distcomm.get_world_size()), num_gpus_per_machine=1)
    assert seen == [1]
    with pytest.raises(TypeError, match="not both"):
        distcomm.launch(print, 2, num_gpus_per_machine=1)
    with pytest.raises(TypeError, match="needs num_processes_per_machine"):
        distcomm.launch(print)
    with pytest.raises(ValueError, match="backend must be"):
        distcomm.launch(print, 1, backend="mpi")
    with pytest.raises(ValueError, match="finite"):
        distcomm.launch(print, 1, timeout=float("inf"))
    with pytest.raises(TypeError, match="args must be"):
        distcomm.launch(print, 1, 1, 0, None, "abc")


def test_the_local_process_group_names() -> None:
    from tests.d2style.utils import comm

    assert comm is distcomm
    assert comm._LOCAL_PROCESS_GROUP is None and comm.get_local_process_group() is None  # no world: none

    def regroup(c: distcomm.Communicator) -> tuple[int, int, int, int]:
        before = (c.local_rank, c.local_size)
        comm.create_local_process_group(2)
        return (*before, comm.get_local_rank(), comm.get_local_size())

    assert run_threaded(regroup, 4) == [(0, 4, 0, 2), (1, 4, 1, 2), (2, 4, 0, 2), (3, 4, 1, 2)]
    with pytest.raises(distcomm.testing.RankFailedError, match="does not divide world_size 4"):
        run_threaded(lambda c: comm.create_local_process_group(3), 4)
    with pytest.raises(distcomm.testing.RankFailedError, match="passed different numbers"):
        run_threaded(lambda c: comm.create_local_process_group(2 if c.rank else 4), 4)


def _gloo_regroup(c: distcomm.Communicator) -> tuple[int, int, list[int], bool]:
    import torch.distributed as dist

    c.create_local_groups(2)
    g = distcomm._LOCAL_PROCESS_GROUP
    t = torch.tensor([float(c.rank)])
    dist.all_reduce(t, group=g)
    return c.local_rank, c.local_size, dist.get_process_group_ranks(g), bool(g is distcomm.get_local_process_group())


@pytest.mark.slow
def test_create_local_process_group_over_gloo() -> None:
    results = distcomm.testing.spawn(_gloo_regroup, 4, timeout=120)
    assert results == [(0, 2, [0, 1], True), (1, 2, [0, 1], True), (0, 2, [2, 3], True), (1, 2, [2, 3], True)]


def _reduce_shapes(c: distcomm.Communicator) -> Any:
    ok = c.reduce_dict({"v": torch.tensor([[1.0, 2.0], [3.0, 4.0]]) * (c.rank + 1), "s": torch.tensor(c.rank)})
    try:
        c.all_reduce_dict({"v": torch.ones(2 + c.rank)})
        err = None
    except distcomm.CollectiveMismatchError as e:
        err = (str(e), list(e.ranks))
    return {k: v.tolist() for k, v in ok.items()}, err


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_reduce_dict_of_any_shape(world: str) -> None:
    run = distcomm.testing.spawn if world == "gloo" else run_threaded
    results = run(_reduce_shapes, 2, timeout=120)
    assert results[0][0] == {"s": 0.5, "v": [[1.5, 3.0], [4.5, 6.0]]}
    assert results[1][0] == {"s": 1, "v": [[2.0, 4.0], [6.0, 8.0]]}  # off rank 0: the input
    for _, (text, ranks) in results:
        assert "different shapes" in text and "'v': rank 0 (2,), rank 1 (3,)" in text and ranks == [1]
