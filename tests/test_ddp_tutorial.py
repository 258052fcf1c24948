"""The DDP tutorial's script (examples/ddp_tutorial/original.py) made elastic with ``ElasticLoop``
in a few lines (elastic.py), run under ``python -m distcomm run --replacements 1`` with a worker
killed mid-training; and ``ElasticLoop`` itself in ``run_threaded``'s world: DDP and Adam, the data
re-sharded from where the epoch is, a replacement handed everything, and what it refuses."""

from __future__ import annotations

import os
import subprocess
import textwrap
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset, WeightedRandomSampler

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded

from . import _forked
from .test_cli import ROOT

TUTORIAL = ROOT / "examples" / "ddp_tutorial"

# The fault, from outside the script (which stays the tutorial's): sitecustomize runs in each worker
# as it starts, and an optimizer step hook SIGKILLs job rank <victim>'s first process at its <at>-th
# step; until the replacement has stepped, the members' steps take 0.2 s (a longer step), so that
# it comes in before the job ends however slowly it starts.
KILLER = """
    import os
    if os.environ.get("RANK") is not None and os.environ.get("TUTORIAL_KILL"):
        import signal, time
        from torch.optim.optimizer import register_optimizer_step_post_hook

        victim, at = map(int, os.environ["TUTORIAL_KILL"].split(":"))
        killed, joined = (os.path.join(os.environ["TUTORIAL_MARKS"], name) for name in ("killed", "joined"))
        steps = [0]

        def after_step(optimizer, args, kwargs):
            steps[0] += 1
            mine = int(os.environ["RANK"]) == victim
            if mine and steps[0] == at and not os.path.exists(killed):
                open(killed, "x").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if os.path.exists(killed) and not os.path.exists(joined):
                if mine:
                    open(joined, "a").close()  # the replacement's first step: it is in
                else:
                    time.sleep(0.2)

        register_optimizer_step_post_hook(after_step)
"""


def _changed_lines() -> int:
    """``diff -u original.py elastic.py | grep -c '^[+-][^+-]'``: the lines the elastic version changes."""
    diff = subprocess.run(["diff", "-u", "original.py", "elastic.py"], cwd=TUTORIAL, capture_output=True, text=True)
    return sum(1 for line in diff.stdout.splitlines() if len(line) > 1 and line[0] in "+-" and line[1] not in "+-")


def test_the_elastic_tutorial_changes_at_most_20_lines_of_it() -> None:
    assert 0 < _changed_lines() <= 20, _changed_lines()


@pytest.mark.parametrize("victim", [1, pytest.param(0, marks=pytest.mark.slow)])
def test_the_elastic_tutorial_outlives_a_killed_worker_and_admits_its_replacement(tmp_path: Path,
                                                                                  victim: int) -> None:
    """Rank 0 too (slow): its replacement loads the snapshot the lost one saved, then takes the members' state."""
    hook, marks, logs = tmp_path / "hook", tmp_path / "marks", tmp_path / "logs"
    hook.mkdir()
    marks.mkdir()
    (hook / "sitecustomize.py").write_text(textwrap.dedent(KILLER))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=os.pathsep.join([str(hook), str(ROOT), env.get("PYTHONPATH", "")]),
               TUTORIAL_KILL=f"{victim}:30", TUTORIAL_MARKS=str(marks), PYTHONWARNINGS="ignore::UserWarning")
    epochs = 6
    out = _forked.run(["-m", "distcomm", "run", "--nproc-per-node", "3", "--replacements", "1", "--log-dir",
                       str(logs), str(TUTORIAL / "elastic.py"), str(epochs), "3"], env, tmp_path, timeout=240)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-4000:]
    assert f"rank {victim} (pid " in out.stderr and "was lost (killed by SIGKILL); started again" in out.stderr
    assert f"distcomm: lost job rank(s) [{victim}]" in said and "going on with 2 ranks" in said, said[-4000:]
    assert f"distcomm: admitted job rank(s) [{victim}]" in said, said[-4000:]
    # the final check_identical passed on every member (a difference fails it on every rank, rc 1)
    assert "on 3 ranks; check_identical: every member holds the same state" in said, said[-4000:]
    replacement = (logs / f"rank{victim}.1.log").read_text()
    assert f"[GPU{victim}] Epoch {epochs - 1} |" in replacement, replacement[-3000:]
    assert (tmp_path / "snapshot.pt").exists()


# ElasticLoop in run_threaded's world

SAMPLES, BATCH, EPOCHS = 96, 4, 3


def _train(comm: distcomm.Communicator, trained: list[tuple[int, tuple[int, ...]]], lock: threading.Lock,
           said: list[str]) -> dict[str, Any]:
    """DDP and Adam over an ElasticLoop, the data sharded by it; records the samples each step trained on."""
    torch.manual_seed(comm.rank)  # every rank's model differs until the state goes round
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(SAMPLES, 4, generator=torch.Generator().manual_seed(0))
    data = TensorDataset(torch.arange(SAMPLES), x, x.sum(1, keepdim=True))
    held: dict[str, Any] = {}
    changes: list[int] = []

    def rebuilt(new: distcomm.Communicator) -> None:
        held["ddp"] = DistributedDataParallel(model, process_group=new.group)
        changes.append(new.world_size)

    loop = distcomm.ElasticLoop(comm, model, opt, on_change=rebuilt, check_every=3, log=said.append)
    batches = loop.shard(DataLoader(data, batch_size=BATCH, shuffle=True))

    def step(i: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, epoch: int) -> None:
        opt.zero_grad()
        torch.nn.functional.mse_loss(held["ddp"](xb), yb).backward()
        opt.step()
        with lock:
            trained.append((epoch, tuple(i.tolist())))

    for epoch in loop.epochs(EPOCHS):
        for i, xb, yb in batches:
            loop.run_step(step, i, xb, yb, epoch)
    state = [t.tolist() for t in (*model.parameters(), *(s["exp_avg"] for s in opt.state.values()))]
    return {"progress": dict(loop.progress), "members": loop.comm.membership.job_ranks, "state": state,
            "changes": changes}


def test_elastic_loop_with_ddp_survives_a_lost_rank_and_hands_its_replacement_the_whole_state() -> None:
    trained: list[tuple[int, tuple[int, ...]]] = []
    said: list[str] = []
    lock = threading.Lock()
    results = run_threaded(lambda comm: _train(comm, trained, lock, said), 4, lose={2: 9}, replacements=1, timeout=120)
    assert {tuple(r["members"]) for r in results} == {(0, 1, 2, 3)}
    assert all(r["state"] == results[0]["state"] for r in results)  # the replacement's Adam moments too
    steps = results[0]["progress"]["step"]
    assert all(r["progress"] == {"epoch": EPOCHS, "step": steps, "sample": 0} for r in results)
    assert results[0]["changes"] == [4, 3, 4] and results[2]["changes"] == [4], results  # DDP rebuilt each time
    assert [m.split(" at step")[0] for m in said[:-1]] == ["lost job rank(s) [2]", "admitted job rank(s) [2]"], said
    assert said[-1] == f"finished at step {steps} on 4 ranks; check_identical: every member holds the same state"
    for epoch in range(EPOCHS):  # every sample of every epoch trained on, re-sharded after each change
        seen = Counter(i for e, batch in trained if e == epoch for i in batch)
        assert set(seen) == set(range(SAMPLES)), epoch
        assert sum(seen.values()) <= SAMPLES + 4 * BATCH, seen  # at most the one step lost, again


def test_elastic_loop_steps_without_data_go_on_after_a_loss() -> None:
    def fn(comm: distcomm.Communicator) -> tuple[dict[str, int], int]:
        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        loop = distcomm.ElasticLoop(comm, model, opt, log=None)

        def step() -> None:
            for p in model.parameters():
                p.grad = torch.ones_like(p)
                loop.comm.all_reduce(p.grad, "mean")
            opt.step()

        for _ in loop.steps(10):
            loop.run_step(step)
        return loop.progress, loop.comm.world_size

    results = run_threaded(fn, 4, lose={1: 6}, timeout=60)
    assert results[1] is None
    assert [results[r] for r in (0, 2, 3)] == [({"epoch": 0, "step": 10, "sample": 0}, 3)] * 3


@pytest.mark.parametrize(("n", "world", "shuffle", "drop_last"),
                         [(96, 4, True, False), (10, 3, True, False), (10, 3, False, True), (7, 4, False, False)])
def test_without_a_change_the_batches_are_distributed_samplers(n: int, world: int, shuffle: bool,
                                                               drop_last: bool) -> None:
    dataset = TensorDataset(torch.arange(n))
    for rank in range(world):
        comm = FakeCommunicator(rank, world)
        loop = distcomm.ElasticLoop(comm, torch.nn.Linear(1, 1), None, log=None)
        sampler = DistributedSampler(dataset, world, rank, shuffle=shuffle, drop_last=drop_last)
        sharded = loop.shard(DataLoader(dataset, batch_size=3, sampler=sampler))
        for epoch in (0, 1):
            loop.progress.update(epoch=epoch, sample=0)
            sampler.set_epoch(epoch)
            expected = [b[0].tolist() for b in DataLoader(dataset, batch_size=3, sampler=sampler)]
            assert len(sharded) == len(expected)
            assert [b[0].tolist() for b in sharded] == expected, (rank, epoch)


def test_after_a_change_the_rest_of_the_epoch_is_dealt_over_the_new_membership() -> None:
    dataset = TensorDataset(torch.arange(20))
    got = []
    for rank in range(3):
        loop = distcomm.ElasticLoop(FakeCommunicator(rank, 3), torch.nn.Linear(1, 1), None, log=None)
        loop.progress["sample"] = 8  # two steps of 4 ranks' batches of 1 done
        got.append([b[0].tolist() for b in loop.shard(DataLoader(dataset, batch_size=2, shuffle=False))])
    assert got == [[[8, 11], [14, 17]], [[9, 12], [15, 18]], [[10, 13], [16, 19]]]


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Any:
        return iter(range(3))


def test_what_elastic_loop_refuses_before_any_communication() -> None:
    comm = FakeCommunicator(0, 2)
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.Adam(model.parameters())
    with pytest.raises(TypeError, match=r"the model DDP wraps \(ddp.module\)"):
        distcomm.ElasticLoop(comm, DistributedDataParallel.__new__(DistributedDataParallel), opt)
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer, or None"):
        distcomm.ElasticLoop(comm, model, {"step": 0})
    with pytest.raises(ValueError, match="parameters that are not the model's"):
        distcomm.ElasticLoop(comm, torch.nn.Linear(2, 1), opt)
    with pytest.raises(TypeError, match="as ElasticLoop's third argument"):
        distcomm.ElasticLoop(comm, model, None, opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 1)
    with pytest.raises(ValueError, match="a learning-rate scheduler drives this optimizer: pass it too"):
        distcomm.ElasticLoop(comm, model, opt)
    distcomm.ElasticLoop(comm, model, opt, scheduler)  # with it: taken
    with pytest.raises(TypeError, match="state objects have state_dict"):
        distcomm.ElasticLoop(comm, model, None, object())
    with pytest.raises(ValueError, match="check_every must be an int >= 0"):
        distcomm.ElasticLoop(comm, model, None, check_every=-1)
    loop = distcomm.ElasticLoop(comm, model, None)
    with pytest.raises(TypeError, match="map-style dataset"):
        loop.shard(DataLoader(_Stream(), batch_size=2))
    weighted = WeightedRandomSampler([1.0, 1.0], 2)
    with pytest.raises(TypeError, match="re-shards a DataLoader over a DistributedSampler"):
        loop.shard(DataLoader(TensorDataset(torch.arange(2)), batch_size=2, sampler=weighted))
    with pytest.raises(ValueError, match="a range of step 1"):
        next(loop.epochs(range(0, 4, 2)))
    assert comm.calls == []
