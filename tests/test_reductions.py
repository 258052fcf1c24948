"""reduce_dict and all_reduce_dict: integers reduce exactly, in int64, as torch's all_reduce does;
floats keep float64; the same on every communicator."""

from __future__ import annotations

import decimal
import fractions
from typing import Any

import pytest
import torch

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded, spawn

BIG = 2**53 + 1  # float64 can't hold it: a sum through float64 comes back as 2**54


def _integer_sums(comm: distcomm.Communicator) -> dict[str, Any]:
    counts = {"n": torch.tensor(BIG), "bins": torch.tensor([BIG, 1, 2], dtype=torch.int64),
              "small": torch.tensor(7, dtype=torch.int32), "flag": torch.tensor(comm.rank == 1)}
    summed = comm.all_reduce_dict(counts, average=False)
    mean = comm.all_reduce_dict({"n": torch.tensor(comm.rank + 1)})
    mixed = comm.all_reduce_dict({"n": torch.tensor(3), "loss": torch.tensor(0.5)}, average=False)
    on_root = comm.reduce_dict(counts, average=False)
    return {"summed": {k: (v.tolist(), str(v.dtype)) for k, v in summed.items()},
            "mean": (mean["n"].item(), str(mean["n"].dtype)),
            "mixed": {k: (v.item(), str(v.dtype)) for k, v in mixed.items()},
            "root": on_root["n"].item()}


def _check(results: list[dict[str, Any]]) -> None:
    n = len(results)
    for rank, got in enumerate(results):
        assert got["summed"] == {"n": (n * BIG, "torch.int64"), "bins": ([n * BIG, n, 2 * n], "torch.int64"),
                                 "small": (7 * n, "torch.int32"), "flag": (True, "torch.bool")}
        assert got["mean"] == ((n + 1) / 2, str(torch.get_default_dtype()))
        assert got["mixed"] == {"n": (3 * n, "torch.int64"), "loss": (0.5 * n, "torch.float32")}
        assert got["root"] == (n * BIG if rank == 0 else BIG)


def test_integers_reduce_exactly_threaded() -> None:
    _check(run_threaded(_integer_sums, 2))


def test_integers_reduce_exactly_gloo() -> None:
    _check(spawn(_integer_sums, 2, timeout=120))


def test_integers_reduce_exactly_fake() -> None:
    def peers(op: str, rank: int, obj: Any) -> Any:  # what the rank under test sends, with rank 1's flag
        return {**obj, "flag": torch.tensor(True)} if "flag" in obj else obj

    got = _integer_sums(FakeCommunicator(0, 2, peers=peers))
    assert got["summed"]["n"] == (2 * BIG, "torch.int64") and got["summed"]["flag"] == (True, "torch.bool")
    assert got["mixed"] == {"n": (6, "torch.int64"), "loss": (1.0, "torch.float32")} and got["root"] == 2 * BIG


def _kinds_differ(comm: distcomm.Communicator) -> str:
    value = torch.tensor(1) if comm.rank == 0 else torch.tensor(1.0)
    try:
        comm.all_reduce_dict({"n": value})
    except distcomm.CollectiveMismatchError as e:
        return f"{e} ranks={list(e.ranks)}"
    return "returned"


def test_dicts_of_different_kinds_name_each_ranks_kind() -> None:
    for got in (run_threaded(_kinds_differ, 2), spawn(_kinds_differ, 2, timeout=120)):
        assert got[0] == got[1] and "rank 0: only integer or bool values" in got[0]
        assert "rank 1: floating point values" in got[0]


def _missing_key_of_another_kind(comm: distcomm.Communicator) -> str:
    d = {"n": torch.tensor(3), "loss": torch.tensor(0.5)} if comm.rank == 0 else {"n": torch.tensor(3)}
    try:
        comm.all_reduce_dict(d)
    except distcomm.CollectiveMismatchError as e:
        return str(e)
    return "returned"


def test_a_missing_key_is_named_before_the_kinds_of_values() -> None:
    got = run_threaded(_missing_key_of_another_kind, 2)
    assert got[0] == got[1] and "rank 1 lacks 'loss'" in got[0] and "kinds" not in got[0]


def _unconvertible_on_rank_1(value: Any) -> Any:
    def fn(comm: distcomm.Communicator) -> tuple[str, str, list[int]]:
        try:
            comm.all_reduce_dict({"a": value if comm.rank == 1 else 1, "b": 2.0})
            return ("returned", "", [])
        except distcomm.CollectiveError as e:
            return (type(e).__name__, str(e), comm.all_gather(comm.rank))  # still usable

    return fn


@pytest.mark.parametrize("value", [2**63, decimal.Decimal("1.5"), fractions.Fraction(1, 3)], ids=repr)
@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_a_number_torch_cant_convert_fails_every_rank_alike(world: str, value: Any) -> None:
    """Used to raise on that rank alone, before its slot; its peers went on and paired wrong calls."""
    run = spawn if world == "gloo" else run_threaded
    out = run(_unconvertible_on_rank_1(value), 2, timeout=120)
    assert {name for name, _, _ in out} == {"CollectiveError"}, out
    assert len({msg for _, msg, _ in out}) == 1, out
    assert "rank 1" in out[0][1] and "'a'" in out[0][1] and "can't convert" in out[0][1], out[0][1]
    assert [ranks for _, _, ranks in out] == [[0, 1], [0, 1]]


def _unsigned_extremes(comm: distcomm.Communicator) -> list[list[int]]:
    big = [2**63 + 5, 2**64 - 1, 3] if comm.rank == 0 else [2**63 - 1, 2**63, 2**63 + 1]
    d = {"u": torch.tensor(big, dtype=torch.uint64), "i": torch.tensor([-1 - comm.rank])}
    return [comm.all_reduce_dict(d, op=op)[k].tolist() for op in ("max", "min") for k in ("u", "i")]


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_uint64_max_and_min_are_exact_at_and_above_2_63(world: str) -> None:
    """Reduced in int64, where values of 2**63 and more wrap to negatives: max and min picked wrong."""
    run = spawn if world == "gloo" else run_threaded
    for got in run(_unsigned_extremes, 2, timeout=120):
        assert got == [[2**63 + 5, 2**64 - 1, 2**63 + 1], [-1], [2**63 - 1, 2**63, 3], [-2]]


def _unsigned_beside_floats(comm: distcomm.Communicator) -> list[Any]:
    got = comm.all_reduce_dict({"n": torch.tensor(7 + comm.rank, dtype=torch.uint64),
                                "loss": torch.tensor(0.5 * comm.rank)}, op="max")
    return [float(got["loss"]), float(got["n"]), str(got["n"].dtype)]


def test_uint64_beside_floats_reduces_in_float64() -> None:
    """A dict with floats reduces in float64: the uint64 flip (for int64 work) must stay out of it."""
    for got in run_threaded(_unsigned_beside_floats, 2, timeout=60):
        assert got == [0.5, 8.0, "torch.uint64"]


def _integer_means(comm: distcomm.Communicator) -> list[str]:
    d = {"n": torch.tensor(3), "flag": torch.tensor(True), "x": torch.tensor(0.5, dtype=torch.float64)}
    everywhere = [str(v.dtype) for v in comm.all_reduce_dict(d).values()]
    on_root = [str(v.dtype) for v in comm.reduce_dict(d).values()]
    return everywhere + (on_root if comm.rank == 0 else everywhere)  # (off rank 0, reduce_dict gives its input)


@pytest.mark.parametrize("world", ["local", "threaded 1", "gloo 1", "threaded 2", "fake 1"])
def test_an_average_of_integers_is_a_float_at_every_world_size(world: str) -> None:
    """Used to be float32 at 2 ranks and int64/bool in a world of one."""
    if world == "local":
        got = [_integer_means(distcomm.LocalCommunicator())]
    elif world == "fake 1":
        got = [_integer_means(FakeCommunicator(0, 1))]
    else:
        kind, n = world.split()
        got = (spawn if kind == "gloo" else run_threaded)(_integer_means, int(n), timeout=120)
    want = str(torch.get_default_dtype())
    for dtypes in got:
        assert dtypes == [want, want, "torch.float64"] * 2, (world, dtypes)


def _exact_means(comm: distcomm.Communicator) -> list[Any]:
    r = comm.rank
    d = {"u": torch.tensor([2**64 - 1, 2**63, 2**63 + 2 * r, 5 + r], dtype=torch.uint64),
         "i": torch.tensor([2**62, -(2**63), 3 - 7 * r])}
    return [comm.all_reduce_dict(d)[k].tolist() for k in ("u", "i")] + [comm.reduce_dict(d)["u"].tolist()]


@pytest.mark.parametrize("world", ["gloo", "threaded", "fake"])
def test_integer_means_are_exact_at_and_above_2_63(world: str) -> None:
    """The sums wrapped in int64 (a uint64 mean came back negative), and an int64 sum past 2**63 too."""
    if world == "fake":
        def peers(op: str, rank: int, obj: Any) -> Any:  # rank 1's dict
            return {"u": torch.tensor([2**64 - 1, 2**63, 2**63 + 2, 6], dtype=torch.uint64),
                    "i": torch.tensor([2**62, -(2**63), -4])}
        got = [_exact_means(FakeCommunicator(0, 2, peers=peers))]
    else:
        got = (spawn if world == "gloo" else run_threaded)(_exact_means, 2, timeout=120)

    def as_default(x: list[float]) -> list[float]:  # the mean is in the default float dtype
        return torch.tensor(x, dtype=torch.float64).to(torch.get_default_dtype()).tolist()

    u, i = as_default([2**64 - 1, 2**63, 2**63 + 1, 5.5]), as_default([2**62, -(2**63), -0.5])
    for rank, means in enumerate(got):
        assert means == [u, i, u if rank == 0 else [2**64 - 1, 2**63, 2**63 + 2, 6]], (world, rank)


def _signedness_differs(comm: distcomm.Communicator) -> list[str]:
    value = torch.tensor([2**63, 1], dtype=torch.uint64) if comm.rank == 0 else torch.tensor([-1, 1])
    out = []
    for op in ("mean", "sum", "max"):
        try:
            comm.all_reduce_dict({"x": value, "n": torch.tensor(comm.rank)}, op=op)
            out.append("returned")
        except distcomm.CollectiveMismatchError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_a_key_uint64_on_some_ranks_only_is_refused_on_every_rank(world: str) -> None:
    """Reduced in int64 alike, each rank read the result with its own signedness (and flipped the
    top bit for max and min on its own): the ranks got different results."""
    got = (spawn if world == "gloo" else run_threaded)(_signedness_differs, 2, timeout=120)
    assert got[0] == got[1]
    for text in got[0]:
        assert "uint64" in text and "'x'" in text and "rank 0" in text, text
