"""Defects that used to crash, desync or mislead, each over real gloo processes or the threaded world."""

from __future__ import annotations

import math
import struct
import threading
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm._wire import frame as _frame
from distcomm.testing import FakeCommunicator, run_threaded, spawn
from tests.test_faults import outcome


def _aligned_results(comm: distcomm.Communicator) -> list[tuple[int, bool, float]]:
    # a pickle stream over 4 KiB (so it travels after the slot) next to out-of-band tensors
    obj = {"text": "x" * 5000 + str(comm.rank), "c": torch.full((20_000,), 1 + 2j, dtype=torch.complex128),
           "a": np.arange(9_000, dtype=np.complex128)}
    out = []
    for r, got in enumerate(comm.all_gather(obj)):
        if r == comm.rank:  # this rank's own entry is its own object, wherever numpy put it
            continue
        t = got["c"]
        out.append((t.data_ptr() % 64, bool(torch.where(t.real > 0, t, 0).abs().sum() > 0),
                    float(np.abs(got["a"]).sum()) + got["a"].ctypes.data % 64))
    return out


@pytest.mark.parametrize("world", ["gloo", "threaded"])
@pytest.mark.parametrize("mode", ["alltoall", "point_to_point"])
def test_received_buffers_are_64_byte_aligned(world: str, mode: str) -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        if mode == "alltoall":
            comm._alltoall_copy_bytes = 1 << 62  # type: ignore[attr-defined]
        else:
            comm._alltoall_max_bytes = -1  # type: ignore[attr-defined]
        return _aligned_results(comm)

    run = spawn if world == "gloo" else run_threaded
    want = float(np.abs(np.arange(9_000, dtype=np.complex128)).sum())
    for rows in run(fn, 3, timeout=120):
        assert rows == [(0, True, want)] * 2


def _build_with(kwargs_for: Any) -> Any:
    def fn(comm: distcomm.Communicator) -> Any:
        import torch.distributed as dist

        try:
            distcomm.GlooCommunicator(dist.group.WORLD, **kwargs_for(comm.rank)).close()
            return ("ok", "")
        except distcomm.CollectiveMismatchError as e:
            return ("mismatch", str(e))

    return fn


@pytest.mark.parametrize("setting", ["slot_bytes", "max_bytes"])
def test_ranks_with_different_settings_refuse_alike(setting: str) -> None:
    """Used to abort the process in gloo; now every rank raises the same error at construction."""
    values = {"slot_bytes": (4096, 8192), "max_bytes": (None, 1 << 20)}[setting]
    out = spawn(_build_with(lambda r: {setting: values[r % 2]}), 3, timeout=120)
    for name, msg in out:
        assert name == "mismatch", msg
        assert f"different {setting}" in msg and f"rank 1: {setting}={values[1]!r}" in msg
    assert len({msg for _, msg in out}) == 1


@pytest.mark.parametrize("bad", [math.inf, math.nan, -1.0])
def test_timeout_must_be_finite(bad: float) -> None:
    with pytest.raises(ValueError, match="finite"):
        distcomm.LocalCommunicator(timeout=bad)
    with pytest.raises(ValueError, match="finite"):
        FakeCommunicator(0, 2).all_gather(1, timeout=bad)


class _Interrupts:
    def __reduce__(self) -> Any:
        raise KeyboardInterrupt


def _interrupted_while_pickling(comm: distcomm.Communicator) -> Any:
    if comm.rank == 0:
        try:
            comm.all_gather(_Interrupts())
        except KeyboardInterrupt:
            pass
        # this rank never joined that call: its next call meets the peer's first one
        return comm.all_gather("again"), comm.all_gather(10)
    return comm.all_gather("first"), comm.all_gather(11)


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_interrupt_while_pickling_leaves_the_rank_in_step(world: str) -> None:
    run = spawn if world == "gloo" else run_threaded
    out = run(_interrupted_while_pickling, 2, timeout=120)
    assert out == [(["again", "first"], [10, 11])] * 2


def _long_failure_in_a_large_world(comm: distcomm.Communicator) -> Any:
    obj = threading.Lock() if comm.rank == 5 else "fine"
    first = outcome(lambda: comm.all_gather(obj))
    mism = outcome(lambda: comm.gather(1, dst=0 if comm.rank else 1))
    return first[:3], mism[:3], comm.all_gather(comm.rank)


@pytest.mark.parametrize("world", [pytest.param("gloo", marks=pytest.mark.slow), "threaded"])
def test_errors_are_whole_and_alike_in_a_large_world(world: str) -> None:
    """Beyond small worlds the slot holds a header only: failure messages follow it, on every rank."""
    run = spawn if world == "gloo" else run_threaded
    out = run(_long_failure_in_a_large_world, 8, timeout=180)
    for first, mism, after in out:
        assert first[0] == "SerializationError" and first[2] == (5,)
        assert "rank 5: TypeError: cannot pickle '_thread.lock' object" in first[1], first[1]
        assert mism[0] == "CollectiveMismatchError" and "rank 0: gather root=1" in mism[1]
        assert after == list(range(8))
    assert len({first[1] for first, _, _ in out}) == 1


class _Forger(FakeCommunicator):
    """Rank 1 of 2 announces a segment of 2**60 bytes: more than any machine's memory."""

    def _peer_slot(self, r: int, size: int) -> bytearray:
        op, root = self._call.op, self._call.root  # type: ignore[union-attr]
        slot = bytearray(size)
        _frame.HEADER.pack_into(slot, 0, _frame.MAGIC, _frame.VERSION, _frame.OK, op, 0, self._seq, root,
                                1, 1, 0, 1 << 60)
        struct.pack_into("<Iq", slot, _frame.HEADER_SIZE, 1, 1 << 60)
        return slot


class _HugeForger(FakeCommunicator):
    """Rank 3 of 8 announces one segment of 2**63 - 1 bytes: beyond 4 ranks, where small gathers go
    up a tree sized from the slots' totals (a sum that such a total would wrap)."""

    def _peer_slot(self, r: int, size: int) -> bytearray:
        if r != 3:
            return super()._peer_slot(r, size)
        op, root = self._call.op, self._call.root  # type: ignore[union-attr]
        super()._peer_slot(r, size)  # the fake's bookkeeping for that peer
        slot = bytearray(size)
        _frame.HEADER.pack_into(slot, 0, _frame.MAGIC, _frame.VERSION, _frame.OK, op, 0, self._seq, root,
                                1, 1, 0, 2**63 - 1)
        struct.pack_into("<Iq", slot, _frame.HEADER_SIZE, 1, 2**63 - 1)
        return slot


def test_a_forged_total_cant_wrap_the_tree_gathers_sizes() -> None:
    comm = _HugeForger(0, 8)
    with pytest.raises(distcomm.PayloadTooLargeError, match="more than this machine's memory"):
        comm.gather("x", dst=0)


def test_absurd_announced_size_is_refused_before_allocating() -> None:
    comm = _Forger(0, 2)
    with pytest.raises(distcomm.PayloadTooLargeError, match="more than this machine's memory"):
        comm.all_gather("x")
    assert "broken" in repr(comm)  # only this rank could tell: its peers are already past the slots
    capped = _Forger(0, 2, max_bytes=1 << 20)  # a shared limit: refused alike, and still usable
    with pytest.raises(distcomm.PayloadTooLargeError, match="over max_bytes"):
        capped.all_gather("x")
    assert "open" in repr(capped)


class _ScatterForger(FakeCommunicator):
    """Scatter's root (rank 1 of 8) announces a slot of 2**40 bytes for each rank's part."""

    def _peer_slot(self, r: int, size: int) -> bytearray:
        op, root = self._call.op, self._call.root  # type: ignore[union-attr]
        if r != root:
            return super()._peer_slot(r, size)
        return _frame.encode_later(op, self._seq, root, 0, 1 << 40, size)


def test_a_scatter_roots_announced_slot_is_bounded_by_slot_bytes() -> None:
    comm = _ScatterForger(0, 8, peers=lambda op, r, obj: list(range(8)))
    with pytest.raises(distcomm.FrameError, match=r"rank 1 announced a slot of 1099511627776 bytes .* at most 4096"):
        comm.scatter(None, src=1)


class _Overrun(FakeCommunicator):
    """Peers announce an inline segment longer than their slot: a table only a receiver decodes."""

    def _peer_slot(self, r: int, size: int) -> bytearray:
        op, root = self._call.op, self._call.root  # type: ignore[union-attr]
        slot = bytearray(size)
        _frame.HEADER.pack_into(slot, 0, _frame.MAGIC, _frame.VERSION, _frame.OK, op, 0, self._seq, root,
                                1, 1, 0, 100)
        struct.pack_into("<Iq", slot, _frame.HEADER_SIZE, 1, -(100 + 1))
        return slot


def test_failure_only_this_rank_sees_after_the_slots_marks_the_communicator_broken() -> None:
    comm = _Overrun(0, 8)  # beyond 4 ranks only gather's root decodes its peers' tables
    with pytest.raises(distcomm.FrameError, match="runs past the end"):
        comm.gather("x", dst=0)
    assert "broken" in repr(comm)
    with pytest.raises(distcomm.CommunicatorStateError, match="while moving data"):
        comm.gather("x", dst=0)


# ---------------------------------------------------------------- one collective at a time (items 5, 6)
def two_threads(comm: distcomm.Communicator) -> Any:
    """Rank 0's helper thread calls while its first collective waits for a late rank 1."""
    import time

    if comm.rank == 1:
        time.sleep(1.0)
        return outcome(lambda: comm.all_gather("main")), None, outcome(lambda: comm.all_gather(comm.rank))[:2]
    box: list[Any] = []
    waiting = threading.Thread(target=lambda: box.append(outcome(lambda: comm.all_gather("main"))))
    waiting.start()
    time.sleep(0.3)  # the helper thread is inside all_gather now, waiting for rank 1
    second = outcome(lambda: comm.all_gather("helper"))
    waiting.join(30)
    return box[0], second, outcome(lambda: comm.all_gather(comm.rank))[:2]


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_a_second_thread_is_refused_while_a_collective_runs(world: str) -> None:
    run = spawn if world == "gloo" else run_threaded
    (first, second, after0), (other, none, after1) = run(two_threads, 2, timeout=60)
    assert first[:2] == ("ok", ["main", "main"]) and other[:2] == ("ok", ["main", "main"])
    assert second[0] == "CommunicatorStateError" and "from two threads at once" in second[1]
    # from then on rank 0 fails every collective, and rank 1 learns it in the same call
    assert none is None and after0 == after1 and after0[0] == "CollectiveError"
    assert "rank 0 was used from two threads at once" in after0[1]


class _CallsBack:
    """An object whose unpickling starts a collective on the communicator that is loading it."""

    def __reduce__(self) -> Any:
        return (_call_back, ())


def _call_back() -> Any:
    return distcomm.current().all_gather("nested")


@pytest.mark.parametrize("world", ["gloo", "threaded"])
def test_a_collective_from_setstate_is_refused_clearly(world: str) -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        return outcome(lambda: comm.all_gather(_CallsBack())), comm.all_gather(comm.rank)

    run = spawn if world == "gloo" else run_threaded
    for (kind, text, _, _), after in run(fn, 2, timeout=60):
        assert kind == "SerializationError" and "while another of its collectives runs in the same thread" in text
        assert after == [0, 1]


# ---------------------------------------------------------------- the default communicator in every thread (13)
def helper_thread_sees_the_job_communicator(comm: distcomm.Communicator) -> Any:
    from distcomm import _defaults

    seen: list[Any] = []
    t = threading.Thread(target=lambda: seen.append((distcomm.current() is comm, distcomm.get_local_rank(),
                                                     distcomm.get_rank())))
    t.start()
    t.join(10)
    _defaults.set_default(None)  # as if no default: a helper thread must not adopt the group itself
    refused: list[Any] = []

    def adopt() -> None:
        try:
            distcomm.current()
            refused.append("adopted")
        except distcomm.CommunicatorStateError as e:
            refused.append(str(e))

    t = threading.Thread(target=adopt)
    t.start()
    t.join(10)
    _defaults.set_default(comm)
    return seen[0], refused[0], comm.all_gather(comm.rank)


def test_helper_threads_see_the_process_default() -> None:
    for r, (seen, refused, after) in enumerate(spawn(helper_thread_sees_the_job_communicator, 2, timeout=60)):
        assert seen == (True, r, r)
        assert "from a thread other than the main thread" in refused
        assert after == [0, 1]


# ---------------------------------------------------------------- doubles that fail as the real thing (14-17)
def late_rank(comm: distcomm.Communicator) -> Any:
    import time

    if comm.rank == 1:
        time.sleep(1.5)  # arrives after rank 0 gave up
    return outcome(lambda: comm.all_gather(comm.rank, timeout=0.5))


# gloo: a fresh world, the last one broken
@pytest.mark.parametrize("world", [pytest.param("gloo", marks=pytest.mark.slow), "threaded"])
def test_a_late_rank_fails_after_its_peer_gave_up(world: str) -> None:
    run = spawn if world == "gloo" else run_threaded
    early, late = run(late_rank, 2, timeout=60)
    assert early[0] == "CollectiveTimeoutError"
    assert late[0] in ("CollectiveTimeoutError", "PeerError"), late  # never a stale result


def test_world_of_one_fails_as_larger_worlds_do() -> None:
    lock = threading.Lock()
    for n in (1, 2):
        with pytest.raises(distcomm.SerializationError):  # the fake serializes at every world size
            FakeCommunicator(0, n).all_gather(lock)
        for comm in (FakeCommunicator(0, n), distcomm.LocalCommunicator()):
            if comm.world_size != n:
                continue
            with pytest.raises(distcomm.CollectiveError, match="not a tensor or a number"):
                comm.reduce_dict({"loss": "1.5"})
            with pytest.raises(distcomm.CollectiveError, match="objects for world_size"):
                comm.scatter([1] * (n + 1))
    assert distcomm.LocalCommunicator().all_gather(lock) == [lock]  # Local stays copy-free


def test_run_threaded_reports_a_failure_whose_traceback_is_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    import time
    import traceback as tb

    from distcomm.testing import _threaded

    slow = tb.format_exc

    def format_exc() -> str:
        time.sleep(1.5)  # the main thread must not read the error before its traceback
        return slow()

    monkeypatch.setattr(_threaded.traceback, "format_exc", format_exc)

    def fn(comm: distcomm.Communicator) -> None:
        if comm.rank == 1:
            raise ValueError("boom")
        comm.synchronize()

    with pytest.raises(distcomm.testing.RankFailedError, match="rank 1 raised ValueError: boom") as info:
        run_threaded(fn, 2, timeout=5.0)  # the main thread gives busy ranks 1 s once it sees an error
    assert "ValueError: boom" in info.value.remote_traceback


# ---------------------------------------------------------------- launch and spawn errors (11, 12)
class _TwoArgs(Exception):
    def __init__(self, a: int, b: int) -> None:
        super().__init__(f"{a} and {b}")


@pytest.mark.slow
def test_spawn_reports_an_exception_that_cannot_come_back() -> None:
    def fn(comm: distcomm.Communicator) -> None:
        if comm.rank == 1:
            raise _TwoArgs(1, 2)
        comm.synchronize()

    with pytest.raises(distcomm.testing.RankFailedError, match="rank 1") as info:
        spawn(fn, 2, timeout=60)
    assert "_TwoArgs: 1 and 2" in info.value.remote_traceback


@pytest.mark.slow
def test_launch_names_the_failed_rank_and_the_missing_main_guard(tmp_path: Any) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    failing = tmp_path / "failing.py"
    failing.write_text(
        "import distcomm\n"
        "def main():\n"
        "    if distcomm.get_rank() == 1:\n"
        "        raise KeyError('missing shard')\n"
        "if __name__ == '__main__':\n"
        "    try:\n"
        "        distcomm.launch(main, 2, timeout=30)\n"
        "    except distcomm.RankFailedError as e:\n"
        "        print('RANK', e.rank, 'TRACEBACK' if 'missing shard' in e.remote_traceback else '')\n")
    out = subprocess.run([sys.executable, str(failing)], capture_output=True, text=True, timeout=120, env=env)
    assert "RANK 1 TRACEBACK" in out.stdout, out.stderr[-2000:]
    unguarded = tmp_path / "unguarded.py"
    unguarded.write_text("import distcomm\ndistcomm.launch(print, 2, timeout=30)\n")
    out = subprocess.run([sys.executable, str(unguarded)], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0
    assert 'put the call under `if __name__ == "__main__":`' in out.stderr


# ---------------------------------------------------------------- process resources don't travel (20)
# gloo: a fresh world, the last one broken
@pytest.mark.parametrize("world", [pytest.param("gloo", marks=pytest.mark.slow), "threaded"])
def test_open_files_are_refused_like_any_unpicklable_value(world: str) -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        with open(__file__) as f:
            return outcome(lambda: comm.all_gather({"log": f} if comm.rank == 1 else None)), comm.all_gather(1)

    run = spawn if world == "gloo" else run_threaded
    for (kind, text, ranks, _), after in run(fn, 2, timeout=60):
        assert kind == "SerializationError" and tuple(ranks) == (1,) and "_io.TextIOWrapper" in text, text
        assert after == [1, 1]


def test_fake_peers_reduce_dict_values_are_checked_as_a_real_peer_checks_its_own() -> None:
    """A scripted peer whose dict holds text fails the call on the rank under test with the
    error a real peer would report (as over gloo: CollectiveError naming that rank)."""
    def peers(op: str, r: int, obj: Any) -> Any:
        return {"loss": "3.0"} if r == 2 else obj

    comm = FakeCommunicator(rank=0, world_size=3, peers=peers)
    with pytest.raises(distcomm.CollectiveError, match="rank 2: value of 'loss' is a str, not a tensor") as info:
        comm.all_reduce_dict({"loss": torch.tensor(1.0)})
    assert info.value.ranks == (2,)


def _oversized_peer_zero(comm: distcomm.Communicator) -> list[tuple[str, tuple[int, ...], str]]:
    """Rank 0's payloads are over max_bytes in a scatter and an all_to_all: what every rank raises."""
    big = [np.zeros(4000, dtype=np.uint8) for _ in range(comm.world_size)]
    small = [b"x" for _ in range(comm.world_size)]
    out = []
    for call in (lambda: comm.scatter(big if comm.rank == 0 else None, src=0),
                 lambda: comm.all_to_all(big if comm.rank == 0 else small)):
        try:
            call()
            out.append(("returned", (), ""))
        except distcomm.CollectiveError as e:
            out.append((type(e).__name__, tuple(e.ranks), str(e).split("\n")[1].strip()))
    return out


def test_fake_peers_are_held_to_max_bytes_as_real_ranks() -> None:
    """A scripted peer whose scatter or all_to_all payload is over max_bytes fails the call on the
    rank under test exactly as a real rank over it fails every rank."""
    real = run_threaded(_oversized_peer_zero, 3, timeout=60, max_bytes=3000)
    assert real[1] == real[2] == real[0]
    assert [r[:2] for r in real[1]] == [("PayloadTooLargeError", (0,))] * 2
    big = [np.zeros(4000, dtype=np.uint8) for _ in range(3)]
    fake = FakeCommunicator(1, 3, max_bytes=3000,
                            peers=lambda op, r, obj: big if r == 0 else [b"x"] * 3 if op == "all_to_all" else obj)
    assert _oversized_peer_zero(fake) == real[1]


def _bad_all_to_all(comm: distcomm.Communicator) -> list[tuple[str, tuple[int, ...], str]]:
    """Rank 0 gives all_to_all an object that can't be pickled, then a list of the wrong length."""
    out = []
    for bad in ([1, threading.Lock(), 3], [1, 2]):
        try:
            comm.all_to_all(bad if comm.rank == 0 else [1, 2, 3])
            out.append(("returned", (), ""))
        except distcomm.CollectiveError as e:
            out.append((type(e).__name__, tuple(e.ranks), str(e).split("\n", 1)[1]))
    return out


def test_fake_all_to_all_peers_fail_with_a_real_ranks_message() -> None:
    ser = distcomm.PickleSerializer(cloudpickle_fallback=False)
    real = run_threaded(_bad_all_to_all, 3, timeout=60, serializer=ser)
    assert real[0] == real[1] == real[2]
    assert "(at objs[1], a _thread.lock)" in real[1][0][2] and "got 2 objects for world_size 3" in real[1][1][2]
    rank0 = iter([[1, threading.Lock(), 3], [1, 2]])  # scripted rank 0: one list per call
    fake = FakeCommunicator(1, 3, serializer=ser, peers=lambda op, r, obj: next(rank0) if r == 0 else obj)
    assert _bad_all_to_all(fake) == real[1]


def test_max_bytes_caps_payloads_not_the_checks_own_words() -> None:
    """A tiny max_bytes refuses objects, not the 8-byte words that checked tensor collectives and
    reduce_dict carry in their slots."""
    def fn(comm: distcomm.Communicator) -> tuple[float, float, str]:
        x = comm.all_reduce(torch.ones(2))
        d = comm.reduce_dict({"a": torch.tensor(1.0)}, average=False)
        comm.synchronize()
        try:
            comm.all_gather(1)
            outcome = "returned"
        except distcomm.PayloadTooLargeError:
            outcome = "refused"
        return float(x.sum()), float(d["a"]) if comm.rank == 0 else 0.0, outcome

    assert run_threaded(fn, 2, timeout=60, max_bytes=4) == [(4.0, 2.0, "refused"), (4.0, 0.0, "refused")]


@pytest.mark.parametrize("arrays", [0, 1, 3])  # a lone pickle stream; stream and one buffer; packed (3 don't fit)
def test_small_broadcast_beyond_small_worlds_lands_aligned(arrays: int) -> None:
    """A broadcast in a world over 4 ranks whose bytes after the 64-byte slot fit one buffer: a
    lone pickle stream is received into a bytearray, out-of-band buffers (one, or several packed
    into one segment) into torch's aligned memory, each starting at a multiple of 64 bytes."""
    def fn(comm: distcomm.Communicator) -> Any:
        obj = {"text": "y" * 300, **{f"a{i}": np.arange(40 + i, dtype=np.float64) * (i + 1) for i in range(arrays)}}
        got = comm.broadcast(obj if comm.rank == 2 else None, src=2)
        return got["text"], [(float(got[f"a{i}"].sum()), got[f"a{i}"].ctypes.data % 64) for i in range(arrays)]

    want = [(float(np.arange(40 + i).sum() * (i + 1)), 0) for i in range(arrays)]
    for rank, (text, rows) in enumerate(run_threaded(fn, 6, timeout=60,
                                                     serializer=distcomm.PickleSerializer(oob_threshold=64))):
        assert text == "y" * 300
        assert rows == (want if rank != 2 else [(w, rows[i][1]) for i, (w, _) in enumerate(want)])
