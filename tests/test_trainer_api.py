"""The trainer-facing API's failure modes: every bad input raises the same error on every rank, and
the communicator works for the next call. Over real gloo processes and the threaded world.

What every communicator returns for good input is in the contract suite (tests/contract.py).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm import _communicator as front_door
from distcomm.testing import FakeCommunicator, run_threaded, spawn
from tests.test_faults import outcome

WORLDS = ["gloo", "threaded"]


def run(world: str, fn: Callable[[Any], Any], n: int = 3) -> list[Any]:
    if world == "gloo":
        return spawn(fn, n, timeout=120)
    return run_threaded(fn, n, timeout=60)


def after(comm: distcomm.Communicator) -> list[float]:
    """The next collective, to show the communicator still works."""
    return comm.all_reduce(torch.tensor([float(comm.rank)])).tolist()


def tensor_errors(comm: distcomm.Communicator) -> list[Any]:
    r = comm.rank
    cases: list[Callable[[], Any]] = [
        lambda: comm.all_reduce(torch.ones(2 + (r == 2))),  # shape differs on rank 2
        lambda: comm.all_gather_tensor(torch.ones(r + 1, 3 if r != 1 else 4)),  # trailing dims differ on rank 1
        lambda: comm.all_reduce(torch.ones(2), "sum" if r else "max"),  # rank 0 asks another op
        lambda: comm.all_reduce(torch.ones(2)) if r else comm.broadcast_tensor(torch.ones(2)),
        lambda: comm.all_reduce([1.0] if r == 1 else torch.ones(2)),  # type: ignore[arg-type]
        lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), "mean"),
        lambda: comm.reduce_scatter_tensor(torch.ones(4)),
        lambda: comm.broadcast_tensor(torch.ones(2, dtype=torch.float64 if r == 2 else torch.float32), src=1),
        lambda: comm.all_gather_tensor([1, 2] if r == 1 else torch.ones(2)),  # type: ignore[arg-type]
    ]
    return [(outcome(case), after(comm)) for case in cases]


# gloo: a world of 3 of its own
@pytest.mark.parametrize("world", [pytest.param("gloo", marks=pytest.mark.slow), "threaded"])
def test_tensor_input_errors_reach_every_rank(world: str) -> None:
    results = run(world, tensor_errors)
    want = [
        ("CollectiveMismatchError", "rank 2: torch.float32 (3,)", (2,)),
        ("CollectiveMismatchError", "beyond the first dimension", (1,)),
        ("CollectiveMismatchError", "op='max'", (0,)),
        ("CollectiveMismatchError", "ranks called different collectives", (0,)),  # the ranks unlike most
        ("CollectiveError", "got a list, not a tensor", (1,)),
        ("CollectiveError", "op='mean' needs a floating point or complex tensor", (0, 1, 2)),
        ("CollectiveError", "dim 0 must be a multiple of world_size 3", (0, 1, 2)),
        ("CollectiveMismatchError", "rank 2: torch.float64 (2,)", (2,)),
        ("CollectiveError", "got a list, not a tensor", (1,)),
    ]
    for rank, cases in enumerate(results):
        assert len(cases) == len(want)
        for i, ((kind, text, ranks, _), nxt) in enumerate(cases):
            w_kind, w_text, w_ranks = want[i]
            assert kind == w_kind and w_text in text and tuple(ranks) == w_ranks, (rank, i, kind, text, ranks)
            assert nxt == [3.0]


@pytest.mark.slow  # a gloo world of its own
def test_gloo_refuses_tensors_on_another_device() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        t = torch.empty(2, device="meta") if comm.rank == 1 else torch.ones(2)
        return outcome(lambda: comm.all_reduce(t)), after(comm)

    for (kind, text, ranks, _), nxt in spawn(fn, 2, timeout=120):
        assert kind == "CollectiveError" and ranks == (1,) and "takes CPU tensors, this one is on meta" in text
        assert nxt == [1.0]


def test_bad_arguments_raise_before_any_communication() -> None:
    comm = FakeCommunicator(0, 2)
    with pytest.raises(ValueError, match="op must be one of"):
        comm.all_reduce(torch.ones(1), "avg")
    with pytest.raises(ValueError, match="dst=2 is out of range"):
        comm.reduce(torch.ones(1), dst=2)
    with pytest.raises(TypeError, match="check must be a bool"):
        comm.all_reduce(torch.ones(1), check=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="op must be a callable op"):
        comm.all_reduce_object(1, "avg")
    with pytest.raises(TypeError, match="op must be a callable"):
        comm.scan(1, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="color must be an int >= 0 or None"):
        comm.split(-1)
    with pytest.raises(ValueError, match="distinct and not empty"):
        comm.new_group([1, 1])
    with pytest.raises(ValueError, match="rank 2 is out of range"):
        comm.new_group([2])
    assert comm.stats == {} and all(c.error is not None for c in comm.calls)  # nothing reached the pipeline
    with pytest.raises(ValueError, match="all_reduce: op='mean' needs"):  # check=False: this rank's error, raised here
        comm.all_reduce(torch.ones(1, dtype=torch.int32), "mean", check=False)
    local = distcomm.LocalCommunicator()
    with pytest.raises(distcomm.CollectiveError, match="not a tensor"):  # what every rank raises at world 2
        local.all_reduce([1.0])  # type: ignore[arg-type]
    with pytest.raises(distcomm.CollectiveError, match="got 2 objects for world_size 1"):
        local.all_to_all([1, 2])


def differentiable(comm: distcomm.Communicator) -> Any:
    x = torch.full((comm.rank + 1, 2), float(comm.rank + 1), requires_grad=True)
    gathered = comm.all_gather_tensor(x)
    weights = torch.arange(1.0, gathered.numel() + 1).reshape(gathered.shape)
    (gathered * weights).sum().backward()
    assert x.grad is not None
    y = torch.ones(2, requires_grad=True)
    comm.all_reduce(y)  # in place under no_grad: no autograd record, no error on a leaf
    return x.grad.tolist(), gathered.requires_grad, y.grad_fn is None, y.tolist()


@pytest.mark.parametrize("world", [*WORLDS, "fake"])
def test_all_gather_tensor_is_differentiable(world: str) -> None:
    n = 3
    if world == "fake":
        results = [differentiable(FakeCommunicator(r, n, peers=lambda op, p, obj: obj)) for r in range(n)]
    else:
        results = run(world, differentiable, n)
    rows = [s for s in range(n) for _ in range(s + 1)]
    for r, (grad, tracked, untracked, summed) in enumerate(results):
        if world == "fake":  # every peer contributes this rank's tensor and gradient
            start = r * (r + 1)
            want = [[n * (2 * (start + i) + 1), n * (2 * (start + i) + 2)] for i in range(r + 1)]
        else:  # d/dx of sum over ranks of sum(weights * gathered): the world size times this rank's weights
            start = rows.index(r)
            want = [[n * (2 * (start + i) + 1), n * (2 * (start + i) + 2)] for i in range(r + 1)]
        assert grad == want, (r, grad)
        assert tracked and untracked and summed == [float(n)] * 2


def object_errors(comm: distcomm.Communicator) -> list[Any]:
    r = comm.rank
    cases: list[Callable[[], Any]] = [
        lambda: comm.all_reduce_object("x" if r == 2 else r, "sum"),
        lambda: comm.scan(threading.Lock() if r == 1 else r, "sum"),
        lambda: comm.reduce_object({r} if r else {0: 0}, "union", dst=1),
        lambda: comm.all_to_all([r] * (3 if r != 1 else 2)),
        lambda: comm.all_to_all([threading.Lock() if (r, d) == (2, 0) else d for d in range(3)]),
    ]
    return [(outcome(case), after(comm)) for case in cases]


@pytest.mark.parametrize("world", WORLDS)
def test_object_reduction_errors_reach_every_rank(world: str) -> None:
    want = [
        ("CollectiveError", "op 'sum' failed on rank 0 combining rank 2's object: TypeError", (2,)),
        ("SerializationError", "rank 1", (1,)),
        ("CollectiveError", "'union' needs sets or dicts", (1,)),
        ("CollectiveError", "all_to_all got 2 objects for world_size 3", (1,)),
        ("SerializationError", "rank 2", (2,)),
    ]
    for rank, cases in enumerate(run(world, object_errors)):
        for i, ((kind, text, ranks, _), nxt) in enumerate(cases):
            w_kind, w_text, w_ranks = want[i]
            assert kind == w_kind and w_text in text and tuple(ranks) == w_ranks, (rank, i, kind, text, ranks)
            assert nxt == [3.0]


def ordered_and_large(comm: distcomm.Communicator) -> Any:
    r, n = comm.rank, comm.world_size
    text = comm.scan(chr(ord("a") + r), lambda a, b: a + b)  # not commutative: rank order shows
    ex = comm.exscan(chr(ord("a") + r), lambda a, b: a + b)
    big = comm.all_to_all([np.full(100_000 + d, r * 10 + d, dtype=np.float64) for d in range(n)])
    aligned = all(a.ctypes.data % 64 == 0 for s, a in enumerate(big) if s != r)  # received ones
    counts = comm.all_reduce_object({"seen": r}, lambda a, b: {"seen": a["seen"] + b["seen"]})
    return text, ex, [(a.shape[0], float(a[0])) for a in big], aligned, counts


@pytest.mark.parametrize("world", WORLDS)
def test_rank_order_and_large_all_to_all(world: str) -> None:
    n = 3
    for r, (text, ex, big, aligned, counts) in enumerate(run(world, ordered_and_large, n)):
        assert text == "abc"[: r + 1]
        assert ex == (None if r == 0 else "abc"[:r])
        assert big == [(100_000 + r, float(s * 10 + r)) for s in range(n)]
        assert aligned
        assert counts == {"seen": 3}


@pytest.mark.slow  # a gloo world of its own
def test_all_to_all_respects_max_bytes() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        parts = [np.zeros(50_000 if comm.rank == 0 else 10, dtype=np.uint8) for _ in range(2)]
        return outcome(lambda: comm.all_to_all(parts)), after(comm)

    results = run_threaded(fn, 2, max_bytes=30_000) + spawn(fn, 2, timeout=120, max_bytes=30_000)
    for (kind, text, ranks, _), nxt in results:
        assert kind == "PayloadTooLargeError" and ranks == (0,) and "over max_bytes=30000" in text
        assert nxt == [1.0]


def sub_communicators(comm: distcomm.Communicator) -> Any:
    r = comm.rank
    with comm.split(0, key=-r) as backwards:  # keys that order the ranks backwards: numbered by key
        bad_key = (backwards.rank, backwards.all_gather(r))
    none = comm.split(None if r == 0 else 1)
    odd = outcome(lambda: comm.new_group([0, 1] if r else [0, 2]))
    pair = comm.new_group([1, 2])
    inner = None
    if pair is not None:
        inner = (pair.rank, pair.all_reduce(torch.tensor([float(r)])).tolist(),
                 pair.all_gather_tensor(torch.tensor([r])).tolist(), pair.scan(r, "sum"))
        solo = pair.split(pair.rank)  # a split of a split
        assert solo is not None
        inner += (solo.world_size, solo.all_gather(r))
    sizes = None if none is None else (none.rank, none.world_size)
    children = list(comm._children.values())
    comm_after = after(comm)
    return bad_key, sizes, odd, inner, comm_after, len(children)


@pytest.mark.parametrize("world", WORLDS)
def test_split_and_new_group(world: str) -> None:
    for r, (bad_key, sizes, odd, inner, nxt, children) in enumerate(run(world, sub_communicators)):
        assert bad_key == (2 - r, [2, 1, 0])
        assert sizes == (None if r == 0 else (r - 1, 2))
        kind, text, ranks, _ = odd
        assert kind == "CollectiveMismatchError" and "rank 0: [0, 2]" in text and ranks == (0,)
        assert inner == (None if r == 0 else (r - 1, [3.0], [1, 2], 1 if r == 1 else 3, 1, [r]))
        assert nxt == [3.0]
        assert children == (0 if r == 0 else 2)


def test_parent_closes_its_sub_communicators() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        sub = comm.split(0)
        assert sub is not None
        sub.all_gather(1)
        comm.close()
        return repr(sub)

    for text in spawn(fn, 2, timeout=120) + run_threaded(fn, 2):
        assert text.endswith("closed)")


def test_doubles_refuse_unchecked_mismatches_as_a_transport_would() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        uneven = outcome(lambda: comm.all_gather_tensor(torch.ones(comm.rank + 1), check=False))
        dtypes = outcome(lambda: comm.all_reduce(torch.ones(3, dtype=torch.float64 if comm.rank else torch.float32),
                                                 check=False))
        return uneven[0], dtypes[0]

    assert run_threaded(fn, 2) == [("CollectiveError", "CollectiveError")] * 2
    for one in (distcomm.LocalCommunicator(), FakeCommunicator(0, 1)):
        assert one.all_reduce_object(torch.tensor(False), "any") is False  # the type a fold of two gives


def test_fake_records_and_scripts_the_new_ops() -> None:
    comm = FakeCommunicator(1, 3, peers=lambda op, r, obj: torch.full_like(obj, r) if op == "all_reduce" else obj)
    assert comm.all_reduce(torch.ones(2), "max").tolist() == [2.0, 2.0]
    assert comm.scan(5, "sum") == 10
    sub = comm.split(1)
    assert isinstance(sub, FakeCommunicator) and (sub.rank, sub.world_size) == (1, 3)
    assert [c.op for c in comm.calls] == ["all_reduce", "scan", "split"]
    assert FakeCommunicator(0, 4).new_group([0, 1]).world_size == 2  # unscripted peers follow the members
    assert FakeCommunicator(2, 4).new_group([0, 1]) is None
    assert comm.calls[0].args["op"] == "max" and comm.calls[2].args == {"color": 1, "key": None}
    odd = FakeCommunicator(0, 2, peers=lambda op, r, obj: torch.ones(3))
    with pytest.raises(distcomm.CollectiveMismatchError, match=r"rank 1: torch.float32 \(3,\)"):
        odd.all_reduce(torch.ones(2))


def test_stats_name_what_the_user_called() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        comm.shared_random_seed()
        comm.all_reduce(torch.ones(1000))
        try:
            comm.all_reduce(torch.ones(comm.rank + 1))
        except distcomm.CollectiveMismatchError:
            pass
        stats = comm.stats
        return sorted(stats), stats["all_reduce"].calls, stats["all_reduce"].bytes_sent

    for names, calls, sent in spawn(fn, 2, timeout=120):
        assert names == ["all_reduce", "shared_random_seed"]  # no set-up, no error-path exchange
        assert calls == 2 and sent >= 4000  # the ring's share of 4,000 bytes, plus the checks


def _repeated_splits(comm: distcomm.Communicator) -> tuple[int, int, int]:
    import torch.distributed as dist

    for _ in range(10):  # a split per evaluation: each closed one releases its group
        with comm.split(0) as sub:
            sub.all_gather(1)
    return len(comm._owned), len(comm._children), len(dist.distributed_c10d._world.pg_map)  # type: ignore[attr-defined]


@pytest.mark.slow  # a gloo world of its own
def test_closed_sub_communicators_release_their_groups() -> None:
    # no group left but the default; the parent lets go of a closed child at its next split
    assert spawn(_repeated_splits, 2, timeout=120, reuse=False) == [(0, 1, 1), (0, 1, 1)]


def test_the_backward_all_reduce_is_a_recorded_collective_for_the_fake() -> None:
    """The gradient's all-reduce is a collective of its own: FakeCommunicator records it, and asks
    its peers for their gradients as for any all_reduce."""
    asked: list[str] = []

    def peers(op: str, r: int, obj: Any) -> Any:
        asked.append(op)
        return obj

    comm = FakeCommunicator(0, 2, peers=peers)
    x = torch.ones(2, 2, requires_grad=True)
    comm.all_gather_tensor(x).sum().backward()
    assert [c.op for c in comm.calls] == ["all_gather_tensor", "all_reduce"]
    assert asked[-1] == "all_reduce"
    assert x.grad is not None and x.grad.tolist() == [[2.0, 2.0], [2.0, 2.0]]


def _late_and_lost(comm: distcomm.Communicator) -> Any:
    """An unchecked all_reduce whose peer is 1.6 s late (past the first wait slice), then one whose
    peer never comes."""
    import time

    if comm.rank == 1:
        time.sleep(1.6)
    late = comm.all_reduce(torch.ones(2), check=False, timeout=30).tolist()
    if comm.rank == 1:
        time.sleep(4.5)  # alive, but never calls
        return late, None
    lost = outcome(lambda: comm.all_reduce(torch.ones(2), check=False, timeout=2.5))
    return late, lost


@pytest.mark.slow
def test_unchecked_tensor_waits_past_the_first_slice_and_times_out_with_its_own_timeout() -> None:
    results = spawn(_late_and_lost, 2, timeout=120)
    assert [late for late, _ in results] == [[2.0, 2.0]] * 2
    kind, text = results[0][1][:2]
    assert kind == "CollectiveTimeoutError", results[0][1]
    assert "timed out after 2.5s" in text


def _error(fn: Callable[[], Any]) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # this rank's own input errors are ValueError/TypeError with check=False
        return type(e).__name__, str(e)
    return "ok", ""


def _unchecked_calls(comm: distcomm.Communicator) -> dict[str, Any]:
    """Unchecked tensor collectives, the common case and the cases the torch transports' lane leaves
    to the general path; the results, the errors and the stats."""
    r = comm.rank
    x = torch.full((3,), float(r + 1))
    general: list[str] = []  # the calls that reach the general path
    real = front_door.run_tensor_op

    def spy(comm: distcomm.Communicator, op: Any, *args: Any) -> Any:
        general.append(op.label)
        return real(comm, op, *args)

    gloo = isinstance(comm, distcomm.GlooCommunicator)  # (the threaded world's ranks share their class)
    if gloo:
        front_door.run_tensor_op = spy
    out: dict[str, Any] = {
        "sum": comm.all_reduce(x.clone(), check=False).tolist(),
        "mean": comm.all_reduce(x.clone(), "mean", check=False).tolist(),
        "max": comm.all_reduce(torch.arange(3) * (r + 1), "max", check=False).tolist(),
        "broadcast": comm.broadcast_tensor(x.clone(), src=1, check=False).tolist(),
        "gather 0-d": comm.all_gather_tensor(torch.tensor(float(r)), check=False).tolist(),
        "gather 2-d": comm.all_gather_tensor(torch.full((2, 3), r), check=False).tolist(),
        # what the lane leaves to the general path: non-contiguous, a timeout, complex mean
        "strided": comm.all_reduce(torch.ones(4, 2).t() * (r + 1), check=False).tolist(),
        "timeout": comm.all_reduce(x.clone(), check=False, timeout=30).tolist(),
        "complex mean": comm.all_reduce(torch.ones(2, dtype=torch.complex64), "mean", check=False).tolist(),
        "int mean": _error(lambda: comm.all_reduce(torch.ones(2, dtype=torch.int64), "mean", check=False)),
        "complex max": _error(lambda: comm.all_reduce(torch.ones(2, dtype=torch.complex64), "max", check=False)),
        "grad": comm.all_gather_tensor(torch.ones(2, requires_grad=True), check=False).sum().item(),
        # conjugate views: their memory isn't their value (the transports read memory)
        "conj": comm.all_reduce((torch.ones(2) * 1j).conj(), check=False).tolist(),
        "conj checked": comm.all_reduce((torch.ones(2) * 1j).conj()).tolist(),
        "neg view": comm.all_reduce((torch.ones(2) * 1j).conj().imag, check=False).tolist(),
        "neg gather": comm.all_gather_tensor((torch.ones(1) * (r + 1j)).conj().imag, check=False).tolist(),
        # complex tensors travel as (re, im) pairs (gloo's all-gather refuses complex types)
        "complex gather": comm.all_gather_tensor((torch.ones(1) * (r + 1j)).conj(), check=False).tolist(),
        "complex uneven": comm.all_gather_tensor(torch.ones(r + 1) * (r + 1j)).tolist(),
        "complex broadcast": comm.broadcast_tensor(torch.ones(2) * (r + 1j), src=1, check=False).tolist(),
        # complex reductions: sums of (re, im) pairs (NCCL has no complex types); no product (gloo refuses it)
        "complex reduce": comm.reduce(torch.ones(2) * (r + 1j), dst=0, check=False).tolist(),
        "complex reduce_scatter": comm.reduce_scatter_tensor(torch.arange(4) * (r + 1j), check=False).tolist(),
        "complex prod": _error(lambda: comm.all_reduce(torch.ones(2, dtype=torch.complex64), "prod", check=False)),
        # checked: the same error on every rank (call numbers aside: a reused gloo world has made calls before)
        "complex prod checked": re.sub(r"#\d+", "#N", _error(
            lambda: comm.all_reduce(torch.ones(2, dtype=torch.complex64), "prod"))[1]),
    }
    if gloo:
        front_door.run_tensor_op = real
        out["general"] = general
    out["stats"] = {k: (s.calls, s.bytes_sent, s.bytes_received) for k, s in sorted(comm.stats.items())}
    comm.close()
    out["closed"] = _error(lambda: comm.all_reduce(x, check=False))[0]  # (the message names the class)
    return out


def test_unchecked_tensor_collectives_agree_with_the_doubles() -> None:
    """The gloo communicator's lane for unchecked calls gives the results, errors and stats the
    general path gives in the threaded world (which has no lane)."""
    gloo, threaded = spawn(_unchecked_calls, 2, timeout=120), run_threaded(_unchecked_calls, 2, timeout=60)
    # the gloo lane took the common cases: the general path saw only the rest, from "strided" on
    rest = ["all_gather_tensor"] * 3 + ["broadcast_tensor", "reduce", "reduce_scatter_tensor"] + ["all_reduce"] * 2
    assert [g.pop("general") for g in gloo] == [["all_reduce"] * 5 + ["all_gather_tensor"] + ["all_reduce"] * 3
                                                + rest] * 2
    assert gloo == threaded
    assert gloo[0]["conj"] == [-2j, -2j] and gloo[0]["conj checked"] == [-2j, -2j]
    assert gloo[0]["neg view"] == [-2.0, -2.0] and gloo[0]["neg gather"] == [-1.0, -1.0]
    assert gloo[0]["complex gather"] == [-1j, 1 - 1j] and gloo[0]["complex uneven"] == [1j, 1 + 1j, 1 + 1j]
    assert gloo[0]["complex broadcast"] == [1 + 1j] * 2
    assert gloo[0]["complex reduce"] == [1 + 2j] * 2 and gloo[1]["complex reduce_scatter"] == [2 + 4j, 3 + 6j]
    assert gloo[0]["complex prod"][0] == "ValueError" and "not supported for complex" in gloo[0]["complex prod"][1]
    assert gloo[0]["complex prod checked"].startswith("all_reduce #N failed on ranks 0, 1")
    assert gloo[0]["sum"] == [3.0] * 3 and gloo[0]["mean"] == [1.5] * 3 and gloo[1]["broadcast"] == [2.0] * 3
    assert gloo[0]["gather 0-d"] == [0.0, 1.0] and gloo[0]["int mean"][0] == "ValueError"
    assert gloo[0]["closed"] == "CommunicatorStateError"


def _first_call_fails(comm: distcomm.Communicator) -> str:
    return _error(lambda: comm.all_reduce(torch.ones(2, dtype=torch.complex64), "prod"))[1]


@pytest.mark.slow  # a gloo world of its own
def test_call_numbers_count_the_users_calls_as_the_doubles_do() -> None:
    """Set-up is the torch communicators' call #0: the user's first call is #1 in both."""
    gloo, threaded = spawn(_first_call_fails, 2, timeout=120, reuse=False), run_threaded(_first_call_fails, 2)
    assert gloo == threaded and gloo[0].startswith("all_reduce #1 failed on ranks 0, 1"), gloo
