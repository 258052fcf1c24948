"""The slot format: round trips, and fuzzing with random and truncated frames (FrameError, never a crash)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distcomm import FrameError, _frame

segments = st.lists(st.lists(st.binary(max_size=300), max_size=4), max_size=4)


@given(parts=segments, seq=st.integers(0, 2**62), root=st.integers(-1, 2**30), digest=st.integers(0, 2**64 - 1))
@settings(max_examples=200, deadline=None)
def test_round_trip(parts: list[list[bytes]], seq: int, root: int, digest: int) -> None:
    views = [[memoryview(s) for s in p] for p in parts]
    if _frame.table_size([len(p) for p in parts]) > 1024:
        with pytest.raises(ValueError):
            _frame.encode(3, seq, root, digest, views, 1024)
        return
    slot = _frame.encode(3, seq, root, digest, views, 1024)
    out = _frame.decode(slot)
    assert (out.header.op, out.header.seq, out.header.root, out.header.digest) == (3, seq, root, digest)
    assert [[size for size, _ in p] for p in out.parts] == [[len(s) for s in p] for p in parts]
    for p_in, p_out in zip(parts, out.parts):
        for s, (_, inline) in zip(p_in, p_out):
            if inline is not None:
                assert bytes(inline) == s


@given(data=st.binary(max_size=2048))
@settings(max_examples=500, deadline=None)
def test_random_bytes_decode_or_frame_error(data: bytes) -> None:
    try:
        _frame.decode(data)
    except FrameError:
        pass


@given(data=st.binary(max_size=1200))
@settings(max_examples=300, deadline=None)
def test_random_bytes_after_a_valid_header(data: bytes) -> None:
    head = _frame.HEADER.pack(_frame.MAGIC, _frame.VERSION, 0, 3, 0, 1, -1, 2, 3, 0, 10)
    try:
        _frame.decode(head + data)
    except FrameError:
        pass


@given(parts=segments, cut=st.integers(0, 1023))
@settings(max_examples=300, deadline=None)
def test_truncated_frames(parts: list[list[bytes]], cut: int) -> None:
    views = [[memoryview(s) for s in p] for p in parts]
    if _frame.table_size([len(p) for p in parts]) > 1024:
        return
    slot = _frame.encode(3, 1, 0, 0, views, 1024)
    try:
        _frame.decode(bytes(slot[:cut]))
    except FrameError:
        pass


@given(segs=st.lists(st.binary(max_size=200), max_size=6), junk=st.binary(max_size=64), cut=st.integers(0, 2000))
@settings(max_examples=300, deadline=None)
def test_pack_round_trip_and_fuzz(segs: list[bytes], junk: bytes, cut: int) -> None:
    packed = _frame.pack([memoryview(s) for s in segs])
    assert [bytes(v) for v in _frame.unpack(memoryview(packed))] == segs
    for bad in (bytes(packed[:cut]), bytes(packed) + junk, junk):
        try:
            _frame.unpack(memoryview(bad))
        except FrameError:
            pass


@given(parts=segments, flips=st.lists(st.tuples(st.integers(0, 1023), st.integers(0, 255)), min_size=1, max_size=6))
@settings(max_examples=400, deadline=None)
def test_mutated_frames(parts: list[list[bytes]], flips: list[tuple[int, int]]) -> None:
    """A valid slot with bytes changed (sizes, counts, offsets, status): a frame whose every size stays
    inside the slot, or FrameError."""
    views = [[memoryview(s) for s in p] for p in parts]
    if _frame.table_size([len(p) for p in parts]) > 1024:
        return
    slot = bytearray(_frame.encode(3, 1, 0, 0, views, 1024))
    for at, value in flips:
        slot[at % len(slot)] = value
    try:
        out = _frame.decode(bytes(slot))
    except FrameError:
        return
    for part in out.parts:
        for size, inline in part:
            assert size >= 0
            assert inline is None or len(inline) == size


def test_specific_errors() -> None:
    with pytest.raises(FrameError, match="shorter than"):
        _frame.decode(b"DCM1")
    with pytest.raises(FrameError, match="bad magic"):
        _frame.decode(b"XXXX" + bytes(60))
    with pytest.raises(FrameError, match="version"):
        _frame.decode(_frame.HEADER.pack(_frame.MAGIC, 99, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    huge = _frame.HEADER.pack(_frame.MAGIC, _frame.VERSION, 0, 3, 0, 1, -1, 1, 2**31, 0, 0)
    with pytest.raises(FrameError, match="runs past the slot"):
        _frame.decode(huge + bytes(100))
    with pytest.raises(FrameError, match="claims"):
        _frame.unpack(memoryview(struct.pack("<I", 10**6)))
    msg = _frame.encode_status(_frame.SERIALIZE_FAILED, 3, 1, 0, "é" * 5000, 512)
    assert _frame.decode(msg).message.startswith("é")
