"""distcomm.compat.torch against torch.distributed's own object collectives, on the same gloo ranks:
every case's return value, lists after the call and errors compared value by value and dtype by
dtype on every rank; bad arguments on one rank raise torch's ValueError on every rank."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
import distcomm.compat.torch as compat
from distcomm.testing import spawn

from ._compat_diff import Case, compare, raised_alike

NAMES = ["all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list"]


def _obj(rank: int) -> Any:
    return {"rank": rank, "t": torch.arange(3, dtype=torch.int32) + rank, "a": np.full(2, rank, np.float16),
            "big": torch.full((40_000,), float(rank)), "none": None}


def _all_gather(m: Any, rank: int, world: int) -> Any:
    out: list[Any] = ["untouched"] * (world + 1)  # torch fills world_size items; the rest stays
    return m.all_gather_object(out, _obj(rank)), out


def _all_gather_short(m: Any, rank: int, world: int) -> Any:
    return m.all_gather_object([None], rank)  # IndexError after the exchange, on every rank


def _gather(dst: int | None, group_dst: int | None = None) -> Case:
    def case(m: Any, rank: int, world: int) -> Any:
        root = group_dst if group_dst is not None else dst or 0
        out = [None] * world if rank == root else None
        return m.gather_object(_obj(rank), out, dst=dst, group_dst=group_dst), out
    return case


def _gather_both_roots(m: Any, rank: int, world: int) -> Any:
    return m.gather_object(rank, [None] * world if rank == 0 else None, dst=0, group_dst=0)


def _broadcast(src: int | None, group_src: int | None = None, device: Any = None) -> Case:
    def case(m: Any, rank: int, world: int) -> Any:
        items = [_obj(rank), "x", None] if rank == (src or group_src or 0) else [None, None, None]
        return m.broadcast_object_list(items, src=src, group_src=group_src, device=device), items
    return case


def _scatter(src: int | None, group_src: int | None = None, out_len: int = 1) -> Case:
    def case(m: Any, rank: int, world: int) -> Any:
        root = src if src is not None else group_src or 0
        out: list[Any] = ["before"] * out_len
        objs = [_obj(r) for r in range(world)] if rank == root else None
        return m.scatter_object_list(out, objs, src=src, group_src=group_src), out
    return case


CASES: dict[str, Case] = {
    "all_gather_object": _all_gather,
    "all_gather_object short list": _all_gather_short,
    "gather_object dst=0": _gather(None),
    "gather_object dst=1": _gather(1),
    "gather_object group_dst=1": _gather(None, 1),
    "gather_object dst and group_dst": _gather_both_roots,
    "broadcast_object_list src=0": _broadcast(None),
    "broadcast_object_list src=1": _broadcast(1),
    "broadcast_object_list group_src=1 device=cpu": _broadcast(None, 1, torch.device("cpu")),
    "scatter_object_list src=0": _scatter(None),
    "scatter_object_list src=1 two outputs": _scatter(1, out_len=2),
    "scatter_object_list group_src=1": _scatter(None, 1),
}


def _differential(comm: distcomm.Communicator) -> dict[str, Any]:
    import torch.distributed as dist

    return compare(CASES, dist, compat, comm.rank, comm.world_size)


@pytest.fixture(scope="module")
def gloo_results() -> list[dict[str, Any]]:
    return spawn(_differential, 2, timeout=180)


@pytest.mark.parametrize("case", list(CASES))
def test_compat_matches_torch_on_every_rank(gloo_results: list[dict[str, Any]], case: str) -> None:
    assert [got[case] for got in gloo_results] == [None, None]


@pytest.mark.parametrize("name", NAMES)
def test_torchs_signature(name: str) -> None:
    import torch.distributed as dist

    ours, theirs = inspect.signature(getattr(compat, name)), inspect.signature(getattr(dist, name))
    assert list(ours.parameters) == list(theirs.parameters)
    assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()]


def _refused_on_one_rank(comm: distcomm.Communicator) -> dict[str, Any]:
    r, w = comm.rank, comm.world_size
    return {  # rank 1 alone passes what torch refuses (torch raises there and leaves rank 0 waiting)
        "gather list on a non-destination": raised_alike(
            lambda: compat.gather_object(r, [None] * w, dst=0) if r == 1 else compat.gather_object(r, [None] * w),
            ValueError),
        "no gather list on the destination": raised_alike(
            lambda: compat.gather_object(r, None if r == 1 else [], dst=1), ValueError),
        "an empty scatter output list": raised_alike(
            lambda: compat.scatter_object_list([] if r == 1 else [None], [0] * w if r == 0 else None), ValueError),
        "no scatter inputs on the source": raised_alike(lambda: compat.scatter_object_list([None], None, src=1),
                                                        ValueError),
        "scatter inputs of the wrong length": raised_alike(
            lambda: compat.scatter_object_list([None], [0] * (w + 1) if r == 1 else None, src=1), ValueError),
        "after": compat.all_gather_object([None] * w, r),  # the communicator goes on
    }


def test_a_refused_argument_raises_torchs_error_on_every_rank() -> None:
    got = spawn(_refused_on_one_rank, 2, timeout=120)
    for case in got[0]:
        if case == "after":
            continue
        assert got[0][case] == got[1][case], case  # the same error, the same message, on both ranks
        assert got[0][case][0] == "ValueError" and "rank 1" in got[0][case][1], (case, got[0][case])
    assert "Argument ``gather_list`` must NOT be specified" in got[0]["gather list on a non-destination"][1]


def test_world_of_one_without_torch_distributed() -> None:
    out: list[Any] = [None]
    with distcomm.use(distcomm.LocalCommunicator()):
        compat.all_gather_object(out, {"x": 1})
        assert out == [{"x": 1}]
        with pytest.raises(ValueError, match="must be specified on destination"):
            compat.gather_object(1, None)
        items = [1, 2]
        compat.broadcast_object_list(items)
        assert items == [1, 2]
        compat.scatter_object_list(out, [5])
        assert out == [5]


def _over_a_group(comm: distcomm.Communicator) -> Any:
    import torch.distributed as dist

    g = dist.new_group([1, 2])
    if comm.rank == 0:
        return None
    items = ["from global rank 2"] if comm.rank == 2 else [None]
    compat.broadcast_object_list(items, src=2, group=g)  # a global rank, as torch takes it
    out = [None, None] if comm.rank == 1 else None
    compat.gather_object(comm.rank, out, group=g, group_dst=0)
    return items, out


@pytest.mark.slow
def test_src_and_dst_are_global_ranks_with_a_group() -> None:
    got = spawn(_over_a_group, 3, timeout=180, reuse=False)
    assert got == [None, (["from global rank 2"], [1, 2]), (["from global rank 2"], None)]
