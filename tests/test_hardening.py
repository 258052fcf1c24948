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
from distcomm import _frame
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


@pytest.mark.parametrize("world", ["gloo", "threaded"])
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
        op, root, _ = self._ctx
        slot = bytearray(size)
        _frame.HEADER.pack_into(slot, 0, _frame.MAGIC, _frame.VERSION, _frame.OK, op, 0, self._seq, root,
                                1, 1, 0, 1 << 60)
        struct.pack_into("<Iq", slot, _frame.HEADER_SIZE, 1, 1 << 60)
        return slot


def test_absurd_announced_size_is_refused_before_allocating() -> None:
    comm = _Forger(0, 2)
    with pytest.raises(distcomm.PayloadTooLargeError, match="more than this machine's memory"):
        comm.all_gather("x")
    assert "broken" in repr(comm)  # only this rank could tell: its peers are already past the slots
    capped = _Forger(0, 2, max_bytes=1 << 20)  # a shared limit: refused alike, and still usable
    with pytest.raises(distcomm.PayloadTooLargeError, match="over max_bytes"):
        capped.all_gather("x")
    assert "open" in repr(capped)


class _Overrun(FakeCommunicator):
    """Peers announce an inline segment longer than their slot: a table only a receiver decodes."""

    def _peer_slot(self, r: int, size: int) -> bytearray:
        op, root, _ = self._ctx
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
