"""Tensors of dtypes gloo refuses (float8, uint16, uint32, uint64, int16): broadcasts and gathers
carry them as raw bytes; reductions refuse them on every rank before anything moves, and the
communicator stays usable. The test doubles answer exactly as gloo does."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded, spawn

REFUSED = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint16, torch.uint32, torch.uint64, torch.int16]


def _values(dtype: torch.dtype, rank: int, n: int) -> torch.Tensor:
    return (torch.arange(n, dtype=torch.float32) + 10 * rank).to(dtype)


def _error(call: Any) -> str:
    try:
        call()
    except distcomm.DistCommError as e:
        return f"{type(e).__name__}: {e}"
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "returned"


def _dtypes(comm: distcomm.Communicator) -> dict[str, Any]:
    r, n = comm.rank, comm.world_size
    out: dict[str, Any] = {}
    for dtype in REFUSED:
        name = str(dtype)
        mine = _values(dtype, r, 3)
        out[name + " broadcast"] = comm.broadcast_tensor(mine.clone(), src=1).to(torch.float32).tolist()
        out[name + " broadcast unchecked"] = comm.broadcast_tensor(mine.clone(), src=0, check=False).to(
            torch.float32).tolist()
        out[name + " gather"] = comm.all_gather_tensor(_values(dtype, r, r + 1)).to(torch.float32).tolist()
        out[name + " gather 2-d"] = comm.all_gather_tensor(mine.reshape(1, 3), check=False).to(torch.float32).tolist()
        out[name + " all_reduce"] = _error(lambda: comm.all_reduce(mine.clone()))
        out[name + " reduce"] = _error(lambda: comm.reduce(mine.clone(), dst=0))
        out[name + " reduce_scatter"] = _error(lambda: comm.reduce_scatter_tensor(_values(dtype, r, 2 * n)))
        out[name + " all_reduce unchecked"] = _error(lambda: comm.all_reduce(mine.clone(), check=False))
    out["still usable"] = comm.all_reduce(torch.ones(2)).tolist()
    return out


def _check(results: list[dict[str, Any]]) -> None:
    n = len(results)
    for rank, got in enumerate(results):
        for dtype in REFUSED:
            name = str(dtype)
            assert got[name + " broadcast"] == _values(dtype, 1, 3).to(torch.float32).tolist()
            assert got[name + " broadcast unchecked"] == _values(dtype, 0, 3).to(torch.float32).tolist()
            assert got[name + " gather"] == torch.cat([_values(dtype, s, s + 1) for s in range(n)]).to(
                torch.float32).tolist()
            assert got[name + " gather 2-d"] == [_values(dtype, s, 3).to(torch.float32).tolist() for s in range(n)]
            for op in ("all_reduce", "reduce", "reduce_scatter"):
                text = got[f"{name} {op}"]
                assert text.startswith("CollectiveError") and f"{name} tensors can't be reduced" in text, text
                assert text == results[0][f"{name} {op}"]  # the same error on every rank
            unchecked = got[name + " all_reduce unchecked"]
            assert unchecked.startswith("ValueError") and "can't be reduced" in unchecked
        assert got["still usable"] == [float(n)] * 2


def test_dtypes_gloo_refuses_threaded() -> None:
    _check(run_threaded(_dtypes, 2, timeout=120))


def test_dtypes_gloo_refuses_gloo() -> None:
    _check(spawn(_dtypes, 2, timeout=120))


def test_dtypes_gloo_refuses_fake() -> None:
    def peers(op: str, r: int, obj: Any) -> Any:
        if op == "all_gather_tensor":
            return _values(obj.dtype, r, r + 1) if obj.dim() == 1 else _values(obj.dtype, r, 3).reshape(1, 3)
        return _values(obj.dtype, r, obj.numel()).reshape(obj.shape) if isinstance(obj, torch.Tensor) else obj

    got = _dtypes(FakeCommunicator(0, 2, peers=peers))
    for dtype in REFUSED:
        name = str(dtype)
        assert got[name + " broadcast"] == _values(dtype, 1, 3).to(torch.float32).tolist()
        assert got[name + " gather"] == torch.cat([_values(dtype, s, s + 1) for s in range(2)]).to(
            torch.float32).tolist()
        refused = got[name + " all_reduce"]
        assert refused.startswith("CollectiveError") and "can't be reduced" in refused


@pytest.mark.parametrize("dtype", REFUSED)
def test_reduce_dict_of_a_refused_dtype_still_reduces(dtype: torch.dtype) -> None:
    # reduce_dict reduces in float64 whatever its values' dtypes: nothing to refuse there
    got = run_threaded(lambda c: c.all_reduce_dict({"x": torch.ones(2).to(dtype)}, average=False), 2)
    assert [v["x"].to(torch.float32).tolist() for v in got] == [[2.0, 2.0]] * 2
