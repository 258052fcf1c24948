"""Fault injection: every failure raises a clear error on every rank, fast, and never hangs.

Scenarios that leave the communicator usable run over real gloo processes and in the threaded
world; each checks the next collective still works. Timeouts and dead peers run over gloo only.
"""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm._wire import frame as _frame
from distcomm.testing import RankFailedError, run_threaded, spawn


def outcome(fn: Any) -> Any:
    """Run fn(); return ("ok", value) or (error type name, message, ranks) plus the elapsed seconds."""
    t0 = time.monotonic()
    try:
        value = fn()
        return ("ok", value, (), time.monotonic() - t0)
    except distcomm.CollectiveError as e:
        return (type(e).__name__, str(e), e.ranks, time.monotonic() - t0)
    except distcomm.DistCommError as e:
        return (type(e).__name__, str(e), (), time.monotonic() - t0)


def unpicklable(comm: distcomm.Communicator) -> Any:
    obj = threading.Lock() if comm.rank == 1 else "fine"
    return outcome(lambda: comm.all_gather(obj)), comm.all_gather(comm.rank)


def mismatched_ops(comm: distcomm.Communicator) -> Any:
    first = outcome(lambda: comm.all_gather(1) if comm.rank == 0 else comm.broadcast(1, src=0))
    second = outcome(lambda: comm.gather(1, dst=0 if comm.rank == 0 else 1))
    return first, second, comm.all_gather(comm.rank)


def key_mismatch(comm: distcomm.Communicator) -> Any:
    d = {"loss": torch.tensor(1.0), ("a" if comm.rank == 0 else "b"): torch.tensor(2.0)}
    return outcome(lambda: comm.reduce_dict(d)), comm.all_gather(comm.rank)


def mixed_dtypes(comm: distcomm.Communicator) -> Any:
    d = {"loss": torch.tensor(1.5, dtype=torch.float32 if comm.rank == 0 else torch.float64),
         "n": torch.tensor(comm.rank + 1)}
    ok = comm.all_reduce_dict(d, average=False)
    c = {"z": torch.tensor(1 + 1j) if comm.rank == 1 else torch.tensor(1.0)}
    return ({k: (float(v), str(v.dtype)) for k, v in ok.items()}, outcome(lambda: comm.all_reduce_dict(c)),
            comm.all_gather(comm.rank))


def bad_value(comm: distcomm.Communicator) -> Any:
    d = {"loss": "3.0" if comm.rank == 1 else torch.tensor(1.0)}  # numbers are fine; text isn't
    return outcome(lambda: comm.all_reduce_dict(d)), comm.all_gather(comm.rank)


def wrong_scatter_length(comm: distcomm.Communicator) -> Any:
    return outcome(lambda: comm.scatter(["only one"] if comm.rank == 0 else None)), comm.all_gather(comm.rank)


def too_large(comm: distcomm.Communicator) -> Any:
    obj = np.zeros(2_000_000, dtype=np.uint8) if comm.rank == 1 else "small"
    return outcome(lambda: comm.all_gather(obj)), comm.all_gather(comm.rank)


class Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def malicious(path: str) -> Any:
    def fn(comm: distcomm.Communicator) -> Any:
        obj = Evil(path) if comm.rank == 1 else {"fine": np.arange(3)}
        # return only the count: the test harness itself must not unpickle the payload
        return outcome(lambda: len(comm.all_gather(obj))), comm.all_gather(comm.rank)

    return fn


WORLDS = ["gloo", "threaded"]


def run(world: str, fn: Any, n: int, **kwargs: Any) -> list[Any]:
    if world == "gloo":
        return spawn(fn, n, timeout=120, **kwargs)
    return run_threaded(fn, n, timeout=60, **kwargs)


@pytest.mark.parametrize("world", WORLDS)
def test_unpicklable_object_on_one_rank(world: str) -> None:
    for r, (err, after) in enumerate(run(world, unpicklable, 3)):
        name, msg, ranks, elapsed = err
        assert name == "SerializationError", (r, err)
        assert ranks == (1,) and "rank 1" in msg and "lock" in msg, msg
        assert elapsed < 10
        assert after == [0, 1, 2]


@pytest.mark.parametrize("world", WORLDS)
def test_mismatched_collectives(world: str) -> None:
    for r, (first, second, after) in enumerate(run(world, mismatched_ops, 2)):
        assert first[0] == "CollectiveMismatchError", (r, first)
        assert "rank 0: all_gather" in first[1] and "rank 1: broadcast root=0" in first[1]
        assert second[0] == "CollectiveMismatchError", (r, second)
        assert "rank 0: gather root=0" in second[1] and "rank 1: gather root=1" in second[1]
        assert after == [0, 1]


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_dict_key_mismatch(world: str) -> None:
    for err, after in run(world, key_mismatch, 2):
        assert err[0] == "CollectiveMismatchError", err
        assert "rank 0 lacks 'b'" in err[1] and "rank 1 lacks 'a'" in err[1], err[1]
        assert after == [0, 1]


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_dict_dtypes_that_differ_across_ranks(world: str) -> None:
    for r, (ok, err, after) in enumerate(run(world, mixed_dtypes, 2)):
        want_loss = "torch.float32" if r == 0 else "torch.float64"
        assert ok == {"loss": (3.0, want_loss), "n": (3.0, "torch.int64")}, ok
        assert err[0] == "CollectiveMismatchError" and "rank 1: complex values" in err[1], err
        assert "rank 0: floating point values" in err[1], err
        assert after == [0, 1]


@pytest.mark.parametrize("world", WORLDS)
def test_reduce_dict_value_not_a_tensor(world: str) -> None:
    for err, after in run(world, bad_value, 2):
        assert err[0] == "CollectiveError" and err[2] == (1,), err
        assert "value of 'loss' is a str, not a tensor or a number" in err[1]
        assert after == [0, 1]


@pytest.mark.parametrize("world", WORLDS)
def test_wrong_scatter_length(world: str) -> None:
    for err, after in run(world, wrong_scatter_length, 2):
        assert err[0] == "CollectiveError" and err[2] == (0,), err
        assert "got 1 objects for world_size 2" in err[1]
        assert after == [0, 1]


def scatter_failures(comm: distcomm.Communicator) -> Any:
    """Scatters in a small world, whose root sends each rank its part in the first exchange: a
    part that can't be pickled, one over max_bytes, a rank in another collective."""
    r = comm.rank
    unpicklable = [threading.Lock() if i == 2 else i for i in range(3)]
    large = ["x" * (2_000_000 if i == 1 else 10) for i in range(3)]
    return (outcome(lambda: comm.scatter(unpicklable if r == 0 else None)),
            outcome(lambda: comm.scatter(large if r == 0 else None)),
            outcome(lambda: comm.broadcast(r) if r == 2 else comm.scatter([0, 1, 2] if r == 0 else None)),
            comm.scatter([f"part {i}" for i in range(3)] if r == 1 else None, src=1))


def _packed_parts() -> list[Any]:
    # part 1's 30 out-of-band arrays don't fit a 256-byte slot's table: it travels packed
    return [np.arange(3), [np.full(65_540, i, dtype=np.uint8) for i in range(30)], "small"]


def packed_part_over_max_bytes(comm: distcomm.Communicator) -> Any:
    parts = _packed_parts()
    return outcome(lambda: comm.scatter(parts if comm.rank == 0 else None)), comm.all_gather(comm.rank)


# gloo: a fresh world, the last one broken
@pytest.mark.parametrize("world", [pytest.param("gloo", marks=pytest.mark.slow), "threaded"])
def test_scatter_part_over_max_bytes_as_it_travels(world: str) -> None:
    """A part over max_bytes only as it travels (packed), though all the parts' segments add up to
    under it: the root refuses it, and every rank raises the same error (its receiver checks
    what it receives against max_bytes)."""
    dumps = distcomm.PickleSerializer().dumps
    segments = [dumps(p) for p in _packed_parts()]
    total = sum(s.nbytes for segs in segments for s in segs)
    packed = _frame.packed_size(segments[1])
    assert total < packed
    limit = (total + packed) // 2
    results = run(world, packed_part_over_max_bytes, 3, slot_bytes=256, max_bytes=limit)
    assert len({(err[0], str(err[1]), err[2]) for err, _ in results}) == 1, [err[0] for err, _ in results]
    for r, (err, after) in enumerate(results):
        assert err[0] == "PayloadTooLargeError" and err[2] == (0,) and "as it travels" in err[1], (r, err)
        assert after == [0, 1, 2]


# gloo: a fresh world, the last one broken
@pytest.mark.parametrize("world", [pytest.param("gloo", marks=pytest.mark.slow), "threaded"])
def test_scatter_failures_in_a_small_world(world: str) -> None:
    results = run(world, scatter_failures, 3, max_bytes=1_000_000)
    for k in range(3):  # the same error on every rank, word for word
        assert len({got[k][:3] for got in results}) == 1, [got[k] for got in results]
    for r, (unpicklable, large, mismatch, after) in enumerate(results):
        assert unpicklable[0] == "SerializationError" and unpicklable[2] == (0,) and "lock" in unpicklable[1], r
        assert large[0] == "PayloadTooLargeError" and large[2] == (0,) and "over max_bytes" in large[1], r
        assert mismatch[0] == "CollectiveMismatchError" and "rank 2: broadcast" in mismatch[1], r
        assert after == f"part {r}"


# gloo: a fresh world, the last one broken
@pytest.mark.parametrize("world", [pytest.param("gloo", marks=pytest.mark.slow), "threaded"])
def test_payload_over_max_bytes(world: str) -> None:
    for err, after in run(world, too_large, 2, max_bytes=1_000_000):
        assert err[0] == "PayloadTooLargeError" and err[2] == (1,), err
        assert "over max_bytes=1000000" in err[1]
        assert after == [0, 1]


# gloo: a fresh world, the last one broken
@pytest.mark.parametrize("world", [pytest.param("gloo", marks=pytest.mark.slow), "threaded"])
def test_malicious_pickle_under_safe_serializer(world: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    out = run(world, malicious(str(marker)), 3, serializer=distcomm.SafeSerializer())
    for r, (err, after) in enumerate(out):
        if r == 1:  # the sender's own entry is its own object: nothing to load
            assert err[0] == "ok"
        else:
            assert err[0] == "UnsafePayloadError", (r, err)
            assert "posix.system" in err[1] and "rank 1" in err[1]
        assert after == [0, 1, 2]
    assert not marker.exists(), "the payload ran code"


def late(comm: distcomm.Communicator) -> Any:
    if comm.rank == 1:
        time.sleep(4)
    return outcome(lambda: comm.all_gather(comm.rank, timeout=2))


@pytest.mark.slow
def test_peer_that_sleeps_past_the_timeout() -> None:
    early, late_one = spawn(late, 2, timeout=120, reuse=False)  # a fresh job: timings and the store as a job meets them
    assert early[0] == "CollectiveTimeoutError", early
    assert early[2] == (1,) and "rank 1 never reported" in early[1], early
    assert 1.9 < early[3] < 6, early
    assert late_one[0] in ("CollectiveTimeoutError", "PeerError"), late_one
    assert late_one[3] < 5, late_one


def late_sync(comm: distcomm.Communicator) -> Any:
    if comm.rank == 2:
        time.sleep(3)
    first = outcome(lambda: comm.synchronize(timeout=1.5))
    return first, outcome(lambda: comm.all_gather(1))


@pytest.mark.slow
def test_synchronize_timeout_names_the_missing_rank_and_breaks_the_communicator() -> None:
    out = spawn(late_sync, 3, timeout=120, reuse=False)  # a fresh job: timings and the store as a job meets them
    for r in (0, 1):
        first, after = out[r]
        assert first[0] == "CollectiveTimeoutError" and 2 in first[2], first
        assert first[3] < 6
        assert after[0] == "CommunicatorStateError" and "earlier transport failure" in after[1], after


def dies(comm: distcomm.Communicator, victim: int = 1) -> Any:
    comm.all_gather(0)
    if comm.rank == victim:
        os._exit(3)
    return outcome(lambda: comm.all_gather(np.zeros(10)))


@pytest.mark.slow
def test_peer_that_exits_mid_job() -> None:
    t0 = time.monotonic()
    survivor, dead = spawn(dies, 2, timeout=120, return_exceptions=True, reuse=False)  # a fresh job
    assert isinstance(dead, RankFailedError) and "exited with code 3" in str(dead)
    assert survivor[0] == "PeerError", survivor
    assert survivor[2] == (1,) and "rank 1" in survivor[1]
    assert survivor[3] < 10, survivor  # noticed by the transport, not by the 600 s timeout
    assert time.monotonic() - t0 < 60


@pytest.mark.slow
def test_survivors_name_a_dead_rank_0() -> None:
    """Rank 0 hosts the store that names missing ranks; when it dies, the survivors still name it."""
    dead, *survivors = spawn(functools.partial(dies, victim=0), 3, timeout=120, return_exceptions=True,
                             reuse=False)
    assert isinstance(dead, RankFailedError) and "exited with code 3" in str(dead)
    for survivor in survivors:
        assert survivor[0] == "PeerError", survivor
        assert survivor[2] == (0,) and "rank 0, which hosts the job's store, is unreachable" in survivor[1], survivor
        assert survivor[3] < 30, survivor  # not the 600 s timeout


@pytest.mark.slow
def test_ranks_whose_own_connections_saw_no_loss_learn_it_from_the_store() -> None:
    """Beyond 4 ranks most survivors wait on a peer that is alive (the one that saw the loss, now
    reporting it), so their transport says nothing. The rank that saw it writes so in the job's
    store, and the others read it at their next one-second look: a PeerError naming rank 3, not the
    liveness check's (5 s after the death) nor the timeout's."""
    out = spawn(functools.partial(dies, victim=3), 6, timeout=120, return_exceptions=True, reuse=False)
    assert isinstance(out[3], RankFailedError) and "exited with code 3" in str(out[3])
    survivors = out[:3] + out[4:]
    for survivor in survivors:
        assert survivor[0] == "PeerError" and survivor[2] == (3,), survivor
        assert "on this machine exited" not in survivor[1], survivor  # (the liveness check's words)
    assert any("another rank lost a peer in this call" in s[1] for s in survivors), survivors


def dies_leaving_a_fork(comm: distcomm.Communicator) -> Any:
    comm.all_gather(0)
    if comm.rank == 1:
        if os.fork() == 0:  # like a data loader's worker: it holds rank 1's connections open
            time.sleep(20)
            os._exit(0)
        os._exit(3)
    return outcome(lambda: comm.all_gather(0, timeout=60))


@pytest.mark.slow
def test_a_dead_peer_whose_fork_holds_its_connections_is_noticed_in_seconds() -> None:
    """The transport sees no closed connection (the fork holds it); the rank waiting checks that its
    peers' processes exist between one-second slices, where it used to wait for the whole timeout."""
    survivor, dead = spawn(dies_leaving_a_fork, 2, timeout=120, return_exceptions=True, reuse=False)
    assert isinstance(dead, RankFailedError)
    assert survivor[0] == "PeerError" and survivor[2] == (1,), survivor
    assert "rank 1 (pid" in survivor[1] and "exited" in survivor[1], survivor
    assert survivor[3] < 20, survivor  # about 6 s (the liveness grace, 5 s); the timeout is 60 s


def one_peer_finishes_and_exits(comm: distcomm.Communicator) -> Any:
    if comm.rank == 2:  # a slow link: rank 2's transfer starts 3 s late
        exchange = comm._exchange  # type: ignore[attr-defined]

        def slow(*args: Any, **kwargs: Any) -> Any:
            time.sleep(3)
            return exchange(*args, **kwargs)

        comm._exchange = slow  # type: ignore[attr-defined]
    got = outcome(lambda: comm.gather(np.full(4 << 20, comm.rank, dtype=np.uint8), dst=0, timeout=60))
    if comm.rank == 1:
        os._exit(0)  # done with its part: the end of the job for it
    return got[0], [int(a[0]) for a in got[1]] if got[0] == "ok" else got[1]


@pytest.mark.slow
def test_a_peer_that_did_its_part_and_exited_is_no_failure() -> None:
    """Rank 0 still waits for rank 2 when rank 1, done, exits: the liveness check fails a wait only
    for a peer it still needs, so rank 0 gets every part."""
    out = spawn(one_peer_finishes_and_exits, 3, timeout=120, return_exceptions=True, reuse=False)
    assert out[0] == ("ok", [0, 1, 2]), out
    assert out[2][0] == "ok", out


def interrupted(path: str, how: str) -> Any:
    def fn(comm: distcomm.Communicator) -> Any:
        if how == "two levels":  # the header exchange over blocks, as on hosts of one rank each
            comm._set_header_blocks([[0, 1, 2], [3, 4, 5]], None)  # type: ignore[attr-defined]
        if comm.rank == comm.world_size - 1:
            time.sleep(8)  # never takes part in the call below
            return None
        if comm.rank != 0:  # the others wait with rank 0 (in the header exchange)
            return outcome(lambda: comm.all_gather(0, timeout=60))[0]
        # Ctrl-C as a terminal delivers it, even when pytest runs as a shell's background job (which
        # starts its processes with SIGINT ignored)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        try:
            if how in ("collective", "two levels"):
                comm.all_gather(0, timeout=60)
            else:  # a large point-to-point receive that its sender never starts
                buf = torch.empty(4 << 20, dtype=torch.uint8)
                comm._exchange([], [(1, buf)], 60)  # type: ignore[attr-defined]
        except KeyboardInterrupt:
            return time.time(), outcome(lambda: comm.all_gather(1))
        return "no interrupt"

    return fn


@pytest.mark.slow
@pytest.mark.parametrize("how,world", [("collective", 2), ("point-to-point", 2), ("collective", 6), ("two levels", 6)])
def test_ctrl_c_while_waiting_for_a_peer_raises_within_about_a_second(how: str, world: int, tmp_path: Path) -> None:
    """Waits in gloo collectives are sliced (the header exchange in one block or in two levels: 6
    ranks here); point-to-point steps (large transfers) are run by a helper thread while the
    caller watches."""
    import signal
    import threading

    pid_file = tmp_path / "pid"
    sent: list[float] = []

    def interrupt() -> None:
        deadline = time.monotonic() + 60
        while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.5)  # rank 0 is waiting now
        sent.append(time.time())
        os.kill(int(pid_file.read_text()), signal.SIGINT)

    thread = threading.Thread(target=interrupt)
    thread.start()
    out = spawn(interrupted(str(pid_file), how), world, timeout=120, reuse=False)
    thread.join()
    caught, after = out[0]
    assert caught - sent[0] < 3.0, caught - sent[0]  # within a slice (1 s), plus a loaded machine's slack
    assert after[0] == "CommunicatorStateError" and "interrupted (KeyboardInterrupt)" in after[1], after


def test_run_threaded_releases_everyone_when_a_rank_raises() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        if comm.rank == 2:
            raise KeyError("bad shard")
        return comm.all_gather(comm.rank)

    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 2 raised KeyError") as info:
        run_threaded(fn, 4, timeout=30)
    assert time.monotonic() - t0 < 5
    assert info.value.rank == 2 and isinstance(info.value.exception, KeyError)
    assert set(info.value.errors) == {0, 1, 2, 3}


def test_run_threaded_names_the_rank_that_never_arrives() -> None:
    gate = threading.Event()

    def fn(comm: distcomm.Communicator) -> Any:
        if comm.rank == 1:
            gate.wait(10)
            return None
        return comm.all_gather(comm.rank, timeout=1)

    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_threaded(fn, 3, timeout=30)
    gate.set()
    assert time.monotonic() - t0 < 5
    assert isinstance(info.value.exception, distcomm.CollectiveTimeoutError)
    assert "rank 1 never arrived" in str(info.value)


def test_run_threaded_world_timeout_names_hung_ranks() -> None:
    gate = threading.Event()

    def fn(comm: distcomm.Communicator) -> Any:
        if comm.rank == 0:
            gate.wait(10)
        return comm.rank

    with pytest.raises(RankFailedError, match="rank 0 did not finish"):
        run_threaded(fn, 2, timeout=1)
    gate.set()


def test_spawn_reraises_with_rank_and_remote_traceback() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        if comm.rank == 1:
            raise ValueError("bad config on rank 1")
        return comm.rank

    with pytest.raises(RankFailedError, match="rank 1: ValueError: bad config") as info:
        spawn(fn, 2, timeout=60)
    assert "Traceback" in info.value.remote_traceback and isinstance(info.value.exception, ValueError)


@pytest.mark.slow
def test_spawn_kills_and_names_a_hung_rank() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        if comm.rank == 0:
            time.sleep(60)
        return comm.rank

    t0 = time.monotonic()
    with pytest.raises(RankFailedError, match="rank 0 did not finish within 8"):
        spawn(fn, 2, timeout=8)
    assert time.monotonic() - t0 < 20


_RANK_0_EXITS = """
import os
import distcomm

def main():
    comm = distcomm.current()
    if comm.rank == 0:
        os._exit(3)  # the process that serves the job's store goes first
    comm.all_gather(comm.rank, timeout=30)

if __name__ == "__main__":
    distcomm.launch(main, num_processes_per_machine=2, timeout=120)
"""


def test_a_dead_store_host_leaves_only_distcomms_report(tmp_path: Path) -> None:
    """The survivor's report names rank 0; torch's TCPStore warnings (a stack-frame dump per failed
    store call) don't follow it into the output. Every call is looked before it is made, but one
    already in flight when the host goes still prints one (seen once in a busy suite run; torch gives
    no way to silence its client): a run with that one warning is run again, and the second must be
    clean. A call made without looking prints in every run."""
    script = tmp_path / "job.py"
    script.write_text(_RANK_0_EXITS)
    for attempt in range(2):
        proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=240)
        assert proc.returncode != 0
        assert "rank 0, which hosts the job's store, is unreachable" in proc.stderr, proc.stderr[-3000:]
        warnings = proc.stderr.count("[c10d]")
        assert warnings <= 1 and (warnings == 0 or attempt == 0), proc.stderr[-3000:]
        if warnings == 0:
            assert "TCPStore" not in proc.stderr and "frame #" not in proc.stderr, proc.stderr[-3000:]
            break
