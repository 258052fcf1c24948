"""HSDP (FSDP2 over ``comm.device_mesh``) in run_threaded's in-process world, with lost ranks: the
replica is the unit of failure, as in a real job (``tests/test_hsdp_elastic.py``). The other
replica steps on alone; the lost rank's replica peer waits in ``shrink()`` until the replacement
makes the replica whole, and the members' ``admit()`` lets both in together."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch.distributed.fsdp import fully_shard

import distcomm
from distcomm.testing import ThreadedCommunicator, run_threaded

STEPS = 10
TIMEOUT = 120.0  # (each world is bounded: a hang fails the test, named)


def _model() -> torch.nn.Sequential:
    # (each rank's draws differ, the process's generator being shared by the threads: the first
    # sync_state makes the replicas agree)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    return x, x.sum(1, keepdim=True)


def _expected_grads(model: torch.nn.Module, plain: torch.nn.Module, n: int) -> list[torch.Tensor]:
    """The mean over the membership's ``n`` ranks of each rank's gradient, on one unsharded model
    (a collective: each parameter's ``full_tensor``)."""
    x, y = _data()
    with torch.no_grad():
        for p, q in zip(model.parameters(), plain.parameters(), strict=True):
            q.copy_(p.full_tensor())
    plain.zero_grad()
    for r in range(n):
        (torch.nn.functional.mse_loss(plain(x[r::n]), y[r::n]) / n).backward()
    return [q.grad.clone() for q in plain.parameters()]  # type: ignore[union-attr]


def _hsdp(comm: distcomm.Communicator) -> dict[str, Any]:
    """docs/elastic.md's loop over HSDP; what each rank saw."""
    mesh = comm.device_mesh((2, 2), ("replicate", "shard"))
    model, plain = _model(), _model()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _data()
    progress, share, worst = {"step": 0}, True, 0.0
    said: dict[str, Any] = {"shrinks": [], "admits": []}
    while True:
        try:
            if share:
                comm.sync_state(model, opt, progress)
                share = False
            if progress["step"] >= STEPS:
                break
            n, r = comm.world_size, comm.rank
            want = _expected_grads(model, plain, n)
            torch.nn.functional.mse_loss(model(x[r::n]), y[r::n]).backward()
            for p, w in zip(model.parameters(), want, strict=True):
                worst = max(worst, (p.grad.full_tensor() - w).abs().max().item())  # type: ignore[union-attr]
            opt.step()
            opt.zero_grad()
            progress["step"] += 1
            new = comm.admit()
            if new is not comm:
                comm, share = new, True
                said["admits"].append((progress["step"], comm.membership))
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            was = progress["step"]
            comm, share = comm.shrink(), True
            said["shrinks"].append((was, comm.membership, comm._holds_state))
    comm.check_identical(model, opt)
    said.update(step=progress["step"], membership=comm.membership, worst=worst,
                shards=[p.to_local().detach().clone() for p in model.parameters()])
    return said


def test_the_other_replica_steps_on_and_the_lost_one_comes_back_whole() -> None:
    said = run_threaded(_hsdp, 4, lose={3: 7}, replacements=1, timeout=TIMEOUT)
    whole = distcomm.Membership((0, 1, 2, 3), admitted=(2, 3))
    assert all(s["step"] == STEPS and s["membership"] == whole for s in said), said
    # the healthy replica went on alone, holding the state
    for r in (0, 1):
        assert [m for _, m, _ in said[r]["shrinks"]] == [distcomm.Membership((0, 1), lost=(3,))], said[r]
        assert [m for _, m in said[r]["admits"]] == [whole], said[r]
    # the lost rank's peer waited in shrink() until its replica was whole again, its state behind
    assert said[2]["shrinks"] == [(said[2]["shrinks"][0][0], whole, False)], said[2]
    assert said[2]["admits"] == [] and said[3]["shrinks"] == said[3]["admits"] == [], said
    assert said[0]["admits"][0][0] > said[2]["shrinks"][0][0]  # the healthy replica stepped meanwhile
    # each rank's shards are its shard coordinate's in the other replica, bit for bit
    for a, b in ((0, 2), (1, 3)):
        assert all(torch.equal(p, q) for p, q in zip(said[a]["shards"], said[b]["shards"], strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(said[0]["shards"], said[1]["shards"], strict=True))
    # every step's gradient, with 2 replicas and with 1, was the mean over the membership's ranks
    assert all(s["worst"] < 1e-5 for s in said), [s["worst"] for s in said]


def test_a_loss_in_every_replica_ends_the_job_saying_why() -> None:
    with pytest.raises(distcomm.RankFailedError) as failed:
        run_threaded(_hsdp, 4, lose={1: 7, 3: 7}, timeout=TIMEOUT)
    refused = {r: e for r, e in failed.value.errors.items() if isinstance(e, distcomm.CommunicatorStateError)}
    assert refused and set(failed.value.errors) == set(refused), failed.value.errors
    assert all("no replica of the job's mesh (2, 2)" in str(e) and "can't go on" in str(e) for e in refused.values())


def test_a_replica_still_broken_when_the_job_ends_is_let_go() -> None:
    """No replacement: the lost rank's peer waits in shrink() until the members have all returned,
    then its thread ends, as the agent ends such a process; its result is None, as a lost rank's."""
    said = run_threaded(_hsdp, 4, lose={3: 7}, timeout=TIMEOUT)
    assert said[2] is None and said[3] is None, said
    assert all(s["step"] == STEPS and s["membership"] == distcomm.Membership((0, 1), lost=(3,)) for s in said[:2])


def test_the_wait_for_a_whole_replica_is_bounded_by_the_shrinks_timeout() -> None:
    def fn(comm: ThreadedCommunicator) -> distcomm.Membership:
        comm.device_mesh((2, 2), ("replicate", "shard"))
        try:
            for _ in range(5):
                comm.all_reduce(torch.ones(1))
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            comm = comm.shrink(timeout=0.5)  # type: ignore[assignment]
            time.sleep(3.0)  # (the members are still there: rank 2 is not let go, it times out)
        return comm.membership

    with pytest.raises(distcomm.RankFailedError) as failed:
        run_threaded(fn, 4, lose={3: 4}, timeout=30)
    assert failed.value.rank == 2 and isinstance(failed.value.exception, distcomm.CollectiveTimeoutError)
    assert "waited 0.5 s for its replica to be whole again" in str(failed.value.exception)
