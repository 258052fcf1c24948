"""Serializers: out-of-band buffers, tensors, cloudpickle fallback, SafeSerializer, the env switch."""

from __future__ import annotations

import collections
import datetime
import gc
import os
import pickle
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm._serialization import _CUDA_TARGET, _rebuild_tensor
from distcomm.testing import FakeCommunicator, run_threaded, spawn


def roundtrip(ser: distcomm.Serializer, obj: Any) -> Any:
    return ser.loads([memoryview(bytearray(s)) for s in ser.dumps(obj)])


def test_large_buffers_travel_out_of_band_and_become_the_result() -> None:
    ser = distcomm.PickleSerializer()
    arr, ten = np.arange(100_000, dtype=np.float32), torch.arange(50_000, dtype=torch.int64)
    segs = ser.dumps({"a": arr, "t": ten, "small": np.arange(10)})
    assert [s.nbytes for s in segs[1:]] == [arr.nbytes, ten.numel() * 8]
    assert len(segs[0]) < 1000  # the stream holds no large buffer
    received = [memoryview(bytearray(s)) for s in segs]
    out = ser.loads(received)
    np.testing.assert_array_equal(out["a"], arr)
    assert torch.equal(out["t"], ten)
    out["a"][0] = 42.0  # the result's memory is the received buffer: no copy was made
    assert np.frombuffer(received[1], dtype=np.float32)[0] == 42.0


@pytest.mark.parametrize("t", [
    torch.tensor(3.5), torch.ones(3, dtype=torch.bfloat16), torch.tensor([True, False]), torch.zeros(0, 4),
    torch.arange(12.0).reshape(3, 4).t(), torch.arange(10)[2:7], torch.randn(2, 3, dtype=torch.complex64).conj(),
    torch.ones(2, requires_grad=True), torch.nn.Parameter(torch.ones(3)),
])
def test_tensors_round_trip(t: torch.Tensor) -> None:
    for ser in (distcomm.PickleSerializer(), distcomm.PickleSerializer(oob_threshold=0), distcomm.SafeSerializer()):
        out = roundtrip(ser, t)
        assert type(out) is type(t) and out.dtype == t.dtype and out.shape == t.shape
        assert out.requires_grad == t.requires_grad
        assert torch.equal(out.detach().resolve_conj(), t.detach().resolve_conj())


def test_sparse_tensor_falls_back_to_torch_pickling() -> None:
    t = torch.eye(3).to_sparse()
    assert torch.equal(roundtrip(distcomm.PickleSerializer(), t).to_dense(), torch.eye(3))


def test_cloudpickle_fallback_for_lambdas_and_local_classes() -> None:
    class Local:
        x = 5

    out = roundtrip(distcomm.PickleSerializer(), {"f": lambda y: y + 1, "c": Local})
    assert out["f"](1) == 2 and out["c"].x == 5
    with pytest.raises((pickle.PicklingError, AttributeError)):
        distcomm.PickleSerializer(cloudpickle_fallback=False).dumps(lambda: 1)


class Point:
    def __init__(self, x: int) -> None:
        self.x = x


def test_safe_serializer_allows_data_and_registered_classes() -> None:
    safe = distcomm.SafeSerializer()
    obj = {"l": [1, 2.0, "s", b"b", None, True], "t": (1,), "s": {1}, "fs": frozenset({2}), "c": 1j,
           "od": collections.OrderedDict(a=1), "dq": collections.deque([1]), "when": datetime.datetime(2026, 1, 1),
           "np": np.arange(5), "npf": np.float32(1.5), "dt": np.dtype("f4"), "tdt": torch.float16,
           "size": torch.Size([2, 3]), "dev": torch.device("cpu"), "ba": bytearray(b"x")}
    out = roundtrip(safe, obj)
    assert out["l"] == obj["l"] and out["od"] == obj["od"] and out["tdt"] is torch.float16
    np.testing.assert_array_equal(out["np"], obj["np"])
    with pytest.raises(distcomm.UnsafePayloadError, match=r"tests\.test_serialization\.Point"):
        roundtrip(safe, Point(1))
    assert roundtrip(distcomm.SafeSerializer(allow=[Point]), Point(3)).x == 3
    assert roundtrip(distcomm.SafeSerializer(allow=["tests.test_serialization.Point"]), Point(4)).x == 4
    with pytest.raises(ValueError, match=r"module\.Name"):
        distcomm.SafeSerializer(allow=["Point"])


class Evil:
    def __reduce__(self) -> Any:
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("payload", [
    pickle.dumps(Evil()),
    pickle.dumps(print),
    b"\x80\x05cbuiltins\ngetattr\n.",
    b"\x80\x05c__builtin__\neval\n.",
])
def test_safe_serializer_refuses_code(payload: bytes) -> None:
    with pytest.raises(distcomm.UnsafePayloadError, match="refused to load global"):
        distcomm.SafeSerializer().loads([memoryview(payload)])


def test_env_variable_selects_the_serializer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCOMM_SERIALIZER", "safe")
    assert isinstance(distcomm.LocalCommunicator().serializer, distcomm.SafeSerializer)
    monkeypatch.setenv("DISTCOMM_SERIALIZER", "pickle")
    assert type(distcomm.LocalCommunicator().serializer) is distcomm.PickleSerializer
    monkeypatch.setenv("DISTCOMM_SERIALIZER", "yaml")
    with pytest.raises(ValueError, match="DISTCOMM_SERIALIZER"):
        distcomm.LocalCommunicator()


def test_garbage_from_a_peer_is_a_serialization_error() -> None:
    class Garbage(distcomm.PickleSerializer):
        def dumps(self, obj: Any) -> list[memoryview]:
            return [memoryview(b"\x80\x05not a pickle")]

    comm = FakeCommunicator(0, 2, serializer=Garbage())
    with pytest.raises(distcomm.SerializationError, match="can't load the object from rank 1"):
        comm.all_gather(1)


def test_tensors_that_were_on_cuda_land_where_the_receiver_says() -> None:
    data = bytearray(torch.arange(4, dtype=torch.float32).numpy().tobytes())
    assert _rebuild_tensor(data, torch.float32, (4,), False, True).device.type == "cpu"
    token = _CUDA_TARGET.set(lambda: torch.device("meta"))  # stands in for this rank's CUDA device
    try:
        assert _rebuild_tensor(data, torch.float32, (4,), False, True).device.type == "meta"
        assert _rebuild_tensor(data, torch.float32, (4,), False, False).device.type == "cpu"
    finally:
        _CUDA_TARGET.reset(token)
    assert distcomm.LocalCommunicator(receive_cuda_on="cpu")._cuda_target() is None
    with pytest.raises(ValueError, match="receive_cuda_on"):
        distcomm.LocalCommunicator(receive_cuda_on="gpu")  # type: ignore[arg-type]


def test_stats_count_calls_bytes_and_time() -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        comm.all_gather(np.zeros(100_000, dtype=np.uint8))
        comm.gather(1)
        return comm.stats

    stats = run_threaded(fn, 2)
    ag = stats[0]["all_gather"]
    assert ag.calls == 1 and ag.bytes_sent >= 100_000 and ag.bytes_received >= 100_000
    assert ag.serialize_s > 0 and ag.transfer_s > 0 and ag.deserialize_s > 0
    assert stats[1]["gather"].bytes_received == 4096  # rank 1 receives only the slot


def collecting() -> bool:
    """Whether the cyclic garbage collector would run automatically now."""
    return gc.isenabled() and gc.get_threshold()[0] > 0


class _RecordsGC(distcomm.PickleSerializer):
    """Notes whether the cyclic garbage collector collected automatically during each load."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, bool]] = []

    def loads(self, segments: Any) -> Any:
        obj = super().loads(segments)
        self.seen.append((len(obj), collecting()))
        return obj


def _many_then_few(comm: distcomm.Communicator) -> bool:
    comm.all_gather([{"id": i, "box": [0.0, 1.0, 2.0, 3.0]} for i in range(5000)])  # ~300 KB of small objects
    comm.all_gather([comm.rank])
    return collecting()


def _many_then_few_seen(comm: distcomm.Communicator) -> tuple[bool, list[tuple[int, bool]]]:
    assert isinstance(comm.serializer, _RecordsGC)
    comm.serializer.seen.clear()  # what the communicator's own set-up loaded
    enabled = _many_then_few(comm)
    return enabled, sorted(comm.serializer.seen)


def test_collector_waits_while_large_results_load_and_comes_back() -> None:
    """Loading many small objects doesn't trigger collection after collection; the state is restored."""
    ser = _RecordsGC()
    assert gc.isenabled()
    assert run_threaded(_many_then_few, 3, serializer=ser) == [True] * 3  # threads pause and resume together
    assert gc.isenabled()
    assert sorted(ser.seen) == [(1, True)] * 6 + [(5000, False)] * 6
    gc.disable()  # a user who turned the collector off keeps it off
    try:
        ser.seen.clear()
        assert run_threaded(_many_then_few, 2, serializer=ser) == [False] * 2
        assert not gc.isenabled()
        assert sorted(ser.seen) == [(1, False)] * 2 + [(5000, False)] * 2
    finally:
        gc.enable()


class _DisablesGC(distcomm.PickleSerializer):
    """Turns the collector off in the middle of a load, as another thread of the user's might."""

    def loads(self, segments: Any) -> Any:
        obj = super().loads(segments)
        if isinstance(obj, list) and len(obj) == 5000:
            gc.disable()
        return obj


def test_collector_switched_off_during_a_load_stays_off() -> None:
    threshold = gc.get_threshold()
    try:
        run_threaded(_many_then_few, 2, serializer=_DisablesGC())
        assert not gc.isenabled()  # the pause ended without switching it back on
        assert gc.get_threshold() == threshold
    finally:
        gc.enable()


def test_collector_waits_in_real_processes_too() -> None:
    for enabled, seen in spawn(_many_then_few_seen, 2, timeout=120, serializer=_RecordsGC()):
        assert enabled
        assert seen == [(1, True), (5000, False)]


class _Reduces:
    """Pickles as ``fn(*args)``: how a hostile peer writes a payload that calls an allowed constructor."""

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> Any:
        return self.fn, self.args


def _bombs() -> list[Any]:
    import collections

    from numpy.core.multiarray import _reconstruct

    return [_Reduces(bytearray, (1 << 30,)), _Reduces(bytes, (1 << 30,)), _Reduces(list, (range(2 * 10**8),)),
            _Reduces(set, (range(10**9),)), _Reduces(collections.deque, (range(10**9),)),
            _Reduces(np.ndarray, ((10**10,),)), _Reduces(_reconstruct, (np.ndarray, (10**10,), b"b"))]


@pytest.mark.parametrize("index", range(7))
def test_safe_loads_refuse_constructors_that_allocate_from_a_count(index: int) -> None:
    """A few bytes must not make the receiver allocate gigabytes (bytearray(n), list(range(n)), ndarray(shape))."""
    import tracemalloc

    payload = distcomm.PickleSerializer().dumps(_bombs()[index])
    assert sum(p.nbytes for p in payload) < 300
    tracemalloc.start()
    try:
        with pytest.raises(distcomm.UnsafePayloadError, match="refused"):
            distcomm.SafeSerializer().loads(payload)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()


def test_safe_loads_still_build_what_peers_really_send() -> None:
    import collections

    sent = {"l": [1, 2], "t": (1,), "s": {1}, "f": frozenset({2}), "b": b"x", "ba": bytearray(b"yz"),
            "r": range(5), "dq": collections.deque([1, 2], maxlen=5), "c": collections.Counter("aab"),
            "od": collections.OrderedDict(a=1), "a": np.arange(5.0), "big": np.arange(100_000),
            "rec": np.zeros(2, dtype=[("x", "f4")]), "tensor": torch.ones(3), "m": np.float32(2.5)}
    got = distcomm.SafeSerializer().loads(distcomm.PickleSerializer().dumps(sent))
    for k, v in sent.items():
        if isinstance(v, (np.ndarray, torch.Tensor)):
            assert type(got[k]) is type(v) and got[k].tolist() == v.tolist(), k
        else:
            assert got[k] == v and type(got[k]) is type(v), k


def test_a_safe_load_allocates_a_bounded_multiple_of_what_it_received() -> None:
    """Nested containers, repeated references, empty sets (the worst we found: 118x): under 150 bytes of
    objects per byte received."""
    import pickle as pkl
    import tracemalloc

    shared = [0]
    for obj in ([[[]] for _ in range(50_000)], [shared] * 200_000, {i: (i, [i]) for i in range(20_000)},
                [set() for _ in range(50_000)]):
        raw = pkl.dumps(obj, protocol=5)
        tracemalloc.start()
        try:
            distcomm.SafeSerializer().loads([memoryview(raw)])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 150 * len(raw), (len(raw), peak)
