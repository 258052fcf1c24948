"""The same error on every rank: what the ranks compare after the first exchange, and the reports
(call sites, mismatch tables, failed ranks' messages) that name who differs."""

from __future__ import annotations

import hashlib
import os
import struct
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._calls import Op
from ._errors import CollectiveError, CollectiveMismatchError, PayloadTooLargeError, SerializationError
from ._wire import frame as _frame

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["AGREEMENT_PIECES", "agree", "agreed_by_sums", "agreement_vector", "check_settings", "digest_of", "odd_ones",
           "spans", "states_table", "where"]

def agree(comm: Communicator, op: Op, seq: int, root: int, heads: Any, slots: _frame.Slots, message: str,
           timeout: float | None, cap: int | None) -> None:
    """Raise the same error on every rank when ranks disagree or any rank failed.

    The common case is a few comparisons over the header array; rows are built for errors only.
    """
    # compared with rank 0's (which is this rank's when they all agree): every rank names the same ranks
    first = heads[0]
    same = (heads["op"] == first["op"]) & (heads["seq"] == first["seq"]) & (heads["root"] == first["root"])
    if not same.all():
        # read before the call sites' exchange, which may reuse the buffer that ``heads`` views
        calls = list(zip(heads["op"].tolist(), heads["seq"].tolist(), heads["root"].tolist(), strict=True))
        sites = gather_sites(comm, timeout)
        rows = {}
        for r, (hop, hseq, hroot) in enumerate(calls):
            name = Op(hop).label if hop in Op._value2member_map_ else f"op {hop}"
            where = f" root={hroot}" if hroot >= 0 else ""
            rows[r] = f"{name}{where} (call #{hseq}) at {sites[r]}"
        odd = odd_ones(calls)
        raise CollectiveMismatchError(
            "ranks called different collectives:\n" + states_table(rows, comm.world_size), op=op.label,
            ranks=odd)
    bad = heads["status"] != _frame.OK
    if not bad.any():
        if cap is not None:  # a peer that skipped its check: refused alike
            over = np.flatnonzero(heads["total"] > cap).tolist()
            if over:
                raise PayloadTooLargeError(
                    f"{op.label} #{seq}: rank{'s' if len(over) > 1 else ''} {', '.join(map(str, over))} "
                    f"announced payloads over max_bytes={comm.max_bytes}", op=op.label, ranks=over)
        return
    failed = [(r, slots[r]) for r in np.flatnonzero(bad).tolist()]
    texts = full_messages(comm, failed, message, timeout)
    lines = "\n".join(f"  rank {r}: {texts[r]}" for r, _ in failed)
    ranks = [r for r, _ in failed]
    statuses = {s.header.status for _, s in failed}
    what = f"{op.label} #{seq} failed on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}:\n{lines}"
    if statuses == {_frame.TOO_LARGE}:
        raise PayloadTooLargeError(what, op=op.label, ranks=ranks)
    if statuses == {_frame.SERIALIZE_FAILED}:
        raise SerializationError(what, op=op.label, ranks=ranks)
    raise CollectiveError(what, op=op.label, ranks=ranks)


def gather_sites(comm: Communicator, timeout: float | None) -> list[str]:
    """Every rank's call site for the call in progress (an error-path exchange, every rank alike)."""
    size = 256
    mine = where(comm._site).encode("utf-8", "replace")[: size - 2]
    slot = bytearray(struct.pack("<H", len(mine)) + mine + bytes(size - 2 - len(mine)))
    flat, _ = comm._exchange_slots(slot, size, timeout)
    out = []
    for r in range(comm.world_size):
        raw = bytes(flat[r * size : (r + 1) * size])
        (n,) = struct.unpack_from("<H", raw)
        out.append(raw[2 : 2 + min(n, size - 2)].decode("utf-8", "replace"))
    return out


def full_messages(comm: Communicator, failed: list[tuple[int, _frame.Slot]], message: str,
                   timeout: float | None) -> dict[int, str]:
    """The failed ranks' messages; those cut short by the slot are sent whole, to every rank."""
    texts = {r: s.message for r, s in failed}
    cut = [(r, s) for r, s in failed if s.later]
    if not cut:
        return texts
    me = comm.rank
    sends = []
    if any(r == me for r, _ in cut):
        raw = torch.frombuffer(bytearray(_frame.message_bytes(message)), dtype=torch.uint8)
        sends = [(r, raw) for r in range(comm.world_size) if r != me]
    recvs = [(r, torch.empty(s.header.total, dtype=torch.uint8)) for r, s in cut if r != me]
    comm._exchange_counted(sends, recvs, timeout)
    for r, buf in recvs:
        texts[r] = bytes(buf.numpy()).decode("utf-8", "replace")
    if any(r == me for r, _ in cut):
        texts[me] = _frame.message_bytes(message).decode("utf-8", "replace")
    return texts


def where(site: tuple[str, int]) -> str:
    return f"{os.path.basename(site[0])}:{site[1]}"


def spans(ranks: list[int]) -> str:
    """'rank 3' or 'ranks 0-2, 5'."""
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(parts)}"


def states_table(states: Mapping[int, str | None], world: int) -> str:
    """One line per distinct state, naming its ranks; ranks absent from ``states`` gave no report."""
    groups: dict[str, list[int]] = {}
    for r in range(world):
        text = states.get(r)
        groups.setdefault(text if text else "no report (not in a collective when this rank gave up, or gone)",
                          []).append(r)
    return "\n".join(f"  {spans(ranks)}: {text}" for text, ranks in groups.items())


def odd_ones(values: Sequence[Any]) -> list[int]:
    """The ranks whose value differs from the one most ranks have (the lowest rank's among equals)."""
    usual = max(values, key=values.count)
    return [r for r, v in enumerate(values) if v != usual]


def check_settings(everyone: list[dict[str, Any]]) -> None:
    """Raise the same error on every rank when the ranks' settings differ."""
    for name in everyone[0]:
        values = [s.get(name) for s in everyone]
        if len(set(map(repr, values))) > 1:
            rows = "\n".join(f"  rank {r}: {name}={v!r}" for r, v in enumerate(values))
            raise CollectiveMismatchError(
                f"the ranks created their communicators with different {name}; every rank must pass "
                f"the same:\n{rows}", op="setup",
                ranks=[r for r, v in enumerate(values) if repr(v) != repr(values[0])])


def digest_of(value: Any) -> int:
    """An 8-byte digest of ``repr(value)``, compared across ranks in the first exchange."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little")


# ---------------------------------------------------------------- agreement in a fixed-size reduction
# On a transport whose reductions are cheap and whose object exchange is not (NCCL, where the slots
# cross machines over gloo's TCP), every collective starts with one sum of a fixed-size vector: each
# rank's "ok" and three 20-bit pieces of a digest of its call (op, call number, root, digest), each
# with its square. The sums tell every rank the same thing: whether all ranks are fine and called
# the same thing. Agreement-only calls (a barrier, a reduction's keys and shapes) then need nothing
# else; on any disagreement every rank goes on to the slots' exchange, which names who differs.
AGREEMENT_PIECES = 3
_PIECE_BITS = 20


def agreement_vector(op: int, seq: int, root: int, digest: int, ok: bool, words: bytes = b"") -> list[int]:
    """This rank's contribution: [ok, x1, x1², x2, x2², x3, x3²] for the pieces x of a digest of
    the call and of the 8 bytes a call may let differ (``words``: alike too, when the sums agree)."""
    key = struct.pack("<iqiQ", op, seq, root, digest) + words
    h = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    out = [int(ok)]
    for i in range(AGREEMENT_PIECES):
        x = (h >> (i * _PIECE_BITS)) & ((1 << _PIECE_BITS) - 1)
        out += [x, x * x]
    return out


def agreed_by_sums(sums: list[int], world: int) -> bool:
    """Whether every rank's vector was fine and alike, from the sums: for integers x,
    n·Σx² - (Σx)² = Σ over pairs of (x_i - x_j)², zero exactly when all are equal (no overflow:
    each square is below 2^40, so the sums stay exact in int64 up to 2^23 ranks)."""
    if sums[0] != world:
        return False
    return all(world * sums[2 + 2 * i] == sums[1 + 2 * i] ** 2 for i in range(AGREEMENT_PIECES))
