"""The contract every communicator keeps, written once.

``exercise(comm)`` calls every collective with uneven sizes, numpy arrays, tensors, None and
lambdas, and returns a summary; ``expected(rank, world_size)`` says what that summary must be.
The suite runs it on LocalCommunicator, FakeCommunicator, the threaded world and real gloo worlds.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import distcomm


def payload(rank: int, step: int) -> dict[str, Any]:
    """An object whose size depends on the rank: rank 0's is tiny, others' carry large buffers."""
    return {
        "rank": rank,
        "step": step,
        "text": "x" * (rank * 3000),
        "arr": np.arange(rank * 40_000, dtype=np.float64),  # 0, 320 KB, 640 KB, ...: out of band
        "small_arr": np.full(3, rank, dtype=np.int32),
        "tensor": torch.full((rank * 30_000,), float(rank)),
        "scalar": torch.tensor(rank + 0.5),
        "none": None,
        "fn": lambda x: x * 10 + rank,
    }


def summarize(p: Any) -> tuple[Any, ...]:
    if p is None:
        return (None,)
    return (
        p["rank"], p["step"], len(p["text"]), p["arr"].shape, float(p["arr"].sum()), p["small_arr"].tolist(),
        tuple(p["tensor"].shape), float(p["tensor"].sum()), str(p["tensor"].dtype), float(p["scalar"]),
        p["none"], p["fn"](1),
    )


def loss_dict(rank: int) -> dict[str, torch.Tensor]:
    return {"loss": torch.tensor(float(rank)), "acc": torch.tensor(2.0 * rank), "count": torch.tensor(rank + 1)}


def skewed(rank: int, n: int) -> dict[str, Any]:
    """Only the last rank carries a large buffer."""
    return {"skew": n, "data": np.ones(200_000, dtype=np.uint8) if rank == n - 1 else None}


def peers(op: str, rank: int, obj: Any) -> Any:
    """Script FakeCommunicator's peers so that they contribute what a real rank would."""
    if isinstance(obj, dict) and "step" in obj:
        return payload(rank, obj["step"])
    if isinstance(obj, dict) and "loss" in obj:
        return loss_dict(rank)
    if isinstance(obj, dict) and "skew" in obj:
        return skewed(rank, obj["skew"])
    if isinstance(obj, dict) and "small" in obj:
        return {"small": rank}
    return obj


def exercise(comm: distcomm.Communicator) -> dict[str, Any]:
    r, n = comm.rank, comm.world_size
    out: dict[str, Any] = {"rank": r, "world": n, "main": comm.is_main_process}
    out["local"] = (comm.local_rank, comm.local_size)
    out["all_gather"] = [summarize(x) for x in comm.all_gather(payload(r, 1))]
    out["gather"] = [summarize(x) for x in comm.gather(payload(r, 2), dst=n - 1)]
    out["gather0"] = comm.gather({"small": r})
    out["broadcast"] = summarize(comm.broadcast(payload(r, 3), src=n // 2))
    out["scatter"] = summarize(comm.scatter([payload(i, 4) for i in range(n)], src=0))
    seed = comm.shared_random_seed()
    out["seed_ok"] = isinstance(seed, int) and 0 <= seed < 2**31
    out["seeds"] = comm.all_gather(seed) if not isinstance(comm, distcomm.testing.FakeCommunicator) else [seed] * n
    red = comm.reduce_dict(loss_dict(r))
    out["reduce"] = {k: float(v) for k, v in red.items()}
    out["reduce_keys"] = list(red)
    all_red = comm.all_reduce_dict(loss_dict(r), average=False)
    out["all_reduce"] = {k: (float(v), str(v.dtype)) for k, v in all_red.items()}
    comm.synchronize()
    out["ints"] = comm.all_gather({"small": r})
    out["nones"] = comm.all_gather(None)
    mine = [1, 2]
    out["own_is_same"] = comm.all_gather(mine)[r] is mine
    out["empty"] = comm.all_gather(b"")
    out["skewed"] = [None if x["data"] is None else int(x["data"].sum()) for x in comm.all_gather(skewed(r, n))]
    try:
        comm.gather(1, dst=n)
        out["bad_dst"] = "no error"
    except ValueError as e:
        out["bad_dst"] = str(e)
    return out


def exercise_point_to_point(comm: distcomm.Communicator) -> dict[str, Any]:
    """The contract with every transfer after the slots point to point."""
    comm._alltoall_max_bytes = -1  # type: ignore[attr-defined]
    return exercise(comm)


def exercise_alltoall(comm: distcomm.Communicator) -> dict[str, Any]:
    """The contract with every transfer after the slots in one all-to-all, copies or not."""
    comm._alltoall_copy_bytes = 1 << 62  # type: ignore[attr-defined]
    return exercise(comm)


def expected(r: int, n: int) -> dict[str, Any]:
    avg = {"loss": sum(range(n)) / n, "acc": sum(2.0 * i for i in range(n)) / n,
           "count": sum(i + 1 for i in range(n)) / n}
    return {
        "rank": r, "world": n, "main": r == 0,
        "all_gather": [summarize(payload(i, 1)) for i in range(n)],
        "gather": [summarize(payload(i, 2)) for i in range(n)] if r == n - 1 else [],
        "gather0": [{"small": i} for i in range(n)] if r == 0 else [],
        "broadcast": summarize(payload(n // 2, 3)),
        "scatter": summarize(payload(r, 4)),
        "seed_ok": True,
        "reduce": avg if r == 0 else {k: float(v) for k, v in loss_dict(r).items()},
        "reduce_keys": ["acc", "count", "loss"] if r == 0 else list(loss_dict(r)),
        "all_reduce": {"acc": (sum(2.0 * i for i in range(n)), "torch.float32"),
                       "count": (float(sum(i + 1 for i in range(n))), "torch.int64"),
                       "loss": (float(sum(range(n))), "torch.float32")},
        "ints": [{"small": i} for i in range(n)],
        "nones": [None] * n,
        "own_is_same": True,
        "empty": [b""] * n,
        "skewed": [None] * (n - 1) + [200_000],
        "bad_dst": f"dst={n} is out of range for world_size {n}",
    }


def check(result: dict[str, Any], *, local: tuple[int, int] | None = None) -> None:
    r, n = result["rank"], result["world"]
    want = expected(r, n)
    for key, value in want.items():
        assert result[key] == value, f"rank {r} of {n}: {key}: got {result[key]!r}, want {value!r}"
    assert len(set(result["seeds"])) == 1, f"rank {r}: seeds differ across ranks: {result['seeds']}"
    if local is not None:
        assert result["local"] == local, f"rank {r}: local rank/size {result['local']}, want {local}"
