"""The slot format: round trips, and fuzzing with random and truncated frames (FrameError, never a crash)."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from distcomm import FrameError
from distcomm._transfer.header_exchange import expand, summarize
from distcomm._wire import frame as _frame

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


@given(parts=segments, seq=st.integers(0, 2**62), digest=st.integers(0, 2**64 - 1), packed=st.booleans(),
       size=st.sampled_from([64, 256, 1024]))
@settings(max_examples=200, deadline=None)
def test_encode_slot_is_what_decode_reads_back(parts: list[list[bytes]], seq: int, digest: int, packed: bool,
                                               size: int) -> None:
    """A rank's own slot, as the pipeline takes it from encoding (no decode): the same as decoded."""
    views = [[memoryview(s) for s in p] for p in parts]
    flags = _frame.PACKED if packed else 0
    if _frame.table_size([len(p) for p in parts]) > size:
        with pytest.raises(ValueError):
            _frame.encode_slot(3, seq, 2, digest, views, size, flags=flags)
        return
    slot, mine = _frame.encode_slot(3, seq, 2, digest, views, size, flags=flags)
    assert slot == _frame.encode(3, seq, 2, digest, views, size, flags=flags)
    assert mine == _frame.decode(slot)


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


@pytest.mark.parametrize("nparts, nsegs", [(1, 1), (2, 1), (1, 2)])  # (1, 1) is decode's short path
def test_one_segment_errors_read_as_the_general_ones(nparts: int, nsegs: int) -> None:
    """The table of one part of one segment, decoded on its own short path, fails as any other."""
    def slot(count: int, entry: int, total: int) -> bytes:
        head = _frame.HEADER.pack(_frame.MAGIC, _frame.VERSION, 0, 5, 0, 1, 0, nparts, nsegs, 0, total)
        table = struct.pack(f"<{nparts}I", count, *([0] * (nparts - 1)))
        table += struct.pack(f"<{nsegs}q", entry, *([-1] * (nsegs - 1)))
        return (head + table).ljust(128, b"\0")
    with pytest.raises(FrameError, match=f"part counts add up to 3, header says {nsegs} segments"):
        _frame.decode(slot(3, 10, 10))
    if nparts == nsegs:
        with pytest.raises(FrameError, match="inline segment runs past the end of the slot"):
            _frame.decode(slot(1, -1000, 999))
        with pytest.raises(FrameError, match="segments add up to 10 bytes, header says 11"):
            _frame.decode(slot(1, 10, 11))
        with pytest.raises(FrameError, match="segments add up to 4 bytes, header says 11"):
            _frame.decode(slot(1, -5, 11))
        got = _frame.decode(slot(1, -5, 4))
        assert got.parts == [[(4, memoryview(bytes(4)))]] and (got.later, got.later_segs) == (0, 0)
        got = _frame.decode(slot(1, 10, 10))
        assert got.parts == [[(10, None)]] and (got.later, got.later_segs) == (10, 1)


def _full_check_passes(raw: bytes, count: int, size: int, mine: bytes, digests: bool, cap: int | None) -> bool:
    """What ``_Communicator._agree`` accepts after ``headers``: the slow path ``agreed`` stands for."""
    try:
        heads = _frame.headers(raw, count, size)
    except FrameError:
        return False
    m = _frame.decode(mine).header
    same = (heads["op"] == m.op) & (heads["seq"] == m.seq) & (heads["root"] == m.root) & (heads["status"] == _frame.OK)
    if digests:
        same &= heads["digest"] == m.digest
    if cap is not None:
        same &= heads["total"] <= cap
    return bool(same.all())


@given(count=st.sampled_from([1, 2, 3, 4, 8, 49, 64, 300]), lengths=st.lists(st.integers(0, 120), min_size=300,
       max_size=300), flips=st.lists(st.tuples(st.integers(0, 299), st.integers(0, 47), st.integers(0, 255)),
       max_size=3), digests=st.booleans(), cap=st.none() | st.integers(0, 150), me=st.integers(0, 299),
       status=st.sampled_from([_frame.OK, _frame.INVALID]))
@settings(max_examples=300, deadline=None)
def test_agreed_is_the_full_checks_common_case(count: int, lengths: list[int], flips: list[tuple[int, int, int]],
                                              digests: bool, cap: int | None, me: int, status: int) -> None:
    """``agreed`` (the per-call fast path: struct up to 48 slots, numpy beyond) says yes only where
    the full header check and agreement would, and yes to every clean exchange."""
    size = 4096 if count <= 4 else _frame.HEADER_SLOT
    me %= count
    slots = [bytearray(_frame.encode(5, 12, 0, 99, [[memoryview(b"x" * (lengths[i] if i else 10))]], size))
             for i in range(count)]
    if status != _frame.OK:
        slots[me] = _frame.encode_status(status, 5, 12, 0, "boom", size)
    clean = status == _frame.OK and (cap is None or max(lengths[i] if i else 10 for i in range(count)) <= cap)
    assert _frame.agreed(b"".join(slots), count, size, bytes(slots[me]), digests=digests, cap=cap) == clean
    for i, at, value in flips:
        if i % count != me:
            slots[i % count][at] = value
    raw = b"".join(slots)
    got = _frame.agreed(raw, count, size, bytes(slots[me]), digests=digests, cap=cap)
    if got:
        assert _full_check_passes(raw, count, size, bytes(slots[me]), digests, cap)


def test_agreed_sees_each_field() -> None:
    for count in (3, 64):
        size = 4096 if count <= 4 else _frame.HEADER_SLOT
        base = _frame.encode(5, 12, 3, 99, [[memoryview(b"x" * 8)]], size)
        assert _frame.agreed(bytes(base) * count, count, size, base, digests=True, cap=8)
        others = {
            "op": _frame.encode(6, 12, 3, 99, [[memoryview(b"x" * 8)]], size),
            "seq": _frame.encode(5, 13, 3, 99, [[memoryview(b"x" * 8)]], size),
            "root": _frame.encode(5, 12, 2, 99, [[memoryview(b"x" * 8)]], size),
            "status": _frame.encode_status(_frame.TOO_LARGE, 5, 12, 3, "big", size),
            "total": _frame.encode(5, 12, 3, 99, [[memoryview(b"x" * 9)]], size),
        }
        for field, slot in others.items():
            raw = bytes(base) * (count - 1) + bytes(slot)
            assert not _frame.agreed(raw, count, size, base, cap=8), field
        flagged = _frame.encode(5, 12, 3, 99, [[memoryview(b"x" * 8)]], size, flags=_frame.PACKED)
        assert _frame.agreed(bytes(base) * (count - 1) + bytes(flagged), count, size, base)  # flags may differ
        digest = _frame.encode(5, 12, 3, 98, [[memoryview(b"x" * 8)]], size)
        assert _frame.agreed(bytes(base) * (count - 1) + bytes(digest), count, size, base)
        assert not _frame.agreed(bytes(base) * (count - 1) + bytes(digest), count, size, base, digests=True)
        nparts = bytearray(base)
        struct.pack_into("<I", nparts, 20, 1 + (size - _frame.HEADER_SIZE) // 4)  # nparts: a table past the slot
        assert not _frame.agreed(bytes(base) * (count - 1) + bytes(nparts), count, size, base)
        bad_table = bytearray(base)
        struct.pack_into("<I", bad_table, 24, 10_000)  # nsegs: a table past the slot
        assert not _frame.agreed(bytes(base) * (count - 1) + bytes(bad_table), count, size, base)
        negative = bytearray(base)
        struct.pack_into("<q", negative, 36, -1)
        assert not _frame.agreed(bytes(base) * (count - 1) + bytes(negative), count, size, base)


def test_agreed_compares_whole_fields() -> None:
    """Fields that differ only in their high bits, negative roots and call numbers, totals past
    32 bits, and caps past what numpy's uint64 holds, in both implementations."""
    for count in (3, 64):
        size = 4096 if count <= 4 else _frame.HEADER_SLOT
        for root, seq in ((-1, 5), (3, -7), (2**31 - 1, 2**62)):
            base = _frame.encode(5, seq, root, 2**63 + 5, [[memoryview(b"x" * 8)]], size)
            assert _frame.agreed(bytes(base) * count, count, size, base, digests=True, cap=2**70)
            for at, fmt, value in ((16, "<i", root ^ (1 << 20)), (8, "<q", seq ^ (1 << 40)),
                                   (28, "<Q", (2**63 + 5) ^ (1 << 50))):
                other = bytearray(base)
                struct.pack_into(fmt, other, at, value)
                raw = bytes(base) * (count - 1) + bytes(other)
                assert not _frame.agreed(raw, count, size, base, digests=True), (count, at)
                assert _full_check_passes(raw, count, size, base, True, None) is False
        big = bytearray(_frame.encode(5, 1, 0, 0, [], size))
        struct.pack_into("<q", big, 36, 2**40)  # a total past 32 bits (a segment that travels later)
        small = _frame.encode(5, 1, 0, 0, [], size)
        raw = bytes(small) * (count - 1) + bytes(big)
        for cap in (2**40 - 1, 2**32, 0):  # a check of only the low half would pass the last two
            assert not _frame.agreed(raw, count, size, small, cap=cap), cap
        for cap in (2**40, 2**63 - 1, 2**64, 2**70):
            assert _frame.agreed(raw, count, size, small, cap=cap) == _full_check_passes(raw, count, size, small,
                                                                                         False, cap), cap


@given(count=st.sampled_from([2, 17, 64, 300]), odd=st.integers(-1, 299), length=st.integers(0, 120),
       flips=st.lists(st.tuples(st.integers(0, 299), st.integers(0, 63), st.integers(0, 255)), max_size=3),
       digests=st.booleans(), cap=st.none() | st.integers(0, 150), me=st.integers(0, 299))
@settings(max_examples=300, deadline=None)
def test_agreed_with_a_common_slot_is_the_same_check(count: int, odd: int, length: int,
                                                     flips: list[tuple[int, int, int]], digests: bool,
                                                     cap: int | None, me: int) -> None:
    """The bytes path (every slot but ``odd`` compared with ``common``) answers as the field-by-field
    path would where it says yes, and says yes to every clean broadcast-like exchange."""
    size = _frame.HEADER_SLOT
    odd = odd % count if odd >= 0 else -1
    me %= count
    common = _frame.encode(7, 40, max(odd, 0), 0, [], size)
    slots = [bytearray(common) for _ in range(count)]
    if odd >= 0:
        slots[odd] = bytearray(_frame.encode(7, 40, odd, 0, [[memoryview(b"y" * length)]], size))
    clean = cap is None or odd < 0 or length <= cap
    raw = b"".join(slots)
    assert _frame.agreed(raw, count, size, bytes(slots[me]), digests=digests, cap=cap, common=common,
                         odd=odd) == clean
    for i, at, value in flips:
        if i % count != me:
            slots[i % count][at] = value
    raw = b"".join(slots)
    got = _frame.agreed(raw, count, size, bytes(slots[me]), digests=digests, cap=cap, common=common, odd=odd)
    assert got == _frame.agreed(raw, count, size, bytes(slots[me]), digests=digests, cap=cap)
    if got:
        assert _full_check_passes(raw, count, size, bytes(slots[me]), digests, cap)
    # what the gloo header exchange's summary says of the same slots leads to the same answer
    summary = memoryview(bytearray(8 + 2 * size))
    k = summarize(memoryview(raw), count, size, summary)
    if k != -2:
        alike = (k, bytes(summary[8 : 8 + size]))
        assert _frame.agreed(raw, count, size, bytes(slots[me]), digests=digests, cap=cap, common=common, odd=odd,
                             alike=alike) == got
        # a rank other than 0 holds the table the summary stands for, and its agreement needs no common slot
        assert bytes(expand(summary, count, size)) == raw
        assert _frame.agreed(raw, count, size, bytes(slots[me]), digests=digests, cap=cap, alike=alike) == got


@given(count=st.integers(1, 40), odd=st.lists(st.integers(0, 39), max_size=3), word=st.booleans())
@settings(max_examples=300, deadline=None)
def test_summary_is_the_one_odd_slot_or_none(count: int, odd: list[int], word: bool) -> None:
    """``summarize`` against a plain count: the common slot and the one slot that differs from it,
    or -1 (the table follows) when more than one does."""
    size = 64 if word else 20
    rows = [bytes([7]) * size for _ in range(count)]
    for i, r in enumerate(odd):
        if r < count:
            rows[r] = bytes([i + 1]) * size
    out = memoryview(bytearray(8 + 2 * size))
    k = summarize(memoryview(b"".join(rows)), count, size, out)
    word0 = struct.unpack_from("<q", out)[0]
    for whole in (bytearray(b"".join(rows)), b"".join(rows)):  # rank 0's table, read without a copy
        in_place = memoryview(bytearray(8 + 2 * size))
        assert summarize(whole, count, size, in_place) == k and bytes(in_place) == bytes(out)
    with pytest.raises(ValueError, match="needs"):
        summarize(b"".join(rows)[:-1], count, size, out)
    differ = sorted({r for r in odd if r < count}) if count >= 3 else []
    if (count >= 3 and len(differ) <= 1) or (count <= 2 and len(set(rows)) <= 1):
        assert k == (differ[0] if differ else -1) and word0 == k + 1
        assert bytes(expand(out, count, size)) == b"".join(rows)
        assert bytes(out[8 : 8 + size]) == (bytes([7]) * size if count >= 3 else rows[0])
        if differ:
            assert bytes(out[8 + size :]) == rows[differ[0]]
    elif count == 2:  # two slots, unlike: slot 0 is taken as the common one
        assert k == 1 and bytes(out[8 : 8 + size]) == rows[0] and bytes(out[8 + size :]) == rows[1]
    else:
        assert k == -2 and word0 == -1


def test_agreed_with_a_common_slot_checks_the_odd_one_and_the_common_one() -> None:
    size, count = _frame.HEADER_SLOT, 64
    common = _frame.encode(3, 9, 5, 0, [], size)
    root = _frame.encode(3, 9, 5, 0, [[memoryview(b"z" * 200)]], size)
    raw = bytes(common) * 5 + bytes(root) + bytes(common) * (count - 6)
    assert _frame.agreed(raw, count, size, common, common=common, odd=5)
    assert _frame.agreed(raw, count, size, root, common=common, odd=5)
    assert not _frame.agreed(raw, count, size, common, common=common, odd=5, cap=100)  # the root's total
    failed = _frame.encode_status(_frame.SERIALIZE_FAILED, 3, 9, 5, "boom", size)
    raw = bytes(common) * 5 + bytes(failed) + bytes(common) * (count - 6)
    assert not _frame.agreed(raw, count, size, common, common=common, odd=5)
    other_call = _frame.encode(3, 10, 5, 0, [], size)  # every slot alike, but not this rank's call
    assert not _frame.agreed(bytes(other_call) * count, count, size, common, common=other_call)
