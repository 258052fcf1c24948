"""The contract every communicator keeps, written once.

``exercise(comm)`` calls every collective with uneven sizes, numpy arrays, tensors, None and
lambdas, and returns a summary; ``expected(rank, world_size)`` says what that summary must be.
The suite runs it on LocalCommunicator, FakeCommunicator, the threaded world and real gloo worlds.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
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


def trainer_tensor(op: str, rank: int, n: int) -> torch.Tensor:
    """The tensor rank ``rank`` passes to tensor collective ``op`` in the contract."""
    if op == "all_reduce":
        return torch.full((2, 3), float(rank + 1))
    if op == "reduce":
        return torch.full((2,), float(rank))
    if op == "broadcast_tensor":
        return torch.full((3,), rank, dtype=torch.int32)
    if op == "all_gather_tensor":
        return torch.full((rank % 3, 2), rank, dtype=torch.int64)  # rank 0 (and every third) sends no rows
    return torch.arange(2.0 * n, dtype=torch.float64) + rank  # reduce_scatter_tensor


OBJECTS = {"reduce_object": lambda r: {r}, "all_reduce_object": lambda r: r == 1, "scan": lambda r: r + 1,
           "exscan": lambda r: r + 1}


def peers(op: str, rank: int, obj: Any) -> Any:
    """Script FakeCommunicator's peers so that they contribute what a real rank would."""
    if isinstance(obj, torch.Tensor) and op in ("all_reduce", "reduce", "broadcast_tensor", "all_gather_tensor",
                                                 "reduce_scatter_tensor"):
        if op == "all_gather_tensor" and obj.dtype == torch.float32:  # the 0-d call
            return torch.tensor(float(rank))
        return trainer_tensor(op, rank, obj.shape[0] // 2)
    if op in OBJECTS:
        return OBJECTS[op](rank)
    if op == "all_to_all":
        return [f"{rank}->{d}" for d in range(len(obj))]
    if op == "split":
        _, key, members = obj
        if members is not None:
            return (0 if rank in members else None, rank, members)
        return (0, -(rank + 1), None) if key < 0 else (rank % 2, rank, None)  # (exercise_reach's reversed split)
    if op == "gather_in_order":  # what rank r of an interleaving sampler over 2 * world items holds
        n = obj[1][1] - obj[0][1]
        return [("item", rank), ("item", rank + n)]
    if op == "recv":
        return {"small": rank}
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
    job_ranks = comm.membership.job_ranks  # (a reordered split's are in its order)
    out["membership"] = (len(set(job_ranks)) == n, comm.membership.lost, comm.membership.admitted)
    out["admit_nobody"] = comm.admit() is comm  # no one waits to come in
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
    out.update(exercise_trainer(comm))
    return out


def exercise_trainer(comm: distcomm.Communicator) -> dict[str, Any]:
    """Tensor collectives, object reductions, all_to_all and sub-communicators."""
    r, n = comm.rank, comm.world_size
    out: dict[str, Any] = {}
    t = trainer_tensor("all_reduce", r, n)
    out["t_all_reduce"] = (comm.all_reduce(t) is t, t.tolist())
    out["t_mean"] = comm.all_reduce(trainer_tensor("all_reduce", r, n), "mean", check=False).tolist()
    out["t_reduce"] = comm.reduce(trainer_tensor("reduce", r, n), dst=n - 1, op="max").tolist()
    out["t_broadcast"] = comm.broadcast_tensor(trainer_tensor("broadcast_tensor", r, n), src=n // 2).tolist()
    gathered = comm.all_gather_tensor(trainer_tensor("all_gather_tensor", r, n))
    out["t_all_gather"] = (gathered.tolist(), str(gathered.dtype), tuple(gathered.shape[1:]))
    out["t_all_gather_0d"] = comm.all_gather_tensor(torch.tensor(float(r))).tolist()
    out["t_reduce_scatter"] = comm.reduce_scatter_tensor(trainer_tensor("reduce_scatter_tensor", r, n)).tolist()
    out["o_reduce"] = comm.reduce_object(OBJECTS["reduce_object"](r), "union")
    out["o_all_reduce"] = comm.all_reduce_object(OBJECTS["all_reduce_object"](r), "any")
    out["o_all_reduce_fn"] = comm.all_reduce_object(OBJECTS["all_reduce_object"](r), lambda a, b: int(a) + int(b))
    out["o_scan"] = comm.scan(OBJECTS["scan"](r), "sum")
    out["o_exscan"] = comm.exscan(OBJECTS["exscan"](r), "sum")
    out["o_all_to_all"] = comm.all_to_all([f"{r}->{d}" for d in range(n)])
    sub = comm.split(r % 2)
    assert sub is not None and type(sub) is type(comm)
    out["split"] = (sub.rank, sub.world_size, sub.all_gather({"small": r}))
    members = sorted({0, n - 1})
    group = comm.new_group(members)
    out["new_group"] = None if group is None else (group.rank, group.world_size, group.all_gather({"small": r}))
    sub.close()
    if group is not None:
        group.close()
    out.update(exercise_reach(comm))
    return out


def exercise_reach(comm: distcomm.Communicator) -> dict[str, Any]:
    """What users reach for next: a split in reverse key order, dup, a non-blocking call, results
    back in dataset order, and messages around a ring."""
    r, n = comm.rank, comm.world_size
    out: dict[str, Any] = {}
    rev = comm.split(0, key=-(r + 1))  # the last rank first
    assert rev is not None
    out["split_reversed"] = (rev.rank, rev.all_gather({"small": r}))
    twin = comm.dup()
    out["dup"] = (twin.rank, twin.world_size, twin.all_gather({"small": r}))
    handle = comm.all_gather({"small": r}, async_op=True)  # type: ignore[call-arg]
    out["async"] = (type(handle).__name__, handle.wait())
    mine = [("item", i) for i in range(r, 2 * n, n)]  # a sampler that interleaves: r, r + n
    out["in_order"] = comm.gather_in_order(mine, size=2 * n, sharding="interleaved")
    out["ring"] = None
    if n > 1:
        sent = comm.isend({"small": r}, (r + 1) % n, tag=5)
        out["ring"] = comm.recv((r - 1) % n, tag=5)
        sent.wait()
    return out


@contextlib.contextmanager
def header_blocks(comm: distcomm.Communicator, blocks: list[list[int]]) -> Iterator[None]:
    """A gloo communicator's header exchange over ``blocks`` inside the block (collective: every
    rank makes the blocks' groups), then as it was, for the next test in a reused world."""
    c: Any = comm
    saved = (c._blocks, c._table_index, c._header_bufs, c._place, c._block, c._block_group, c._leader_group)
    c._set_header_blocks(blocks, None)
    try:
        yield
    finally:
        c._blocks, c._table_index, c._header_bufs, c._place, c._block, c._block_group, c._leader_group = saved


def exercise_in_blocks(comm: distcomm.Communicator) -> dict[str, Any]:
    """``exercise`` with the header exchange in two levels, as on hosts of one rank each."""
    from distcomm._transfer import header_exchange as _header_exchange

    with header_blocks(comm, _header_exchange.header_blocks(comm.world_size, [[r] for r in range(comm.world_size)])):
        return exercise(comm)


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
        "membership": (True, (), ()),
        "admit_nobody": True,
        "ints": [{"small": i} for i in range(n)],
        "nones": [None] * n,
        "own_is_same": True,
        "empty": [b""] * n,
        "skewed": [None] * (n - 1) + [200_000],
        "bad_dst": f"dst={n} is out of range for world_size {n}",
        **expected_trainer(r, n),
    }


def expected_trainer(r: int, n: int) -> dict[str, Any]:
    total = float(n * (n + 1) // 2)
    rows = [s for s in range(n) for _ in range(s % 3)]
    summed = [n * i + n * (n - 1) / 2 for i in range(2 * n)]
    same = [s for s in range(n) if s % 2 == r % 2]
    members = sorted({0, n - 1})
    return {
        "t_all_reduce": (True, [[total] * 3] * 2),
        "t_mean": [[total / n] * 3] * 2,
        "t_reduce": [float(n - 1)] * 2 if r == n - 1 else [float(r)] * 2,
        "t_broadcast": [n // 2] * 3,
        "t_all_gather": ([[s, s] for s in rows], "torch.int64", (2,)),
        "t_all_gather_0d": [float(s) for s in range(n)],
        "t_reduce_scatter": summed[2 * r : 2 * r + 2],
        "o_reduce": set(range(n)) if r == 0 else None,
        "o_all_reduce": n > 1,
        "o_all_reduce_fn": 1 if n > 1 else False,
        "o_scan": (r + 1) * (r + 2) // 2,
        "o_exscan": None if r == 0 else r * (r + 1) // 2,
        "o_all_to_all": [f"{s}->{r}" for s in range(n)],
        "split": (same.index(r), len(same), [{"small": s} for s in same]),
        "new_group": (members.index(r), len(members), [{"small": s} for s in members]) if r in members else None,
        "split_reversed": (n - 1 - r, [{"small": s} for s in reversed(range(n))]),
        "dup": (r, n, [{"small": s} for s in range(n)]),
        "async": ("Handle", [{"small": s} for s in range(n)]),
        "in_order": [("item", i) for i in range(2 * n)] if r == 0 else None,
        "ring": {"small": (r - 1) % n} if n > 1 else None,
    }


def check(result: dict[str, Any], *, local: tuple[int, int] | None = None) -> None:
    r, n = result["rank"], result["world"]
    want = expected(r, n)
    for key, value in want.items():
        assert result[key] == value, f"rank {r} of {n}: {key}: got {result[key]!r}, want {value!r}"
    assert len(set(result["seeds"])) == 1, f"rank {r}: seeds differ across ranks: {result['seeds']}"
    if local is not None:
        assert result["local"] == local, f"rank {r}: local rank/size {result['local']}, want {local}"
