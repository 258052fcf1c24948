"""sync_state and check_identical: the whole training state (a model, Adam, a dict) on every member,
fingerprints first; refusals alike on every rank."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded, spawn

from ._helpers import count_calls


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its Adam after one step, both differing by ``seed``."""
    numbers = torch.Generator().manual_seed(seed)  # (not the global one: threaded ranks share it)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=numbers))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4, generator=numbers)).sum().backward()
    opt.step()
    return model, opt


def _differ_then_sync(comm: distcomm.Communicator) -> dict[str, Any]:
    """Ranks 0 and 1 alike, the others not: who differs and where, then one state everywhere."""
    sends = count_calls(comm, "isend")
    model, opt = _trained(seed=max(comm.rank - 1, 0))
    progress = {"step": 10 + max(comm.rank - 1, 0)}
    with pytest.raises(distcomm.CollectiveMismatchError) as caught:
        comm.check_identical(model, opt, progress)
    comm.sync_state(model, opt, progress)
    sent = sends[0]
    comm.check_identical(model, opt, progress)
    comm.sync_state(model, opt, progress)  # all agree now: fingerprints only
    return {"error": str(caught.value), "ranks": caught.value.ranks, "progress": progress, "sent": sent,
            "sent_again": sends[0] - sent, "weight": next(model.parameters()).sum().item(),
            "adam_step": float(opt.state_dict()["state"][0]["step"])}


def _check_differ_then_sync(results: list[dict[str, Any]]) -> None:
    n = len(results)
    for r, got in enumerate(results):
        assert got["error"] == results[0]["error"], (r, got)
        assert got["ranks"] == tuple(range(2, n)), got
        assert "first at object 0 (Sequential), key '0.weight'" in got["error"], got
        assert got["progress"] == {"step": 10}, got
        assert got["weight"] == results[0]["weight"] and got["adam_step"] == 1.0, got
        assert got["sent"] == (n - 2 if r == 0 else 0) and got["sent_again"] == 0, (r, got)


def test_members_that_differ_are_named_then_given_the_first_members_state_threaded() -> None:
    _check_differ_then_sync(run_threaded(_differ_then_sync, 4, timeout=60))


def test_members_that_differ_are_named_then_given_the_first_members_state_gloo() -> None:
    _check_differ_then_sync(spawn(_differ_then_sync, 3, timeout=120))


def test_a_first_key_that_only_some_have_is_named() -> None:
    def fn(comm: distcomm.Communicator) -> str:
        state = {"a": torch.zeros(2), **({"b": torch.ones(1)} if comm.rank == 1 else {})}
        with pytest.raises(distcomm.CollectiveMismatchError) as caught:
            comm.check_identical(state)
        return str(caught.value)

    for got in run_threaded(fn, 2, timeout=60):
        assert "key 'b', which rank 0 lacks" in got, got


def test_what_is_no_state_is_refused_on_every_rank() -> None:
    def fn(comm: distcomm.Communicator) -> str:
        with pytest.raises(TypeError) as caught:
            comm.sync_state(torch.nn.Linear(1, 1), [1, 2] if comm.rank == 2 else {})
        return str(caught.value)

    for got in run_threaded(fn, 3, timeout=60):
        assert got.endswith("rank 2: object 1 is a list"), got


def test_different_numbers_of_objects_are_a_mismatch_on_every_rank() -> None:
    def fn(comm: distcomm.Communicator) -> tuple[int, ...]:
        with pytest.raises(distcomm.CollectiveMismatchError) as caught:
            comm.check_identical(*[{"x": torch.zeros(1)}] * (1 + (comm.rank == 1)))
        return caught.value.ranks

    assert run_threaded(fn, 3, timeout=60) == [(1,)] * 3


def _state_calls_crossed(comm: distcomm.Communicator) -> tuple[str, tuple[int, ...]]:
    model = _trained(comm.rank)[0]  # states that differ: check_identical would go on to a second exchange
    with pytest.raises(distcomm.CollectiveMismatchError) as caught:
        if comm.rank == 0:
            comm.sync_state(model)  # a newcomer's first call, beside members that left their loop
        else:
            comm.check_identical(model)
    return str(caught.value).split(": ", 1)[1], caught.value.ranks


@pytest.mark.parametrize("run", ["threads", "gloo"])
def test_sync_state_beside_check_identical_is_a_mismatch_on_every_rank(run: str) -> None:
    """Both meet in one all_gather first: without naming the call, they waited in different ones."""
    outs = run_threaded(_state_calls_crossed, 2, timeout=60) if run == "threads" else \
        spawn(_state_calls_crossed, 2, timeout=60)
    assert outs == [("the ranks called different state calls: rank 0 sync_state, rank 1 check_identical",
                     (1,))] * 2


def test_the_doubles_agree_with_themselves() -> None:
    """A world of one, and a fake whose peers echo its own calls, hold one state."""
    model, opt = _trained(seed=0)
    for comm in (distcomm.LocalCommunicator(), FakeCommunicator(rank=1, world_size=3)):
        comm.sync_state(model, opt)
        comm.check_identical(model, opt)
