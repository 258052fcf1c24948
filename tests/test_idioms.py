"""The clients' own idioms, as migrating torch, torchmetrics and mmengine users write them: barrier,
group= on every module helper, torch's method names, numbers in reduce_dict, all_reduce_dict's op."""

from __future__ import annotations

import inspect
import re
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded, spawn

HELPERS_WITH_GROUP = ["all_gather", "gather", "broadcast", "scatter", "shared_random_seed", "reduce_dict",
                      "all_reduce_dict", "all_reduce", "reduce", "broadcast_tensor", "all_gather_tensor",
                      "reduce_scatter_tensor", "reduce_object", "all_reduce_object", "scan", "exscan", "all_to_all",
                      "synchronize", "barrier", "get_rank", "get_world_size"]


@pytest.mark.parametrize("name", HELPERS_WITH_GROUP)
def test_every_module_helper_takes_a_group(name: str) -> None:
    param = inspect.signature(getattr(distcomm, name)).parameters.get("group")
    assert param is not None and param.default is None, name


def test_barrier_is_synchronize() -> None:
    comm = FakeCommunicator(0, 2)
    comm.barrier()
    with distcomm.use(comm):
        distcomm.barrier()
    assert [c.op for c in comm.calls] == ["synchronize", "synchronize"]
    assert run_threaded(lambda c: c.barrier(), 3) == [None] * 3


@pytest.mark.parametrize("name, spelling", [("get_rank", "comm.rank"), ("get_world_size", "comm.world_size"),
                                            ("all_gather_object", "comm.all_gather(obj)")])
def test_torchs_method_names_point_at_distcomms(name: str, spelling: str) -> None:
    with pytest.raises(AttributeError, match=re.escape(f"has no attribute {name!r}: distcomm spells it {spelling}")):
        getattr(FakeCommunicator(0, 2), name)
    with pytest.raises(AttributeError, match=r"has no attribute 'no_such_thing'$"):
        FakeCommunicator(0, 2).no_such_thing  # the error is the point


def _numbers_and_ops(comm: distcomm.Communicator) -> dict[str, Any]:
    r = comm.rank
    numbers = comm.all_reduce_dict({"loss": 0.5 * (r + 1), "n": r + 1, "np": np.float64(r), "i32": np.int32(2)},
                                   average=False)
    out = {k: (v.item(), str(v.dtype)) for k, v in numbers.items()}
    for op in ("sum", "mean", "max", "min"):
        got = comm.all_reduce_dict({"x": torch.tensor([1.0 + r, 5.0 - r]), "k": torch.tensor(r + 1)}, op=op)
        out[op] = {k: v.tolist() for k, v in got.items()}
    with distcomm.use(comm):
        out["mmengine"] = distcomm.all_reduce_dict({"x": torch.tensor(2.0 * r)}, "mean")["x"].item()
    try:
        comm.all_reduce_dict({"x": torch.tensor(1.0)}, op="max" if r == 0 else "sum")
        out["ops differ"] = "returned"
    except distcomm.CollectiveMismatchError as e:
        out["ops differ"] = str(e)
    return out


def _check_numbers_and_ops(results: list[dict[str, Any]]) -> None:
    n = len(results)
    for got in results:
        assert got["loss"] == (0.5 * n * (n + 1) / 2, "torch.float32")
        assert got["n"] == (n * (n + 1) // 2, "torch.int64")
        assert got["np"] == (float(n * (n - 1) // 2), "torch.float64")
        assert got["i32"] == (2 * n, "torch.int32")
        assert got["max"] == {"x": [float(n), 5.0], "k": n} and got["min"] == {"x": [1.0, 6.0 - n], "k": 1}
        assert got["sum"]["k"] == n * (n + 1) // 2 and got["mean"]["k"] == (n + 1) / 2
        assert got["mmengine"] == float(n - 1)
        assert "different reductions" in got["ops differ"] and "rank 0: op='max'" in got["ops differ"]
        assert "rank 1: op='sum'" in got["ops differ"]


def test_numbers_and_ops_in_reduce_dict_threaded() -> None:
    _check_numbers_and_ops(run_threaded(_numbers_and_ops, 3))


def test_numbers_and_ops_in_reduce_dict_gloo() -> None:
    _check_numbers_and_ops(spawn(_numbers_and_ops, 2, timeout=120))


def test_numbers_and_ops_in_reduce_dict_fake() -> None:
    comm = FakeCommunicator(0, 2, peers=lambda op, r, d: d)
    got = comm.all_reduce_dict({"loss": 0.5, "n": 3}, average=False)
    assert {k: v.item() for k, v in got.items()} == {"loss": 1.0, "n": 6}
    assert comm.all_reduce_dict({"x": torch.tensor([1.0, 4.0])}, op="max")["x"].tolist() == [1.0, 4.0]


def _helpers_over_a_group(comm: distcomm.Communicator) -> dict[str, Any]:
    import torch.distributed as dist

    g = dist.new_group([0, 1])  # a group of the user's own, as torch code passes it
    t = torch.tensor([1.0 + comm.rank])
    return {
        "rank": distcomm.get_rank(group=g), "world": distcomm.get_world_size(group=g),
        "broadcast": distcomm.broadcast("from 0" if comm.rank == 0 else None, src=0, group=g),
        "all_reduce": distcomm.all_reduce(t, group=g).tolist(),
        "dict": distcomm.all_reduce_dict({"x": float(comm.rank)}, average=False, group=g)["x"].item(),
        "barrier": distcomm.barrier(group=g),
    }


def test_module_helpers_over_a_users_group_gloo() -> None:
    got = spawn(_helpers_over_a_group, 2, timeout=120, reuse=False)  # it makes a group of its own
    assert got == [{"rank": r, "world": 2, "broadcast": "from 0", "all_reduce": [3.0], "dict": 1.0, "barrier": None}
                   for r in range(2)]


def _reduce_ops(comm: distcomm.Communicator) -> tuple[float, float, float, int]:
    import torch.distributed as dist

    t = comm.all_reduce(torch.tensor([1.0 + comm.rank]), dist.ReduceOp.AVG)
    d = comm.all_reduce_dict({"x": torch.tensor(float(comm.rank))}, op=dist.ReduceOp.MAX)
    with distcomm.use(comm):
        m = distcomm.all_reduce_dict({"x": float(comm.rank)}, dist.ReduceOp.SUM)  # in second place, as mmengine
    p = comm.all_reduce(torch.tensor([2]), dist.ReduceOp.PRODUCT)
    return t.item(), d["x"].item(), m["x"].item(), int(p.item())


def test_reductions_take_torchs_reduce_op() -> None:
    import torch.distributed as dist

    assert run_threaded(_reduce_ops, 3) == [(2.0, 2.0, 3.0, 8)] * 3
    for bad in (0, True, dist.ReduceOp.BAND, "avg"):  # ReduceOp.SUM == 0, but 0 is no op
        with pytest.raises(ValueError, match=r"dist\.ReduceOp"):
            FakeCommunicator(0, 2).all_reduce(torch.ones(1), bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dist\.ReduceOp"):
        FakeCommunicator(0, 2).all_reduce_dict({"x": 1.0}, op=dist.ReduceOp.PRODUCT)
