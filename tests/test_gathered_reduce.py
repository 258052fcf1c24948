"""Small reductions beyond 4 ranks go through the root (a gather, a fold in rank order, a
broadcast): the same results as gloo's ring for every op and dtype, the bytes counted as they
move, and larger values still through the ring."""

from __future__ import annotations

from typing import Any

import torch

import distcomm
from distcomm._transfer.gathered_reduce import GATHERED_REDUCE_BYTES
from distcomm.testing import spawn

WORLD = 6


def _values(rank: int) -> dict[str, torch.Tensor]:
    return {"f32": torch.tensor([rank + 0.25, -rank * 2.0]), "i64": torch.tensor(2**53 + rank),
            "i8": torch.tensor([rank, 3], dtype=torch.int8), "flag": torch.tensor(rank == 2),
            "c": torch.tensor(complex(rank, 1.0))}


def _expected(op: str, world: int) -> dict[str, Any]:
    rows = [_values(r) for r in range(world)]
    out: dict[str, Any] = {}
    for k in rows[0]:
        stacked = torch.stack([r[k] for r in rows])
        if stacked.is_complex() and op != "sum":
            continue
        if op == "sum":
            out[k] = stacked.sum(0, dtype=stacked.dtype)
        elif op == "max":
            out[k] = stacked.amax(0)
        elif op == "min":
            out[k] = stacked.amin(0)
        else:  # prod
            out[k] = stacked.prod(0, dtype=stacked.dtype)
    return out


def _reduce_everything(comm: distcomm.Communicator) -> dict[str, Any]:
    mine = _values(comm.rank)
    out: dict[str, Any] = {}
    for op in ("sum", "max", "min", "prod"):
        for k, v in mine.items():
            if v.is_complex() and op != "sum":
                continue
            out[f"all_reduce {op} {k}"] = comm.all_reduce(v.clone(), op=op).tolist()
        out[f"reduce {op} f32"] = comm.reduce(mine["f32"].clone(), dst=3, op=op).tolist()
    floats = {k: v for k, v in mine.items() if k in ("f32", "c")}
    out["all_reduce_dict mean"] = {k: v.tolist() for k, v in comm.all_reduce_dict(floats).items()}
    out["all_reduce_dict ints"] = {k: v.tolist() for k, v in comm.all_reduce_dict(
        {"i64": mine["i64"], "i8": mine["i8"]}, average=False).items()}
    out["reduce_dict max"] = {k: v.tolist() for k, v in comm.reduce_dict({"f32": mine["f32"]}, op="max").items()}
    big = torch.full((GATHERED_REDUCE_BYTES // 8 + 1,), float(comm.rank), dtype=torch.float64)  # the ring's
    out["large"] = comm.all_reduce(big)[:2].tolist()
    return out


def test_small_reductions_match_the_ring_results_on_every_rank() -> None:
    results = spawn(_reduce_everything, WORLD, timeout=120)
    n = WORLD
    for rank, got in enumerate(results):
        for op in ("sum", "max", "min", "prod"):
            want = _expected(op, n)
            for k, v in want.items():
                assert got[f"all_reduce {op} {k}"] == v.tolist(), (rank, op, k)
            if rank == 3:
                assert got[f"reduce {op} f32"] == want["f32"].tolist()
            else:
                assert got[f"reduce {op} f32"] == _values(rank)["f32"].tolist()
        sums = _expected("sum", n)
        assert got["all_reduce_dict mean"] == {"f32": (sums["f32"] / n).tolist(), "c": (sums["c"] / n).tolist()}
        assert got["all_reduce_dict ints"] == {"i64": n * 2**53 + sum(range(n)), "i8": sums["i8"].tolist()}
        if rank == 0:
            assert got["reduce_dict max"] == {"f32": _expected("max", n)["f32"].tolist()}
        assert got["large"] == [float(sum(range(n)))] * 2


def _traffic(comm: distcomm.Communicator) -> list[tuple[int, int]]:
    """Bytes (sent, received) of an all_reduce and a reduce_dict of 100 float64 values, less those
    of the same calls with one value: what the values themselves moved."""
    out = []
    for name, call in (("all_reduce", lambda n: comm.all_reduce(torch.ones(n, dtype=torch.float64))),
                       ("reduce_dict", lambda n: comm.reduce_dict({"loss": torch.ones(n, dtype=torch.float64)}))):
        counts = []
        for n in (100, 1):
            comm.reset_stats()
            call(n)
            counts.append((comm.stats[name].bytes_sent, comm.stats[name].bytes_received))
        out.append((counts[0][0] - counts[1][0], counts[0][1] - counts[1][1]))
    return out


def test_bytes_counted_as_the_gather_and_broadcast_move_them() -> None:
    rows = spawn(_traffic, WORLD, timeout=120)
    n = 99 * 8
    # all_reduce: every rank but the root sends its values once (the gather), and the broadcast's
    # binomial tree brings the result once to every rank but the root
    assert sum(r[0][0] for r in rows) == sum(r[0][1] for r in rows) == 2 * (WORLD - 1) * n
    assert rows[0][0][1] == (WORLD - 1) * n
    # reduce_dict onto rank 0: the gather alone
    assert rows[0][1] == (0, (WORLD - 1) * n) and all(r[1] == (n, 0) for r in rows[1:])


def test_which_reductions_go_through_the_root() -> None:
    """Beyond 4 ranks and up to 32, small CPU values; half precision stays in the ring, where each
    addition rounds to half precision as it does today, and so do a max and a min of floats (whose
    result with a NaN is the ring's, tests/test_nan_reductions.py)."""
    from types import SimpleNamespace

    from distcomm._transfer.gathered_reduce import takes_gathered

    def takes(world: int, t: torch.Tensor, op: str = "sum") -> bool:
        return takes_gathered(SimpleNamespace(_world=world), t, op)  # type: ignore[arg-type]

    small = torch.ones(8, dtype=torch.float64)
    assert takes(5, small) and takes(32, small) and not takes(4, small) and not takes(33, small)
    assert not takes(8, torch.ones(GATHERED_REDUCE_BYTES // 8 + 1, dtype=torch.float64))
    assert not takes(8, torch.ones(8, 2)[:, 0])  # not contiguous
    assert not takes(8, torch.ones(8, dtype=torch.float16)) and not takes(8, torch.ones(8, dtype=torch.bfloat16))
    assert takes(8, torch.ones(8, dtype=torch.int8)) and takes(8, torch.ones(8, dtype=torch.bool))
    assert not takes(8, small, "max") and not takes(8, small, "min") and takes(8, small, "prod")
    assert takes(8, torch.ones(8, dtype=torch.int64), "max") and takes(8, torch.ones(8, dtype=torch.bool), "min")
