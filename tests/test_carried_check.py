"""A small checked all_reduce, broadcast_tensor or (all_)reduce_dict rides in its own check (worlds of up to 4 ranks):
every rank's tensor in its slot, one exchange instead of the check's and the native collective's.
Results as torch's on the same group, the same errors for tensors that differ (a small one beside a
large one included), and the communicator usable after them; over gloo processes and the threads."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import distcomm
from distcomm.testing import run_threaded, spawn

from ._helpers import count_calls, count_exchanges

_TORCH_OP = {"sum": dist.ReduceOp.SUM, "prod": dist.ReduceOp.PRODUCT, "max": dist.ReduceOp.MAX,
             "min": dist.ReduceOp.MIN}


def _against_torch(comm: distcomm.Communicator) -> dict[str, Any]:
    exchanges, native = count_exchanges(comm), count_calls(comm, "_tensor_reduce")
    differ = []
    for dtype in (torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8):
        for op in ("sum", "prod", "max", "min"):
            if dtype.is_floating_point and op in ("max", "min"):
                continue  # (these stay in the ring: see folds_as_ring)
            t = (torch.arange(5) % 3 + comm.rank + 1).to(dtype)
            ours, theirs = t.clone(), t.clone()
            comm.all_reduce(ours, op=op)
            dist.all_reduce(theirs, op=_TORCH_OP[op], group=comm.group)
            if not torch.allclose(ours.double(), theirs.double(), rtol=1e-6):
                differ.append(f"{dtype} {op}: {ours.tolist()} != {theirs.tolist()}")
    mean = torch.full((3,), float(comm.rank))
    comm.all_reduce(mean, op="mean")
    src = torch.arange(4.0) + comm.rank
    comm.broadcast_tensor(src, src=comm.world_size - 1)
    small = (exchanges[0], native[0])
    comm.all_reduce(torch.ones(2000))  # 8 KB: over what a slot carries, the check and the native collective
    return {"differ": differ, "mean": mean.tolist(), "src": src.tolist(), "small": small,
            "large": (exchanges[0] - small[0], native[0] - small[1])}


@pytest.mark.parametrize("world", [2, 4])
def test_small_checked_calls_ride_in_the_check_with_torchs_results(world: int) -> None:
    expected_mean = [sum(range(world)) / world] * 3
    for r, got in enumerate(spawn(_against_torch, world, timeout=120)):
        assert got["differ"] == [], (r, got["differ"][:3])
        assert got["mean"] == expected_mean and got["src"] == [world - 1.0 + i for i in range(4)], got
        assert got["small"] == (16 + 2, 0), got  # one exchange per call, no native all_reduce
        assert got["large"] == (1, 1), got


def _small_beside_large(comm: distcomm.Communicator) -> tuple[str, list[float]]:
    t = torch.ones(4) if comm.rank == 0 else torch.ones(1000)  # rank 0 would carry, rank 1 would not
    try:
        comm.all_reduce(t)
        said = "no error"
    except distcomm.CollectiveMismatchError as e:
        said = str(e)
    after = torch.ones(3)
    comm.all_reduce(after)  # still usable: the mismatch was found before anything moved
    return said, after.tolist()


@pytest.mark.parametrize("run", ["gloo", "threads"])
def test_a_small_tensor_beside_a_large_one_is_the_same_error_on_every_rank(run: str) -> None:
    outs = spawn(_small_beside_large, 2, timeout=120) if run == "gloo" else run_threaded(_small_beside_large, 2)
    for said, after in outs:
        assert "all_reduce: the ranks' tensors differ" in said, said
        assert "rank 0: torch.float32 (4,)" in said and "rank 1: torch.float32 (1000,)" in said, said
        assert after == [2.0, 2.0, 2.0]
    assert outs[0][0] == outs[1][0]


def test_the_threaded_world_carries_as_gloo_does() -> None:
    def call(comm: distcomm.Communicator) -> tuple[int, list[float]]:
        exchanges, t = count_exchanges(comm), torch.full((2,), float(comm.rank))
        comm.all_reduce(t)
        return exchanges[0], t.tolist()

    assert run_threaded(call, 3) == [(1, [3.0, 3.0])] * 3


def _dicts_both_ways(comm: distcomm.Communicator) -> dict[str, Any]:
    """Each dict reduced riding in its check, then with carrying off (the check, then torch's
    collective): the results, and the exchanges and native reductions each way took."""
    import distcomm._tensors as tensors

    r = comm.rank
    cases = {
        "float mean": ({"loss": torch.tensor(0.1 * (r + 1)), "acc": torch.tensor([r, 2.0 * r])}, "mean"),
        "int mean": ({"n": torch.tensor([2**62 + r, -r], dtype=torch.int64)}, "mean"),
        "uint64 max": ({"u": torch.tensor([2**63 + r, r], dtype=torch.uint64)}, "max"),
        "int min": ({"i": torch.tensor(5 - r, dtype=torch.int32), "b": torch.tensor(r % 2 == 0)}, "min"),
        "float max (the ring)": ({"x": torch.tensor(float(r))}, "max"),
        "numbers": ({"a": 1.5 * r, "b": r}, "sum"),
    }
    out: dict[str, Any] = {}
    for carry in (tensors.CARRY_BYTES, 0):
        tensors.CARRY_BYTES = carry
        exchanges, native = count_exchanges(comm), count_calls(comm, "_reduce_traffic")  # once per native one
        for name, (d, op) in cases.items():
            got = comm.all_reduce_dict(d, op=op)
            on_root = comm.reduce_dict(d, op=op)
            out[f"{name} carry={bool(carry)}"] = ({k: v.tolist() for k, v in got.items()},
                                                 {k: v.tolist() for k, v in on_root.items()} if r == 0 else None)
        out[f"calls carry={bool(carry)}"] = (exchanges[0], native[0])
    tensors.CARRY_BYTES = 1024
    return out


@pytest.mark.parametrize("run", ["gloo", "threads"])
def test_a_small_reduce_dict_rides_in_its_check_with_the_native_results(run: str) -> None:
    world = 3
    outs = spawn(_dicts_both_ways, world, timeout=120) if run == "gloo" else run_threaded(_dicts_both_ways, world)
    for got in outs:
        for key in got:
            if key.endswith("carry=True") and not key.startswith("calls"):
                assert got[key] == got[key.replace("True", "False")], key
        # 6 dicts, each all_reduce_dict and reduce_dict: one exchange each, but the float max (twice)
        assert got["calls carry=True"] == (12, 2), got["calls carry=True"]
        assert got["calls carry=False"] == (12, 12), got["calls carry=False"]
    assert outs[0]["int mean carry=True"][0] == {"n": [float(2**62 + 1), -1.0]}
    assert outs[0]["uint64 max carry=True"][0] == {"u": [2**63 + 2, 2]}


def _overflowing(comm: distcomm.Communicator) -> tuple[list[list[float]], list[str]]:
    import warnings

    big = torch.finfo(torch.float32).max
    values = [big, -big, float("inf") * (1 if comm.rank == 0 else -1), 1.0]
    ours, theirs = torch.tensor(values), torch.tensor(values)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        comm.all_reduce(ours)
    dist.all_reduce(theirs, group=comm.group)
    return [ours.tolist(), theirs.tolist()], [str(w.message) for w in caught]


def test_a_carried_sum_that_overflows_gives_torchs_inf_and_nan_without_warnings() -> None:
    """torch's ring sums to inf and nan silently; numpy's fold would warn, and must not."""
    for (ours, theirs), caught in spawn(_overflowing, 2, timeout=120):
        assert str(ours) == str(theirs) == str([float("inf"), float("-inf"), float("nan"), 2.0]), (ours, theirs)
        assert caught == [], caught


def _tensors_alike_but_for_their_memory(comm: distcomm.Communicator) -> dict[str, Any]:
    """What only one rank's tensor is: requiring grad (the others' batch was empty), a transposed
    view (a receive buffer), a negative view. The check compares dtype, shape and op alone."""
    weight = torch.ones(3, requires_grad=True)
    loss = (weight * 2).sum().reshape(1) if comm.rank else torch.zeros(1)
    with torch.no_grad():
        comm.all_reduce(loss)
    received = torch.zeros(2, 3).t() if comm.rank else torch.arange(6.0).reshape(3, 2)
    comm.broadcast_tensor(received, src=0)
    negative = torch.ones(2)._neg_view() if comm.rank else torch.ones(2)
    comm.all_reduce(negative)
    leaf = torch.full((2,), 1.0 + comm.rank, requires_grad=bool(comm.rank))
    comm.all_reduce(leaf, op="max")
    return {"loss": loss.tolist(), "received": received.tolist(), "negative": negative.tolist(),
            "leaf": leaf.tolist(), "grad": loss.requires_grad}


@pytest.mark.parametrize("run", ["threads", "gloo"])
def test_ranks_that_differ_only_in_grad_or_layout_reduce_as_before(run: str) -> None:
    outs = run_threaded(_tensors_alike_but_for_their_memory, 2, timeout=60) if run == "threads" else \
        spawn(_tensors_alike_but_for_their_memory, 2, timeout=60)
    for r, got in enumerate(outs):
        assert got == {"loss": [6.0], "received": torch.arange(6.0).reshape(3, 2).tolist(), "negative": [0.0, 0.0],
                       "leaf": [2.0, 2.0], "grad": r == 1}, (r, got)


def _reduced_between_forward_and_backward(comm: distcomm.Communicator) -> list[bool]:
    """A parameter summed in place after the forward pass, as a small and as a large one: the
    backward pass runs after both (torch's own all_reduce bumps no version counter either)."""
    ran = []
    for n in (4, 1000):  # (carried in the check, and not)
        weight = torch.ones(n, requires_grad=True)
        loss = (weight * weight).sum()
        comm.all_reduce(weight)
        loss.backward()
        ran.append(weight.grad is not None)
    return ran


@pytest.mark.parametrize("run", ["threads", "gloo"])
def test_a_small_tensor_reduced_in_place_keeps_autograd_as_a_large_one(run: str) -> None:
    outs = run_threaded(_reduced_between_forward_and_backward, 2, timeout=60) if run == "threads" else \
        spawn(_reduced_between_forward_and_backward, 2, timeout=60)
    assert outs == [[True, True]] * 2, outs
