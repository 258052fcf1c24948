"""What users get wrong, answered clearly: settings changed after construction, one communicator
used from two threads, a communicator inside a payload, the timeout given to split(), the main
process flag where a bool is expected, the local group nobody asked for."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded, spawn


@pytest.mark.parametrize("name, value", [("max_bytes", 1 << 20), ("slot_bytes", 8192), ("receive_cuda_on", "cpu"),
                                         ("serializer", distcomm.SafeSerializer())])
def test_settings_every_rank_shares_are_fixed_at_construction(name: str, value: Any) -> None:
    comm = FakeCommunicator(0, 2)
    before = getattr(comm, name)
    with pytest.raises(AttributeError, match=f"{name} is fixed when a communicator is made"):
        setattr(comm, name, value)
    assert getattr(comm, name) is before
    assert comm.all_gather(b"x" * 5000) == [b"x" * 5000] * 2  # still usable, as it was


def _with_an_intruder(comm: distcomm.Communicator) -> tuple[Any, list[str]]:
    """This rank's all_gather, while a second thread calls one on the same communicator."""
    refused: list[str] = []

    def intruder() -> None:
        deadline = time.monotonic() + 30
        while not comm._busy.locked() and time.monotonic() < deadline:  # the first call is in its exchange
            time.sleep(0.001)
        try:
            comm.all_gather(("B", 0))
        except distcomm.CommunicatorStateError as e:
            refused.append(str(e))

    t = threading.Thread(target=intruder)
    t.start()
    got = comm.all_gather(("A", 0))
    t.join(60)
    return got, refused


def _misused_on_rank_1(comm: distcomm.Communicator) -> tuple[Any, list[str], str, str]:
    if comm.rank == 1:
        first, refused = _with_an_intruder(comm)
    else:
        time.sleep(0.5)  # rank 1's first call waits in its exchange meanwhile
        first, refused = comm.all_gather(("A", 0)), []
    later = []
    for call in (lambda: comm.all_gather(("A", 1)), comm.synchronize):
        try:
            call()
            later.append("returned")
        except distcomm.DistCommError as e:
            later.append(f"{type(e).__name__}: {e}")
    return first, refused, later[0], later[1]


def _check_misused(results: list[tuple[Any, list[str], str, str]]) -> None:
    for rank, (first, refused, second, third) in enumerate(results):
        assert first == [("A", 0), ("A", 0)]  # the call in progress pairs as it should
        assert len(refused) == (1 if rank == 1 else 0)
        assert all("two threads at once" in text for text in refused)
        for later in (second, third):  # every rank learns it at its next call, with the same error
            assert later.startswith("CollectiveError") and "rank 1 was used from two threads at once" in later
            assert "fails every later collective" in later


def test_two_threads_on_one_communicator_fail_every_rank_from_then_on_threaded() -> None:
    _check_misused(run_threaded(_misused_on_rank_1, 2, timeout=60))


def test_two_threads_on_one_communicator_fail_every_rank_from_then_on_gloo() -> None:
    _check_misused(spawn(_misused_on_rank_1, 2, timeout=120, reuse=False))  # it leaves its world misused


def test_a_communicator_in_a_payload_is_refused_clearly() -> None:
    comm = FakeCommunicator(0, 2)
    with pytest.raises(distcomm.SerializationError, match="can't be sent to another process") as e:
        comm.all_gather({"c": comm})
    assert "(at obj['c'], a distcomm.testing.FakeCommunicator)" in str(e.value)  # where, not inside it
    with pytest.raises(distcomm.SerializationError, match="can't be sent to another process") as e:
        comm.all_gather({"step": lambda: comm.rank})  # a closure that captures it
    assert "(at obj['step'] (captured 'comm'), a distcomm.testing.FakeCommunicator)" in str(e.value)
    assert comm.all_gather(1) == [1, 1]  # refused on every rank before anything moved: still usable


def _split_timeouts(comm: distcomm.Communicator) -> tuple[float | None, float | None]:
    sub = comm.split(0, timeout=3)
    assert sub is not None
    return comm.timeout, sub.timeout


def test_a_split_timeout_bounds_creating_the_group_not_its_later_calls() -> None:
    assert run_threaded(_split_timeouts, 2, timeout=60) == [(60.0, 60.0)] * 2
    fake = FakeCommunicator(0, 2, timeout=60)
    sub = fake.new_group([0, 1], timeout=3)
    assert sub is not None and sub.timeout == 60.0


def test_a_split_timeout_bounds_creating_the_group_not_its_later_calls_gloo() -> None:
    assert spawn(_split_timeouts, 2, timeout=60) == [(60.0, 60.0)] * 2


def test_is_main_process_is_a_bool() -> None:
    main, other = FakeCommunicator(0, 2).is_main_process, FakeCommunicator(1, 2).is_main_process
    assert main is True and other is False
    assert json.dumps({"main": main}) == '{"main": true}'
    assert torch.tensor(main).dtype == torch.bool and np.array(main).dtype == np.bool_
    assert (main & True) is True and torch.arange(2)[torch.tensor([main, other])].tolist() == [0]
    assert distcomm.is_main_process() is True  # the module helper keeps the classic call


def _local_group_names(comm: distcomm.Communicator) -> tuple[bool, bool, bool]:
    plain = distcomm.GlooCommunicator()  # over the default group, as code that calls init_process_group gets
    try:
        with distcomm.use(plain):
            before = distcomm._LOCAL_PROCESS_GROUP is None
            plain.create_local_groups(1)
            after = distcomm._LOCAL_PROCESS_GROUP is not None
        with distcomm.use(comm):  # spawn's, like launch()'s, knows its machines
            launched = distcomm._LOCAL_PROCESS_GROUP is not None
        return before, after, launched
    finally:
        plain.close()


def test_the_local_process_group_exists_once_asked_for() -> None:
    assert spawn(_local_group_names, 2, timeout=120) == [(True, True, True)] * 2


class _Payload:
    """An object a weak reference can watch."""


def test_a_collective_keeps_nothing_of_the_users_objects() -> None:
    import gc
    import weakref

    def call(comm: distcomm.Communicator) -> bool:
        t, d = torch.ones(3), _Payload()
        refs = [weakref.ref(t), weakref.ref(d)]
        comm.all_reduce(t)
        comm.broadcast(d)
        del t, d
        gc.collect()
        return all(r() is None for r in refs)

    assert run_threaded(call, 2) == [True, True]


def _tensors_on_other_devices(comm: distcomm.Communicator) -> str:
    t = torch.ones(2) if comm.rank == 0 else torch.ones(2, device="meta")
    with pytest.raises(distcomm.CollectiveMismatchError) as info:
        comm.all_reduce(t)
    return str(info.value)


def test_tensors_on_different_kinds_of_device_are_named_on_every_rank() -> None:
    """An NcclCommunicator moves CPU tensors over gloo and CUDA ones over NCCL, so the kind of
    device is checked with dtype and shape: here cpu against meta in the in-process world, whose
    transport takes any device (GlooCommunicator refuses a meta tensor before the check)."""
    messages = run_threaded(_tensors_on_other_devices, 2, timeout=60)
    assert messages[0] == messages[1]
    assert "on the same kind of device" in messages[0] and "rank 1: torch.float32 (2,) op='sum' on meta" in messages[0]
