"""The wire format of distcomm's first exchange: one fixed-size slot per rank.

Every object collective starts with an all-gather of one slot from every rank. A slot holds a
header (op, sequence number, root, status, a digest), a table of segment sizes, and as many
small segments inline as fit. A segment is one contiguous piece of a serialized object: its pickle
stream or an out-of-band buffer. Segments that don't fit travel afterwards into buffers of their
exact size. When the table itself doesn't fit, each part is packed into one
segment (``pack`` / ``unpack``).

Layout (little-endian)::

    magic "DCM1" | version u8 | status u8 | op u8 | flags u8 | seq i64 | root i32
    | nparts u32 | nsegs u32 | digest u64 | total i64                       (header, 44 bytes)
    | nparts x u32 segment count per part
    | nsegs x i64 entry: size >= 0 travels later; -(size + 1) is inline
    | inline bytes, in segment order

With a non-OK status the header is followed by a UTF-8 message of ``total`` bytes, as much of it
as fits; the rest travels after the slots (``Slot.later``), on the error path only.

Everything here is a pure function over bytes, so it can be fuzzed: any input gives either a
decoded slot or a ``FrameError``.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .._errors import FrameError

I64 = struct.Struct("<q")

MAGIC = b"DCM1"
VERSION = 3
"""3: a scatter root's header slot may announce the size of the per-rank slots (``encode_later``)."""
HEADER = struct.Struct("<4sBBBBqiIIQq")
HEADER_SIZE = HEADER.size
MIN_SLOT = 256
TOTAL_AT = 36
"""Where a header's total (int64) lies."""
HEADER_SLOT = 64
"""The slot of worlds over SMALL_WORLD ranks (and of set-up): a header and a one- or two-segment table."""
SMALL_WORLD = 4
"""Worlds of up to this many ranks use the full ``slot_bytes`` slot (small objects finish in one exchange)."""
ALIGN = 64
"""Out-of-band buffers a receiver gets start at a multiple of this many bytes."""

# statuses
OK = 0
SERIALIZE_FAILED = 1  # that rank could not serialize its object; message follows
TOO_LARGE = 2  # that rank's payload is over max_bytes; message follows
INVALID = 3  # that rank's input was rejected (wrong scatter length, bad dict value); message follows
STATUS_NAMES = {OK: "ok", SERIALIZE_FAILED: "serialize failed", TOO_LARGE: "too large", INVALID: "invalid"}
MAX_MESSAGE = 1 << 16
"""Error messages are cut to this many bytes of UTF-8."""

# flags
PACKED = 1

_U32 = struct.Struct("<I")
_ONE_SEG = struct.Struct("<Iq")  # the table of one part of one segment
_ONE_SEG_DATA = HEADER_SIZE + _ONE_SEG.size


class Header(NamedTuple):
    status: int
    op: int
    flags: int
    seq: int
    root: int
    digest: int
    total: int


@dataclass
class Slot:
    """A decoded slot. ``parts[p][s]`` is (size, inline bytes or None when it travels later)."""

    header: Header
    parts: list[list[tuple[int, memoryview | None]]] = field(default_factory=list)
    message: str = ""
    later: int = 0  # bytes of the segments (or of the message) that travel after the slots
    later_segs: int = 0  # how many segments travel after the slots


def flat(view: memoryview) -> memoryview:
    """``view`` as one-dimensional unsigned bytes (a view, no copy): what slices of byte buffers take."""
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def table_size(part_lengths: Sequence[int]) -> int:
    return HEADER_SIZE + 4 * len(part_lengths) + 8 * sum(part_lengths)


def encode(
    op: int,
    seq: int,
    root: int,
    digest: int,
    parts: Sequence[Sequence[memoryview]],
    slot_size: int,
    *,
    flags: int = 0,
) -> bytearray:
    """Encode an OK slot. Segments are inlined greedily, in order, while they fit.

    Raises:
        ValueError: the table doesn't fit in ``slot_size`` (the caller packs and retries).
    """
    return _encode(op, seq, root, digest, parts, slot_size, flags, None)[0]


def encode_slot(
    op: int,
    seq: int,
    root: int,
    digest: int,
    parts: Sequence[Sequence[memoryview]],
    slot_size: int,
    *,
    flags: int = 0,
) -> tuple[bytearray, Slot]:
    """``encode``, and the slot as ``decode`` reads it back (inline segments: views of the bytes),
    without decoding: what a rank knows of its own slot."""
    table: list[list[tuple[int, memoryview | None]]] = []
    out, total, later, later_segs = _encode(op, seq, root, digest, parts, slot_size, flags, table)
    return out, Slot(Header(OK, int(op), flags, seq, root, digest, total), table, "", later, later_segs)


def _encode(op: int, seq: int, root: int, digest: int, parts: Sequence[Sequence[memoryview]], slot_size: int,
            flags: int, table: list[list[tuple[int, memoryview | None]]] | None) -> tuple[bytearray, int, int, int]:
    """``encode``, with the slot's total and the bytes and count of its segments that travel
    later; with ``table``, each part's entries appended to it as ``decode`` gives them."""
    if not parts:  # a header alone (a broadcast's or scatter's receivers, a barrier)
        if HEADER_SIZE > slot_size:
            raise ValueError(f"segment table needs {HEADER_SIZE} bytes, slot holds {slot_size}")
        out = bytearray(slot_size)
        HEADER.pack_into(out, 0, MAGIC, VERSION, OK, op, flags, seq, root, 0, 0, digest, 0)
        return out, 0, 0, 0
    lengths = [len(p) for p in parts]
    head = table_size(lengths)
    if head > slot_size:
        raise ValueError(f"segment table needs {head} bytes, slot holds {slot_size}")
    out = bytearray(slot_size)
    view = memoryview(out) if table is not None else None
    total = nsegs = later = later_segs = 0
    pos = HEADER_SIZE
    for p in parts:
        _U32.pack_into(out, pos, len(p))
        pos += 4
    data = head
    for p in parts:
        entries: list[tuple[int, memoryview | None]] = []
        for seg in p:
            n = seg.nbytes
            total += n
            nsegs += 1
            inline = data + n <= slot_size
            if inline:
                I64.pack_into(out, pos, -(n + 1))
                out[data : data + n] = flat(seg)
            else:
                I64.pack_into(out, pos, n)
                later += n
                later_segs += 1
            if view is not None:
                entries.append((n, view[data : data + n] if inline else None))
            if inline:
                data += n
            pos += 8
        if table is not None:
            table.append(entries)
    HEADER.pack_into(out, 0, MAGIC, VERSION, OK, op, flags, seq, root, len(lengths), nsegs, digest, total)
    return out, total, later, later_segs


def encode_later(op: int, seq: int, root: int, digest: int, nbytes: int, slot_size: int) -> bytearray:
    """Encode an OK slot of one part of one segment of ``nbytes`` that travels after the slots: how a
    scatter's root announces the size of the slot it then sends each rank."""
    out = bytearray(slot_size)
    HEADER.pack_into(out, 0, MAGIC, VERSION, OK, op, 0, seq, root, 1, 1, digest, nbytes)
    struct.pack_into("<Iq", out, HEADER_SIZE, 1, nbytes)
    return out


def message_bytes(message: str) -> bytes:
    """A status message as it travels: UTF-8, at most MAX_MESSAGE bytes."""
    return message.encode("utf-8", "replace")[:MAX_MESSAGE]


def encode_status(status: int, op: int, seq: int, root: int, message: str, slot_size: int) -> bytearray:
    """Encode a slot that reports a failure on this rank: the message's length, and as much of it as fits."""
    raw = message_bytes(message)
    out = bytearray(slot_size)
    HEADER.pack_into(out, 0, MAGIC, VERSION, status, op, 0, seq, root, 0, 0, 0, len(raw))
    inline = raw[: slot_size - HEADER_SIZE]
    out[HEADER_SIZE : HEADER_SIZE + len(inline)] = inline
    return out


def decode(buf: memoryview | bytes | bytearray) -> Slot:
    """Decode one slot. Raises FrameError on anything that is not a well-formed slot."""
    mv = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
    n = mv.nbytes
    if n < HEADER_SIZE:
        raise FrameError(f"slot of {n} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, status, op, flags, seq, root, nparts, nsegs, digest, total = HEADER.unpack_from(mv, 0)
    if magic != MAGIC:
        raise FrameError(f"bad magic {bytes(magic)!r}: not a distcomm frame")
    if version != VERSION:
        raise FrameError(f"frame version {version}, this distcomm speaks {VERSION}")
    if status not in STATUS_NAMES:
        raise FrameError(f"unknown status {status}")
    if total < 0:
        raise FrameError(f"negative total size {total}")
    header = Header(status, op, flags, seq, root, digest, total)
    if status != OK:
        if total > MAX_MESSAGE:
            raise FrameError(f"error message of {total} bytes is over {MAX_MESSAGE}")
        here = min(total, n - HEADER_SIZE)
        msg = bytes(mv[HEADER_SIZE : HEADER_SIZE + here]).decode("utf-8", "replace")
        return Slot(header, [], msg, total - here)
    if HEADER_SIZE + 4 * nparts + 8 * nsegs > n:
        raise FrameError(f"segment table ({nparts} parts, {nsegs} segments) runs past the slot")
    if nparts == 1 and nsegs == 1:  # the common slot: one object in one segment (a pickle stream)
        count, e = _ONE_SEG.unpack_from(mv, HEADER_SIZE)
        if count != 1:
            raise FrameError(f"part counts add up to {count}, header says 1 segments")
        size = e if e >= 0 else -e - 1
        if e < 0 and _ONE_SEG_DATA + size > n:
            raise FrameError("inline segment runs past the end of the slot")
        if size != total:
            raise FrameError(f"segments add up to {size} bytes, header says {total}")
        if e >= 0:
            return Slot(header, [[(e, None)]], "", e, 1)
        return Slot(header, [[(size, mv[_ONE_SEG_DATA : _ONE_SEG_DATA + size])]], "", 0, 0)
    table = _table_struct(nparts, nsegs).unpack_from(mv, HEADER_SIZE)
    counts, entries = table[:nparts], table[nparts:]
    if sum(counts) != nsegs:
        raise FrameError(f"part counts add up to {sum(counts)}, header says {nsegs} segments")
    data = HEADER_SIZE + 4 * nparts + 8 * nsegs
    seen = later = later_segs = 0
    parts: list[list[tuple[int, memoryview | None]]] = []
    i = 0
    for c in counts:
        part: list[tuple[int, memoryview | None]] = []
        for e in entries[i : i + c]:
            if e >= 0:
                part.append((e, None))
                seen += e
                later += e
                later_segs += 1
            else:
                size = -e - 1
                if data + size > n:
                    raise FrameError("inline segment runs past the end of the slot")
                part.append((size, mv[data : data + size]))
                data += size
                seen += size
        i += c
        parts.append(part)
    if seen != total:
        raise FrameError(f"segments add up to {seen} bytes, header says {total}")
    return Slot(header, parts, "", later, later_segs)


_HEADER_FIELDS = ["magic", "version", "status", "op", "flags", "seq", "root", "nparts", "nsegs", "digest", "total"]
_HEADER_FORMATS = ["S4", "u1", "u1", "u1", "u1", "<i8", "<i4", "<u4", "<u4", "<u8", "<i8"]


@functools.lru_cache(maxsize=64)
def _header_dtype(slot_size: int) -> np.dtype[Any]:
    offsets = [0, 4, 5, 6, 7, 8, 16, 20, 24, 28, 36]
    return np.dtype({"names": _HEADER_FIELDS, "formats": _HEADER_FORMATS, "offsets": offsets,
                     "itemsize": slot_size})


def headers(raw: memoryview | bytes | bytearray, count: int, slot_size: int) -> np.ndarray[Any, Any]:
    """The headers of ``count`` slots laid back to back, as one structured array (fields as in
    ``Header``), checked alike: a rank's whole view of its peers in one pass of C, not ``count``
    Python decodes. Raises FrameError naming the first slot that is not a well-formed header.
    """
    arr = np.frombuffer(raw, dtype=_header_dtype(slot_size), count=count)
    ok = arr["status"] == OK
    table = HEADER_SIZE + 4 * arr["nparts"].astype(np.int64) + 8 * arr["nsegs"].astype(np.int64)
    bad = ((arr["magic"] != MAGIC) | (arr["version"] != VERSION) | (arr["status"] > INVALID)
           | (arr["total"] < 0) | (ok & (table > slot_size)))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        decode(memoryview(raw)[i * slot_size : (i + 1) * slot_size])  # raises the precise FrameError
        raise FrameError(f"slot {i} has a malformed header")
    return arr


_AGREE = struct.Struct("<QqiIIQq")  # the header as words: magic..flags, seq, root, nparts, nsegs, digest, total
_FLAGS_BYTE = 0xFF << 56  # the flags byte of the first word: ranks may differ there
_STATUS_SHIFT = 40
_PY_AGREE_MAX = 48
"""Up to this many slots, ``agreed`` reads each header with struct: cheaper than numpy's per-call cost."""
_UNIFORM_MIN = 16
"""Beyond this many slots, a ``common`` slot is compared as bytes (a few microseconds at any count)."""


def agreed(raw: memoryview | bytes | bytearray, count: int, slot_size: int, mine: bytes | bytearray, *,
           digests: bool = False, cap: int | None = None, common: bytes | bytearray | None = None,
           odd: int = -1, alike: tuple[int, bytes] | None = None) -> bool:
    """Whether the common case holds: every slot is a well-formed OK header of the same op, call
    number and root as ``mine`` (this rank's own slot; with ``digests``, the same digest too), with
    a table that fits and a total of at most ``cap`` bytes.

    ``common``: the slot every rank but ``odd`` (-1: every rank) sends when all goes well, where
    the caller knows it (a broadcast's non-roots, scatter, a barrier). Beyond ``_UNIFORM_MIN``
    slots, those are then compared as bytes, in C, and only ``common`` and slot ``odd`` are read
    field by field: a 1,024-rank broadcast checks its 64 KiB of slots in about 4 microseconds.
    Slots that differ from ``common`` fall back to the field-by-field check.

    ``alike``: what the exchange that brought the slots already knows of them, (k, c): every slot
    but slot k (-1: none) is c, byte for byte (the gloo header exchange's summary). Only c and slot
    k are then read, at any count, and ``common`` isn't needed.

    The answer is the same on every rank (they all hold the same slots, and when every slot
    matches this rank's, every rank's matches its own). False sends the caller to the full check
    (``headers``), which names what is wrong; True means ``headers`` would refuse nothing.
    """
    w0, seq, root, _, _, digest, _ = _AGREE.unpack_from(mine, 0)
    if (w0 >> _STATUS_SHIFT) & 0xFF != OK:
        return False
    if cap is not None and cap >= 2**63 - 1:  # no total is over it (and numpy's uint64 can't hold every int)
        cap = None
    key = w0 & ~_FLAGS_BYTE
    room = slot_size - HEADER_SIZE
    unpack = _AGREE.unpack_from
    if alike is not None and len(alike[1]) == slot_size and -1 <= alike[0] < count:
        # every slot is alike[1] but slot alike[0]: those two are read (each as one slot of the loop below)
        heads = [unpack(alike[1], 0)] + ([] if alike[0] < 0 else [unpack(raw, alike[0] * slot_size)])
    elif alike is None and common is not None and len(common) == slot_size and count > _UNIFORM_MIN \
            and _uniform(raw, count, slot_size, common, odd):
        # every slot is ``common`` but slot ``odd``: those two are read
        heads = [unpack(common, 0)] + ([] if odd < 0 else [unpack(raw, odd * slot_size)])
    elif count <= _PY_AGREE_MAX or slot_size % 8:
        heads = [unpack(raw, i * slot_size) for i in range(count)]
    else:
        heads = None
    if heads is not None:
        for a, s, r, nparts, nsegs, d, total in heads:
            if (a & ~_FLAGS_BYTE != key or s != seq or r != root or total < 0 or 4 * nparts + 8 * nsegs > room
                    or (digests and d != digest) or (cap is not None and total > cap)):
                return False
        return True
    words = np.frombuffer(raw, dtype="<u8", count=count * (slot_size // 8)).reshape(count, slot_size // 8)
    c2, c3 = words[:, 2], words[:, 3]  # root | nparts << 32; nsegs | digest's low half << 32
    if not (((words[:, 0] & _NO_FLAGS) == np.uint64(key)).all() and (words[:, 1] == np.uint64(seq & _U64)).all()
            and ((c2 & _LOW) == np.uint64(root & 0xFFFFFFFF)).all()):
        return False
    if digests and not (((c3 >> _32) == np.uint64(digest & 0xFFFFFFFF)).all()
                        and ((words[:, 4] & _LOW) == np.uint64(digest >> 32)).all()):
        return False
    table = (c2 >> _32) * _4 + (c3 & _LOW) * _8
    if not (table <= room).all() or (words[:, 5] & _SIGN).any():  # total's sign bit: byte 43
        return False
    return cap is None or bool(((words[:, 4] >> _32) | ((words[:, 5] & _LOW) << _32) <= np.uint64(cap)).all())


def _uniform(raw: memoryview | bytes | bytearray, count: int, slot_size: int, common: bytes | bytearray,
             odd: int) -> bool:
    """Whether every slot but ``odd`` is ``common``, byte for byte (memcmp, no Python per slot)."""
    data = raw if isinstance(raw, (bytes, bytearray)) else bytes(raw)
    if len(data) < count * slot_size:
        return False
    rep = memoryview(bytes(common) * count)
    if odd < 0:
        return data.startswith(rep)
    return data.startswith(rep[: odd * slot_size]) and data.startswith(rep[(odd + 1) * slot_size :],
                                                                       (odd + 1) * slot_size)


_U64 = 2**64 - 1
_NO_FLAGS = np.uint64(~_FLAGS_BYTE & _U64)
_LOW, _SIGN = np.uint64(0xFFFFFFFF), np.uint64(1 << 31)
_32, _4, _8 = np.uint64(32), np.uint64(4), np.uint64(8)


@functools.lru_cache(maxsize=256)
def _table_struct(nparts: int, nsegs: int) -> struct.Struct:
    return struct.Struct(f"<{nparts}I{nsegs}q")


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of ALIGN."""
    return -(-n // ALIGN) * ALIGN


def _packed_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where each segment of a packed buffer starts (each at a multiple of ALIGN), and the total size."""
    offsets, pos = [], aligned(4 + 8 * len(sizes))
    for n in sizes:
        offsets.append(pos)
        pos = aligned(pos + n)
    return offsets, (pos if sizes else 4)


def pack(segments: Sequence[memoryview]) -> bytearray:
    """Concatenate segments into one buffer with their sizes in front (count u32, sizes i64).

    Each segment starts at a multiple of ALIGN bytes from the buffer's start, so a receiver whose
    buffer is aligned gets aligned segments (zero padding between them).
    """
    out = bytearray(packed_size(segments))
    pack_into(memoryview(out), segments)
    return out


def packed_size(segments: Sequence[memoryview]) -> int:
    """The size of ``pack(segments)``."""
    return _packed_offsets([s.nbytes for s in segments])[1]


def pack_into(out: memoryview, segments: Sequence[memoryview]) -> None:
    """``pack(segments)`` written into ``out`` (exactly ``packed_size(segments)`` bytes, zeroed)."""
    offsets, _ = _packed_offsets([s.nbytes for s in segments])
    _U32.pack_into(out, 0, len(segments))
    for i, (s, at) in enumerate(zip(segments, offsets, strict=True)):
        I64.pack_into(out, 4 + 8 * i, s.nbytes)
        out[at : at + s.nbytes] = flat(s)


def unpack(buf: memoryview) -> list[memoryview]:
    """Split a packed buffer back into zero-copy views. Raises FrameError if malformed."""
    mv = flat(buf)
    n = mv.nbytes
    if n < 4:
        raise FrameError("packed segment shorter than its count")
    (count,) = _U32.unpack_from(mv, 0)
    head = 4 + 8 * count
    if head > n:
        raise FrameError(f"packed segment claims {count} segments, too many for {n} bytes")
    sizes = [I64.unpack_from(mv, 4 + 8 * i)[0] for i in range(count)]
    if any(size < 0 or size > n for size in sizes):
        raise FrameError("packed segment size out of range")
    offsets, total = _packed_offsets(sizes)
    if total != n:
        raise FrameError(f"packed segment is {n} bytes, its table says {total}")
    return [mv[at : at + size] for at, size in zip(offsets, sizes, strict=True)]


_WORD_OFFSET = HEADER_SIZE + 4 + 8  # one part of one segment: its count, its entry, then its bytes


@functools.lru_cache(maxsize=64)
def _word_dtype(slot_size: int) -> np.dtype[Any]:
    return np.dtype({"names": ["nparts", "nsegs", "total", "entry", "word"],
                     "formats": ["<u4", "<u4", "<i8", "<i8", "<i8"],
                     "offsets": [20, 24, 36, HEADER_SIZE + 4, _WORD_OFFSET], "itemsize": slot_size})


def inline_words(raw: memoryview | bytes | bytearray, count: int, slot_size: int) -> np.ndarray[Any, Any]:
    """The 8 inline bytes each of ``count`` slots carries as its only segment, as int64 values.

    For slots already checked by ``headers``. Raises FrameError naming the first slot that doesn't
    hold exactly one inline segment of 8 bytes.
    """
    arr = np.frombuffer(raw, dtype=_word_dtype(slot_size), count=count)
    bad = (arr["nparts"] != 1) | (arr["nsegs"] != 1) | (arr["total"] != 8) | (arr["entry"] != -9)
    if bad.any():
        raise FrameError(f"slot {int(np.flatnonzero(bad)[0])} doesn't carry one 8-byte value")
    words: np.ndarray[Any, Any] = arr["word"].copy()
    return words


def carry_room(slot_size: int) -> int:
    """The most bytes a slot carries inline as its only segment (``inline_payloads``)."""
    return slot_size - _WORD_OFFSET


def inline_payloads(raw: memoryview | bytes | bytearray, count: int, slot_size: int,
                    nbytes: int) -> np.ndarray[Any, Any]:
    """The ``nbytes`` inline bytes each of ``count`` slots carries as its only segment: a (count,
    nbytes) uint8 array, a copy (the slots are the transport's, reused by the next call).

    For slots already checked by ``headers``. Raises FrameError naming the first slot that doesn't
    hold exactly one inline segment of ``nbytes`` bytes."""
    if not 0 < nbytes <= carry_room(slot_size):
        raise FrameError(f"{nbytes} bytes don't fit inline in a slot of {slot_size}")
    arr = np.frombuffer(raw, dtype=_payload_dtype(slot_size, nbytes), count=count)
    bad = (arr["nparts"] != 1) | (arr["nsegs"] != 1) | (arr["total"] != nbytes) | (arr["entry"] != -(nbytes + 1))
    if bad.any():
        raise FrameError(f"slot {int(np.flatnonzero(bad)[0])} doesn't carry one {nbytes}-byte payload")
    rows: np.ndarray[Any, Any] = arr["data"].copy()
    return rows


@functools.lru_cache(maxsize=64)
def _payload_dtype(slot_size: int, nbytes: int) -> np.dtype[Any]:
    return np.dtype({"names": ["nparts", "nsegs", "total", "entry", "data"],
                     "formats": ["<u4", "<u4", "<i8", "<i8", ("u1", (nbytes,))],
                     "offsets": [20, 24, 36, HEADER_SIZE + 4, _WORD_OFFSET], "itemsize": slot_size})


class Slots:
    """The slots of one exchange, decoded on first use: a rank decodes only the slots it reads."""

    def __init__(self, raw: memoryview | bytes, size: int, me: int, mine: Slot | None) -> None:
        self._raw, self._size = raw, size
        self._done: dict[int, Slot] = {} if mine is None else {me: mine}

    def totals(self, count: int) -> np.ndarray[Any, Any]:
        """Every slot's total (the bytes of its segments, inline ones included), as int64s: one
        strided view, no decode. For slots that passed agreement (OK, totals not negative)."""
        view: np.ndarray[Any, Any] = np.ndarray((count,), dtype="<i8", buffer=self._raw, offset=TOTAL_AT,
                                                strides=(self._size,))
        out: np.ndarray[Any, Any] = view.copy()
        return out

    def __getitem__(self, r: int) -> Slot:
        got = self._done.get(r)
        if got is None:
            try:
                got = self._done[r] = decode(self._raw[r * self._size : (r + 1) * self._size])
            except FrameError as e:
                raise FrameError(f"slot from rank {r} is corrupt: {e}", ranks=[r]) from e
        return got
