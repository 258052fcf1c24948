"""split's keys in any order (MPI's: by key, then by rank) and dup, over real gloo processes and the
test doubles. A torch process group orders its ranks by global rank; a communicator split with keys
out of that order numbers its ranks by key all the same, in every collective."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded, spawn
from tests.contract import check, exercise, exercise_point_to_point

SHUFFLED = {4: [2, 0, 3, 1], 6: [3, 5, 0, 4, 1, 2]}
"""Each rank's key, by rank: a shuffle of the ranks."""


def key_of(how: str, r: int, n: int) -> int:
    return -r if how == "reversed" else SHUFFLED[n][r]


def order_of(how: str, n: int) -> list[int]:
    """The parent ranks in the new communicator's rank order."""
    return sorted(range(n), key=lambda r: key_of(how, r, n))


def _contract_reordered(how: str, point_to_point: bool = False) -> Any:
    def fn(comm: distcomm.Communicator) -> Any:
        with comm.split(0, key=key_of(how, comm.rank, comm.world_size)) as sub:
            assert sub is not None
            return (exercise_point_to_point if point_to_point else exercise)(sub)
    return fn


@pytest.mark.parametrize("how", ["reversed", "shuffled"])
def test_the_contract_holds_on_a_reordered_split_gloo(how: str) -> None:
    """Every collective of the contract, numbered by key: results, roots, scatter's parts, tensor rows."""
    n = 4
    for r, result in enumerate(spawn(_contract_reordered(how), n, timeout=180)):
        want = order_of(how, n).index(r)
        assert result["rank"] == want
        check(result, local=(want, n))


@pytest.mark.slow  # a world of 6 of its own: beyond small worlds (Bruck's exchange, native scatter, gathered reduce)
@pytest.mark.parametrize("point_to_point", [False, True])
def test_the_contract_holds_on_a_reordered_split_beyond_small_worlds(point_to_point: bool) -> None:
    n = 6
    for r, result in enumerate(spawn(_contract_reordered("shuffled", point_to_point), n, timeout=240)):
        want = order_of("shuffled", n).index(r)
        check(result, local=(want, n))


def test_the_contract_holds_on_a_reordered_split_threaded() -> None:
    for how in ("reversed", "shuffled"):
        for r, result in enumerate(run_threaded(_contract_reordered(how), 4, timeout=60)):
            check(result, local=(order_of(how, 4).index(r), 4))


def numbered_by_key(comm: distcomm.Communicator) -> dict[str, Any]:
    """Each collective of a split whose keys shuffle the ranks, returning parent ranks so that
    the order shows; then a split of it, a dup of it, and point-to-point messages in it."""
    r, n = comm.rank, comm.world_size
    sub = comm.split(0, key=SHUFFLED[n][r])
    assert sub is not None
    s = sub.rank
    out: dict[str, Any] = {"rank": s, "world": sub.world_size}
    out["all_gather"] = sub.all_gather(r)
    out["gather"] = sub.gather(r, dst=1)
    out["broadcast"] = sub.broadcast(r, src=2)
    out["scatter"] = sub.scatter([f"part{i}" for i in range(n)] if s == 3 else None, src=3)
    red = sub.reduce_dict({"x": torch.tensor(float(r)), "first": torch.tensor(float(r * (s == 0)))}, average=False)
    out["reduce_dict"] = {k: float(v) for k, v in red.items()} if s == 0 else None
    out["reduce_object"] = sub.reduce_object([r], "sum", dst=2)
    out["scan"] = sub.scan([r], "sum")
    out["all_to_all"] = sub.all_to_all([f"{r}->{d}" for d in range(n)])
    out["all_gather_tensor"] = sub.all_gather_tensor(torch.tensor([r])).tolist()
    out["all_gather_tensor_unchecked"] = sub.all_gather_tensor(torch.tensor([r]), check=False).tolist()
    out["all_gather_tensor_uneven"] = sub.all_gather_tensor(torch.full((s,), r)).tolist()
    out["broadcast_tensor"] = sub.broadcast_tensor(torch.tensor([r]), src=1).tolist()
    out["broadcast_tensor_unchecked"] = sub.broadcast_tensor(torch.tensor([r]), src=1, check=False).tolist()
    got = sub.reduce(torch.tensor([float(r)]), dst=3, op="max").tolist()
    out["reduce"] = got if s == 3 else None
    out["reduce_scatter"] = sub.reduce_scatter_tensor(torch.arange(float(n)) * (r + 1)).tolist()
    out["all_reduce"] = sub.all_reduce(torch.tensor([float(r)]), check=False).tolist()
    sent = sub.isend(r, (s + 1) % n)  # a ring of messages, by the new ranks
    out["recv"] = sub.recv((s - 1) % n)
    sent.wait()
    inner = sub.split(s % 2, key=-s)  # a reordered split of a reordered split
    assert inner is not None
    out["inner"] = (inner.rank, inner.world_size, inner.all_gather(r), inner.broadcast(r, src=0),
                    inner.all_gather_tensor(torch.tensor([r])).tolist())
    twin = sub.dup()
    out["dup"] = (twin.rank, twin.world_size, twin.all_gather(r),
                  twin.broadcast_tensor(torch.tensor([r]), src=1).tolist())
    return out


def expected_numbered_by_key(r: int, n: int) -> dict[str, Any]:
    order = order_of("shuffled", n)  # parent ranks by new rank
    s = order.index(r)
    inner = [order[i] for i in sorted(range(s % 2, n, 2), reverse=True)]  # this color's parent ranks, reversed
    return {
        "rank": s, "world": n, "all_gather": order, "gather": order if s == 1 else [], "broadcast": order[2],
        "scatter": f"part{s}", "reduce_dict": {"first": float(order[0]), "x": float(sum(range(n)))} if s == 0 else None,
        "reduce_object": order if s == 2 else None, "scan": order[: s + 1],
        "all_to_all": [f"{p}->{s}" for p in order],
        "all_gather_tensor": order, "all_gather_tensor_unchecked": order,
        "all_gather_tensor_uneven": [p for i, p in enumerate(order) for _ in range(i)],
        "broadcast_tensor": [order[1]], "broadcast_tensor_unchecked": [order[1]],
        "reduce": [float(n - 1)] if s == 3 else None,
        "reduce_scatter": [float(s * n * (n + 1) // 2)], "all_reduce": [float(sum(range(n)))],
        "recv": order[(s - 1) % n],
        "inner": (inner.index(r), len(inner), inner, inner[0], inner),
        "dup": (s, n, order, [order[1]]),
    }


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_every_collective_is_numbered_by_key(world: str) -> None:
    n = 4
    results = spawn(numbered_by_key, n, timeout=180) if world == "gloo" else run_threaded(numbered_by_key, n)
    for r, got in enumerate(results):
        assert got == expected_numbered_by_key(r, n), f"rank {r}"


def test_fake_numbers_a_split_by_key() -> None:
    # the scripted peers pass reversed keys; rank 1 of 4 is then rank 2, and its peer r is parent rank 3 - r
    def peers(op: str, r: int, obj: Any) -> Any:
        if op == "split":  # split's and dup's exchange
            return (0, -r, None) if obj[2] is None else obj
        return f"from {r}"

    comm = FakeCommunicator(1, 4, peers=peers)
    sub = comm.split(0, key=-1)
    assert isinstance(sub, FakeCommunicator) and (sub.rank, sub.world_size) == (2, 4)
    assert sub.all_gather("mine") == ["from 3", "from 2", "mine", "from 0"]
    assert sub.broadcast("mine", src=0) == "from 3"
    twin = sub.dup()
    assert isinstance(twin, FakeCommunicator) and (twin.rank, twin.world_size) == (2, 4)
    assert twin.all_gather("mine") == ["from 3", "from 2", "mine", "from 0"]
    # equal keys: by rank
    tied = FakeCommunicator(2, 3, peers=lambda op, r, obj: (0, 7, None) if op == "split" else obj).split(0, key=7)
    assert tied is not None and tied.rank == 2


def test_local_split_and_dup() -> None:
    with distcomm.LocalCommunicator() as comm:
        sub, twin = comm.split(0, key=-5), comm.dup()
        assert isinstance(sub, distcomm.LocalCommunicator) and (sub.rank, sub.world_size) == (0, 1)
        assert isinstance(twin, distcomm.LocalCommunicator) and twin is not comm and twin.all_gather(3) == [3]
    assert repr(twin).endswith("closed)")  # closed with its parent


# ---------------------------------------------------------------- dup: collectives of its own
def beside_the_loop(comm: distcomm.Communicator) -> Any:
    """A metrics thread all-reducing on a dup while the main thread runs collectives on the parent,
    interleaved: each communicator's results are its own, and neither is misused."""
    r, n = comm.rank, comm.world_size
    twin = comm.dup()
    assert (twin.rank, twin.world_size) == (r, n)
    got: dict[str, Any] = {}
    steps = 30

    def metrics() -> None:
        try:
            got["metrics"] = [twin.all_reduce(torch.tensor([float(i + r)])).item() for i in range(steps)]
            got["metrics_objs"] = [twin.all_gather(("m", i, r)) for i in range(steps)]
        except BaseException as e:  # reported by the main thread
            got["error"] = repr(e)

    t = threading.Thread(target=metrics)
    t.start()
    loop = []
    for i in range(steps):
        loop.append(comm.all_gather(("loop", i, r)))
        loop.append(comm.broadcast_tensor(torch.tensor([i * 10 + r]), src=i % n).tolist())
    t.join()
    return loop, got, twin._misused, comm._misused, twin in comm._children.values()


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_dup_runs_beside_its_parent_from_another_thread(world: str) -> None:
    n, steps = 3, 30
    results = spawn(beside_the_loop, n, timeout=180) if world == "gloo" else run_threaded(beside_the_loop, n)
    for loop, got, twin_misused, misused, owned in results:
        assert "error" not in got, got.get("error")
        assert got["metrics"] == [float(n * i + sum(range(n))) for i in range(steps)]
        assert got["metrics_objs"] == [[("m", i, p) for p in range(n)] for i in range(steps)]
        assert loop == [x for i in range(steps)
                        for x in ([("loop", i, p) for p in range(n)], [i * 10 + i % n])]
        assert twin_misused is None and misused is None and owned


def test_dup_is_closed_with_its_parent_and_recorded_by_the_fake() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        twin = comm.dup()
        twin.all_gather(1)
        comm.close()
        return repr(twin)

    for text in run_threaded(fn, 2):
        assert text.endswith("closed)")
    fake = FakeCommunicator(0, 2)
    assert fake.dup().world_size == 2 and [c.op for c in fake.calls] == ["dup"]


def _split_beside_a_partial_new_group(comm: distcomm.Communicator) -> Any:
    """On a sub-communicator, ranks 0 and 1 keep a new_group open, then every rank splits across it."""
    sub = comm.dup(timeout=30)
    pair = sub.new_group([0, 1])
    try:
        sub.split(sub.rank % 2)  # {0, 2} and {1, 3}: members that hold the pair's group and members that don't
    except distcomm.DistCommError as e:
        return type(e).__name__, str(e)
    finally:
        if pair is not None:
            pair.close()
        sub.close()
    return "no error", ""


def test_a_split_across_an_open_partial_new_group_is_refused() -> None:
    """torch would name the split's groups differently on ranks that hold the open group and on
    ranks that don't, which then wait for each other: refused on every rank, before any group."""
    for r, (kind, text) in enumerate(spawn(_split_beside_a_partial_new_group, 4, timeout=120, reuse=False)):
        assert kind == "CollectiveError", (r, kind, text)
        assert "ranks 0, 2 would make a group together" in text and "close that new_group" in text, (r, text)
