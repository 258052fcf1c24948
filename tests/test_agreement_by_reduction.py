"""Agreement in a fixed-size reduction (NCCL's way, see docs/at-scale.md): every collective starts
with one sum of a 7-int64 vector per rank; agreement-only calls stop there when every rank agrees,
and any disagreement sends every rank to the slots' exchange, which names who differs. Tested on
gloo with the path turned on (NcclCommunicator has it on by default)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distcomm
from distcomm._agreement import agreed_by_sums, agreement_vector
from distcomm.testing import spawn
from tests._helpers import count_exchanges


def _sums(vectors: list[list[int]]) -> list[int]:
    return [sum(column) for column in zip(*vectors, strict=True)]


def test_the_sums_tell_agreement_exactly() -> None:
    alike = [agreement_vector(5, 12, -1, 2**64 - 1, True) for _ in range(1024)]
    assert agreed_by_sums(_sums(alike), 1024)
    for change in ({"op": 6}, {"seq": 13}, {"root": 0}, {"digest": 2**64 - 2}, {"ok": False}):
        call = {"op": 5, "seq": 12, "root": -1, "digest": 2**64 - 1, "ok": True} | change
        odd = [*alike[:-1], agreement_vector(call["op"], call["seq"], call["root"], call["digest"], call["ok"])]
        assert not agreed_by_sums(_sums(odd), 1024), change
    assert not agreed_by_sums(_sums(alike[:-1]), 1024)  # a rank short


def _counting(comm: distcomm.Communicator) -> list[int]:
    """Turn the path on; count the slots' exchanges from now on."""
    comm._agrees_by_reduction = True  # type: ignore[misc]
    return count_exchanges(comm)


def _per_step(comm: distcomm.Communicator) -> dict[str, Any]:
    exchanges = _counting(comm)
    comm.synchronize()
    losses = comm.all_reduce_dict({"loss": torch.tensor(float(comm.rank)), "n": 1})
    on_root = comm.reduce_dict({"loss": torch.tensor(1.0)}, average=False)
    t = comm.all_reduce(torch.full((3,), float(comm.rank)))
    agreement_only = exchanges[0]
    gathered = comm.gather({"rank": comm.rank})
    seed = comm.shared_random_seed()
    return {"agreement_only": agreement_only, "after_objects": exchanges[0], "loss": losses["loss"].item(),
            "n": losses["n"].item(), "root": on_root["loss"].item(), "t": t.tolist(), "gathered": gathered,
            "seed": seed, "stats": comm.stats["synchronize"].bytes_sent}


@pytest.mark.parametrize("world", [2, pytest.param(6, marks=pytest.mark.slow)])
def test_agreement_only_calls_make_no_exchange_and_results_stay(world: int) -> None:
    results = spawn(_per_step, world, timeout=120)
    n = world
    for r, got in enumerate(results):
        assert got["agreement_only"] == 0  # synchronize, the two dict reductions, a checked all_reduce
        assert got["after_objects"] >= 2  # a gather and the seed's broadcast still exchange slots
        assert got["loss"] == sum(range(n)) / n and got["n"] == 1.0
        assert got["root"] == (n if r == 0 else 1.0)
        assert got["t"] == [float(sum(range(n)))] * 3
        assert got["gathered"] == ([{"rank": q} for q in range(n)] if r == 0 else [])
        assert got["stats"] > 0  # the agreement's sum is counted
    assert len({g["seed"] for g in results}) == 1


def _keys_differ(comm: distcomm.Communicator) -> str:
    _counting(comm)
    try:
        comm.all_reduce_dict({"loss" if comm.rank == 0 else "lost": torch.tensor(1.0)})
    except distcomm.CollectiveMismatchError as e:
        return str(e)
    return "no error"


def _different_calls(comm: distcomm.Communicator) -> str:
    _counting(comm)
    try:
        if comm.rank == 0:
            comm.synchronize()
        else:
            comm.gather(comm.rank)
    except distcomm.CollectiveMismatchError as e:
        return str(e)
    return "no error"


def _bad_input(comm: distcomm.Communicator) -> str:
    _counting(comm)
    try:
        comm.all_reduce_dict({"loss": "not a number" if comm.rank == 1 else torch.tensor(1.0)})
    except distcomm.CollectiveError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_a_disagreement_raises_the_same_error_on_every_rank() -> None:
    keys = spawn(_keys_differ, 2, timeout=120)
    assert keys[0] == keys[1] and "different keys" in keys[0]
    calls = spawn(_different_calls, 2, timeout=120)
    assert calls[0] == calls[1] and "different collectives" in calls[0]
    bad = spawn(_bad_input, 2, timeout=120)
    assert bad[0] == bad[1] and "failed on rank 1" in bad[0] and "not a tensor" in bad[0]
