"""Non-blocking collectives (async_op=True): the same results as the blocking calls, in the order
each rank started them, errors from wait() on every rank, close() with pending work, wait(timeout)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm._communicator import COLLECTIVES
from distcomm.testing import FakeCommunicator, run_threaded, spawn

Call = Callable[[distcomm.Communicator], tuple[tuple[Any, ...], dict[str, Any]]]

# every collective that returns values (the ones that make communicators are checked apart)
CALLS: dict[str, Call] = {
    "synchronize": lambda c: ((), {}),
    "all_gather": lambda c: (({"r": c.rank, "a": np.arange(c.rank * 20_000)},), {}),
    "gather": lambda c: ((c.rank * 10,), {"dst": c.world_size - 1}),
    "broadcast": lambda c: (({"from": c.rank},), {"src": 0}),
    "scatter": lambda c: (([f"to {r}" for r in range(c.world_size)],), {"src": 0}),
    "reduce_dict": lambda c: (({"loss": torch.tensor(float(c.rank))},), {}),
    "all_reduce_dict": lambda c: (({"loss": torch.tensor(float(c.rank)), "n": torch.tensor(1.0)},), {"average": False}),
    "all_reduce": lambda c: ((torch.arange(4.0) + c.rank,), {}),
    "reduce": lambda c: ((torch.arange(4.0) + c.rank,), {"op": "max"}),
    "broadcast_tensor": lambda c: ((torch.full((3,), float(c.rank)),), {"src": 0}),
    "all_gather_tensor": lambda c: ((torch.full((c.rank + 1, 2), float(c.rank)),), {}),
    "reduce_scatter_tensor": lambda c: ((torch.ones(c.world_size * 2) * (c.rank + 1),), {}),
    "reduce_object": lambda c: (({c.rank},), {"op": "union"}),
    "all_reduce_object": lambda c: ((c.rank == 1,), {"op": "any"}),
    "scan": lambda c: ((c.rank + 1,), {"op": "sum"}),
    "exscan": lambda c: ((c.rank + 1,), {"op": "sum"}),
    "all_to_all": lambda c: (([(c.rank, d) for d in range(c.world_size)],), {}),
    "gather_in_order": lambda c: (([c.rank * 10, None],), {"size": 2 * c.world_size}),
}
MAKERS = ("split", "new_group", "create_local_groups", "dup", "shared_random_seed")


def _plain(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", x.tolist())
    if isinstance(x, np.ndarray):
        return ("array", x.tolist())
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _both_ways(comm: distcomm.Communicator) -> dict[str, Any]:
    out = {}
    for name, make in CALLS.items():
        args, kwargs = make(comm)
        blocking = _plain(getattr(comm, name)(*args, **kwargs))
        args, kwargs = make(comm)
        handle = getattr(comm, name)(*args, async_op=True, **kwargs)
        assert isinstance(handle, distcomm.Handle)
        out[name] = (blocking, _plain(handle.wait()))
    barrier = comm.barrier(async_op=True)
    assert isinstance(barrier, distcomm.Handle) and barrier.wait() is None and comm.barrier() is None
    seeds = comm.all_gather(comm.shared_random_seed(async_op=True).wait())
    out["shared_random_seed"] = len(set(seeds)) == 1
    return out


def test_every_collective_is_listed() -> None:
    assert set(COLLECTIVES) <= set(CALLS) | set(MAKERS)


def _check(results: list[dict[str, Any]]) -> None:
    for got in results:
        for name, value in got.items():
            if name == "shared_random_seed":
                assert value is True
            else:
                blocking, nonblocking = value
                assert nonblocking == blocking, name


def test_results_equal_the_blocking_calls_over_gloo() -> None:
    _check(spawn(_both_ways, 2, timeout=120))


def test_results_equal_the_blocking_calls_on_the_doubles() -> None:
    _check([_both_ways(FakeCommunicator(1, 3))])
    _check([_both_ways(distcomm.LocalCommunicator())])
    _check(run_threaded(_both_ways, 3, timeout=60))


def _ordered(comm: distcomm.Communicator) -> Any:
    handles = [comm.all_gather((comm.rank, i), async_op=True) for i in range(5)]
    handles.append(comm.broadcast(np.arange(200_000) * (comm.rank + 1), src=1, async_op=True))
    last = comm.all_gather("blocking")  # waits for the queued ones: they ran first, in order
    assert all(h.done() for h in handles)
    got = [h.wait() for h in handles]
    sub = comm.split(0, async_op=True).wait()
    assert sub is not None and sub.world_size == comm.world_size
    return got[:5], int(got[5][-1]), last, sub.all_gather(comm.rank)


def test_calls_run_in_the_order_each_rank_started_them() -> None:
    for results in (spawn(_ordered, 2, timeout=120), run_threaded(_ordered, 2, timeout=60)):
        for first, bcast, last, sub in results:
            assert first == [[(0, i), (1, i)] for i in range(5)]
            assert bcast == 199_999 * 2
            assert last == ["blocking", "blocking"]
            assert sub == [0, 1]


def _keys_differ(comm: distcomm.Communicator) -> str:
    h = comm.reduce_dict({f"k{comm.rank}": torch.tensor(1.0)}, async_op=True)
    with pytest.raises(distcomm.CollectiveMismatchError) as e:
        h.wait()
    with pytest.raises(distcomm.CollectiveMismatchError):  # the same error again
        h.wait()
    assert comm.all_gather(comm.rank) == [0, 1]  # still usable: every rank raised alike
    return str(e.value).split("\n")[0]


def test_errors_raise_from_wait_on_every_rank() -> None:
    for got in (spawn(_keys_differ, 2, timeout=120), run_threaded(_keys_differ, 2, timeout=60)):
        assert got[0] == got[1] and "reduce_dict" in got[0]


def _peer_late(comm: distcomm.Communicator) -> str:
    if comm.rank == 0:
        h = comm.all_gather(0, timeout=1.0, async_op=True)
        with pytest.raises(distcomm.CollectiveTimeoutError):
            h.wait()
        return "timed out"
    time.sleep(4)
    return "late"


def test_a_collective_timeout_raises_from_wait() -> None:
    assert spawn(_peer_late, 2, timeout=120, reuse=False, return_exceptions=True)[0] == "timed out"


def test_wait_with_a_timeout_leaves_the_handle_waitable() -> None:
    gate = threading.Event()

    def peers(op: str, rank: int, obj: Any) -> Any:
        gate.wait(30)  # the scripted peer takes its time
        return obj

    comm = FakeCommunicator(0, 2, peers=peers)
    h = comm.all_gather(1, async_op=True)
    assert not h.done()
    with pytest.raises(TimeoutError, match="still running"):
        h.wait(timeout=0.2)
    with pytest.raises(distcomm.CommunicatorStateError, match=r"pending \(all_gather at"):
        comm.close()  # not a hang: a clear error naming the pending call
    gate.set()
    assert h.wait(timeout=30) == [1, 1] and h.done()
    assert "done" in repr(h)
    comm.close()  # nothing pending now
    with pytest.raises(distcomm.CommunicatorStateError, match="closed"):
        comm.all_gather(1, async_op=True)


def _slow_peers(gate: threading.Event) -> Any:
    def peers(op: str, rank: int, obj: Any) -> Any:
        if op == "all_gather":
            gate.wait(30)  # the scripted peer takes its time
        return obj

    return peers


def test_close_refuses_pending_work_on_a_sub_communicator_and_changes_nothing() -> None:
    gate = threading.Event()
    comm = FakeCommunicator(0, 2, peers=_slow_peers(gate))
    child = comm.dup()
    assert child is not None
    h = child.all_gather(1, async_op=True)
    with pytest.raises(distcomm.CommunicatorStateError, match=r"pending \(all_gather at"):
        comm.close()
    assert not comm._closed and not child._closed  # refused before anything was released
    gate.set()
    assert h.wait(timeout=30) == [1, 1]
    comm.close()
    assert comm._closed and child._closed


def test_an_error_leaving_a_with_block_is_not_hidden_by_pending_work() -> None:
    gate = threading.Event()
    comm = FakeCommunicator(0, 2, peers=_slow_peers(gate))
    with pytest.raises(ValueError, match="the user's") as info:
        with comm:
            h = comm.all_gather(1, async_op=True)
            raise ValueError("the user's error")
    assert not comm._closed  # left open: closing would break the pending call
    if hasattr(info.value, "__notes__"):
        assert "left open" in info.value.__notes__[0]
    gate.set()
    assert h.wait(timeout=30) == [1, 1]
    comm.close()


def test_bad_arguments_raise_from_wait_and_async_op_must_be_a_bool() -> None:
    comm = distcomm.LocalCommunicator()
    with pytest.raises(ValueError, match="out of range"):
        comm.gather(1, dst=3, async_op=True).wait()
    with pytest.raises(TypeError, match="async_op"):
        comm.all_gather(1, async_op=1)  # type: ignore[call-arg]


def test_start_is_the_typed_spelling() -> None:
    comm = FakeCommunicator(0, 2)
    h: distcomm.Handle[list[Any]] = comm.start(comm.gather, "x", 0)
    assert h.wait() == ["x", "x"]
    assert [c.op for c in comm.calls] == ["gather"]  # the fake records it when it runs
    with pytest.raises(TypeError, match="collective"):
        comm.start(print, "x")


def test_a_second_thread_is_still_refused() -> None:
    gate = threading.Event()

    def peers(op: str, rank: int, obj: Any) -> Any:
        gate.wait(30)
        return obj

    comm = FakeCommunicator(0, 2, peers=peers)
    h = comm.all_gather(1, async_op=True)  # the worker holds the communicator
    deadline = time.monotonic() + 30
    while not comm._busy.locked() and time.monotonic() < deadline:
        time.sleep(0.001)
    refused: list[BaseException] = []

    def intruder() -> None:
        try:
            comm._queues.collectives = None  # pretend not to know of the queue: a second user thread
            comm.all_gather(2)
        except distcomm.CommunicatorStateError as e:
            refused.append(e)

    t = threading.Thread(target=intruder)
    t.start()
    t.join(30)
    gate.set()
    assert refused and "two threads" in str(refused[0])
    h.wait(30)


class _Watched(threading.Event):
    """A handle's event that notes, when the call is marked done, what the worker still holds."""

    def __init__(self, seen: list[tuple[bool, int]], arg: Any, comm: distcomm.Communicator) -> None:
        super().__init__()
        self._seen, self._arg, self._comm = seen, arg, comm

    def set(self) -> None:
        self._seen.append((self._arg() is not None, len(self._comm._pending_calls())))
        super().set()


def test_a_call_is_let_go_before_its_handle_says_done(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker used to hold a finished call's arguments after waking its waiter (a tensor freed
    from that daemon thread during interpreter exit aborted the process), and still counted the
    call as running (close() right after wait() raised "still pending")."""
    import weakref

    from distcomm import _handles

    seen: list[tuple[bool, int]] = []
    mine = threading.local()  # each rank's argument and communicator, where its handles are made

    class Watched(_handles.Handle[Any]):
        def __init__(self, name: str, site: tuple[str, int]) -> None:
            super().__init__(name, site)
            self._event = _Watched(seen, mine.arg, mine.comm)

    def fn(comm: distcomm.Communicator) -> Any:
        arg = torch.ones(8)
        mine.arg, mine.comm = weakref.ref(arg), comm
        h = comm.all_gather_tensor(arg, async_op=True)
        del arg
        return tuple(h.wait(timeout=30).shape)

    monkeypatch.setattr(_handles, "Handle", Watched)
    assert run_threaded(fn, 2) == [(16,), (16,)]
    assert seen == [(False, 0), (False, 0)]  # the argument already freed, nothing pending


def test_the_worker_runs_in_the_callers_grad_mode() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        w = torch.ones(2, requires_grad=True)
        with torch.no_grad():
            blocking = comm.all_gather_tensor(w)
            waited = comm.all_gather_tensor(w, async_op=True).wait()
        with torch.inference_mode():
            inferred = comm.all_gather_tensor(w, async_op=True).wait()
        grad = comm.all_gather_tensor(w * 2, async_op=True).wait()
        return [(t.requires_grad, t.grad_fn is not None) for t in (blocking, waited, grad)] + [inferred.is_inference()]

    for out in [*run_threaded(fn, 2), fn(FakeCommunicator(0, 2))]:
        assert out == [(False, False), (False, False), (True, True), True]
