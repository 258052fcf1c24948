"""DDP and FSDP2 in run_threaded's in-process world: ``comm.group`` is a torch ProcessGroup over the
threaded communicator's own collectives."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import distcomm
from distcomm.testing import ThreadedCommunicator, run_threaded

WORLD = 4


def _model(seed: int = 0) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # each rank's data differs
    return torch.randn(5, 3, generator=g), torch.randn(5, 1, generator=g)


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def test_ddp_averages_gradients_and_adam_keeps_ranks_identical() -> None:
    def fit(comm: ThreadedCommunicator) -> tuple[list[list[torch.Tensor]], list[torch.Tensor]]:
        # a rank's model starts from its own values: DDP's constructor broadcasts rank 0's
        model = _model(seed=comm.rank)
        ddp = DistributedDataParallel(model, process_group=comm.group)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        grads = []
        for step in range(3):
            opt.zero_grad()
            _loss(ddp, comm.rank, step).backward()
            grads.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
            opt.step()
        comm.check_identical(model, opt)
        return grads, [p.detach().clone() for p in model.parameters()]

    results = run_threaded(fit, WORLD, timeout=60)
    # one process, the same steps: each step's gradient is the ranks' mean
    model = _model(seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        per_rank = [torch.autograd.grad(_loss(model, r, step), list(model.parameters())) for r in range(WORLD)]
        mean = [torch.stack(gs).mean(0) for gs in zip(*per_rank, strict=True)]
        for grads, _ in results:
            for got, want in zip(grads[step], mean, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        for p, g in zip(model.parameters(), mean, strict=True):
            p.grad = g
        opt.step()
    for _, params in results:
        for got, want in zip(params, model.parameters(), strict=True):
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)
    first = results[0][1]
    assert all(all(torch.equal(a, b) for a, b in zip(first, params, strict=True)) for _, params in results)


def test_torch_sees_each_thread_as_its_rank() -> None:
    def ranks(comm: ThreadedCommunicator) -> tuple[Any, ...]:
        group = comm.group
        assert comm.group is group  # made once per communicator
        pair = comm.split(comm.rank // 2)
        assert pair is not None
        return (dist.get_rank(), dist.get_world_size(), dist.get_rank(group), dist.get_world_size(group),
                dist.get_process_group_ranks(pair.group), dist.get_rank(pair.group), group.getBackendName())

    assert run_threaded(ranks, WORLD) == [
        (r, WORLD, r, WORLD, [r // 2 * 2, r // 2 * 2 + 1], r % 2, "distcomm") for r in range(WORLD)]


# (torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor, deprecating the old names)
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def test_torch_collectives_over_the_group() -> None:
    def calls(comm: ThreadedCommunicator) -> dict[str, list[float]]:
        g, r = comm.group, float(comm.rank)
        out: dict[str, list[float]] = {}
        t = torch.tensor([r, 1.0])
        dist.all_reduce(t, group=g)
        out["all_reduce"] = t.tolist()
        t = torch.tensor([r])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
        out["max"] = t.tolist()
        gathered = torch.empty(2 * WORLD)
        _all_gather_single(gathered, torch.tensor([r, -r]), group=g)
        out["all_gather_single"] = gathered.tolist()
        parts = [torch.empty(1) for _ in range(WORLD)]
        dist.all_gather(parts, torch.tensor([r]), group=g)
        out["all_gather"] = [float(p) for p in parts]
        mine = torch.empty(1)
        _reduce_scatter_single(mine, torch.arange(float(WORLD)) + r, group=g)
        out["reduce_scatter_single"] = mine.tolist()
        t = torch.tensor([r])
        dist.broadcast(t, src=2, group=g)
        out["broadcast"] = t.tolist()
        got = torch.empty(WORLD)
        dist.all_to_all_single(got, torch.arange(float(WORLD)) + 10 * r, group=g)
        out["all_to_all_single"] = got.tolist()
        parts = [torch.empty(1) for _ in range(WORLD)] if r == 1 else None
        dist.gather(torch.tensor([r]), parts, dst=1, group=g)
        out["gather"] = [float(p) for p in parts] if parts else []
        t = torch.empty(1)
        dist.scatter(t, [torch.tensor([10.0 * q]) for q in range(WORLD)] if r == 0 else None, src=0, group=g)
        out["scatter"] = t.tolist()
        t = torch.tensor([r])
        if comm.rank % 2 == 0:  # pairs (0, 1), (2, 3) swap their ranks
            dist.send(t, comm.rank + 1, group=g)
            dist.recv(t, comm.rank + 1, group=g)
        else:
            got = torch.empty(1)
            dist.recv(got, comm.rank - 1, group=g)
            dist.send(t, comm.rank - 1, group=g)
            t = got
        out["send_recv"] = t.tolist()
        dist.barrier(group=g)
        return out

    results = run_threaded(calls, WORLD)
    total = float(sum(range(WORLD)))
    for r, out in enumerate(results):
        assert out["all_reduce"] == [total, WORLD]
        assert out["max"] == [WORLD - 1]
        assert out["all_gather_single"] == [v for q in range(WORLD) for v in (q, -q)]
        assert out["all_gather"] == list(range(WORLD))
        assert out["reduce_scatter_single"] == [WORLD * r + total]
        assert out["broadcast"] == [2.0]
        assert out["all_to_all_single"] == [10.0 * q + r for q in range(WORLD)]
        assert out["gather"] == (list(range(WORLD)) if r == 1 else [])
        assert out["scatter"] == [10.0 * r]
        assert out["send_recv"] == [r ^ 1]


def _train_step(ddp: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    opt.zero_grad(set_to_none=True)
    _loss(ddp, rank, step).backward()
    opt.step()


def _elastic_fit(comm: ThreadedCommunicator, steps: int = 8) -> distcomm.Membership:
    """docs/elastic.md's loop: the state goes round, DDP is built again over each membership's group."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    progress, share = {"step": 0}, True
    ddp: torch.nn.Module = model
    while True:
        try:
            if share:
                comm.sync_state(model, opt, progress)
                ddp = DistributedDataParallel(model, process_group=comm.group)
                share = False
            if progress["step"] >= steps:
                break
            _train_step(ddp, opt, comm.rank, progress["step"])
            progress["step"] += 1
            new = comm.admit()
            if new is not comm:
                comm, share = new, True  # type: ignore[assignment]
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            comm, share = comm.shrink(), True  # type: ignore[assignment]
    comm.check_identical(model, opt)
    return comm.membership


@pytest.mark.parametrize("lose_at", [2, 5, 9])  # in DDP's constructor, in its allreduce, in an admit
def test_elastic_loop_with_ddp_loses_and_readmits_a_rank(lose_at: int) -> None:
    members = run_threaded(_elastic_fit, WORLD, timeout=60, lose={2: lose_at}, replacements=1)
    assert all(m == distcomm.Membership((0, 1, 2, 3), admitted=(2,)) for m in members)


def test_elastic_loop_with_ddp_shrinks() -> None:
    members = run_threaded(_elastic_fit, WORLD, timeout=60, lose={2: 5})
    assert members[2] is None
    assert all(m == distcomm.Membership((0, 1, 3), lost=(2,)) for r, m in enumerate(members) if r != 2)


def test_a_rank_lost_in_ddps_allreduce_fails_the_others_step_as_a_rank_loss() -> None:
    def step(comm: ThreadedCommunicator) -> str:
        ddp = DistributedDataParallel(_model(), process_group=comm.group)
        calls = comm.stats["all_reduce"].calls if "all_reduce" in comm.stats else 0
        try:
            _loss(ddp, comm.rank, 0).backward()  # DDP's allreduce: the lost rank's next collective
        except Exception as e:
            assert distcomm.is_rank_loss(e), e
            assert comm.stats["all_reduce"].calls == calls + 1
            return type(e).__name__
        return "finished"

    entered = run_threaded(lambda comm: (DistributedDataParallel(_model(), process_group=comm.group),
                                         comm.stats)[1], 2)
    construction = sum(s.calls for s in entered[0].values())  # collectives DDP's constructor makes
    results = run_threaded(step, WORLD, timeout=30, lose={1: construction + 1})
    assert results[1] is None
    assert [results[r] for r in (0, 2, 3)] == ["PeerError"] * 3


def test_groups_leave_torchs_tables_when_their_communicators_close() -> None:
    names = run_threaded(lambda comm: comm.group.group_name, 2)
    world = dist.distributed_c10d._world
    assert not [g for g in world.pg_names if g.group_name in names]
    assert not dist.is_initialized()  # this thread's default group is torch's own


def _fsdp_losses(comm: ThreadedCommunicator, fsdp: bool) -> list[float]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    if fsdp:
        fully_shard(model, mesh=DeviceMesh.from_group(comm.group, "cpu"))
    else:
        model = DistributedDataParallel(model, process_group=comm.group)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    losses = []
    for step in range(4):
        opt.zero_grad()
        loss = _loss(model, comm.rank, step)
        loss.backward()
        opt.step()
        losses.append(float(comm.all_reduce(loss.detach().clone(), "mean")))
    return losses


def test_fsdp2_trains_like_ddp() -> None:
    ddp = run_threaded(lambda comm: _fsdp_losses(comm, fsdp=False), 2, timeout=60)
    fsdp = run_threaded(lambda comm: _fsdp_losses(comm, fsdp=True), 2, timeout=60)
    assert ddp[0] == ddp[1] and fsdp[0] == fsdp[1]
    assert fsdp[0] == pytest.approx(ddp[0], rel=1e-5)
