"""What the header exchange costs a rank in bytes, shared by the tests that count bytes per call."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import distcomm
from distcomm._transfer.header_exchange import SUMMARY_CARRY, summary_size
from distcomm._wire import frame as _frame

MiB = 1 << 20


def _children(m: int, v: int) -> int:
    """gloo's binomial broadcast in a group of m: how many ranks rank v (from the root) sends to."""
    return sum(1 for k in range(m.bit_length()) if 2**k > v and v + 2**k < m)


def _one(n: int) -> list[list[int]]:
    """The header exchange's blocks in a gloo world on one machine: one block, a gather on rank 0."""
    return [list(range(n))]


def _header_bytes(r: int, n: int, blocks: list[list[int]] | None, table: bool = False,
                  carry: int = SUMMARY_CARRY) -> tuple[int, int]:
    """What the header exchange costs rank r of n, sent and received: Bruck's all-gather (the
    doubles: ``blocks`` None), or gloo's exchange over ``blocks``. Up: a gather in each block to its
    first rank, and one of the blocks' tables (padded to the widest block) from those ranks to rank
    0. Down: gloo's binomial broadcasts of a summary (the common slot and the odd one) to the
    blocks' first ranks, then within each block, and when the slots differ more (``table``) of the
    whole table after it. ``carry``: the summary's room for a broadcast (one machine's, by default)."""
    slot = _frame.HEADER_SLOT
    if blocks is None:
        return (n - 1) * slot, (n - 1) * slot
    i, block = next((i, b) for i, b in enumerate(blocks) if r in b)
    pos, leaders, wide = block.index(r), len(blocks), max(len(b) for b in blocks) * slot
    sent = received = 0
    if len(block) > 1:
        if pos == 0:
            received += (len(block) - 1) * slot
        else:
            sent += slot
    lead = pos == 0 and leaders > 1
    if lead:
        if i == 0:
            received += (leaders - 1) * wide
        else:
            sent += wide
    for down in [summary_size(slot, carry)] + ([n * slot] if table else []):
        if lead:
            sent += _children(leaders, i) * down
            received += down if i else 0
        if len(block) > 1:
            sent += _children(len(block), pos) * down
            received += down if pos else 0
    return sent, received


_ONE_KIB_OOB = distcomm.PickleSerializer(oob_threshold=1024)


@contextlib.contextmanager
def two_levels_from_five_ranks() -> Iterator[None]:
    """Communicators made meanwhile on hosts of one rank exchange headers in two levels from 5
    ranks, as they do beyond ``FLAT_WORLD`` (a world of 33 or more), so that small test worlds
    exercise the two-level groups."""
    from distcomm._transfer import header_exchange as _header_exchange

    flat = _header_exchange.FLAT_WORLD
    _header_exchange.FLAT_WORLD = _frame.SMALL_WORLD
    try:
        yield
    finally:
        _header_exchange.FLAT_WORLD = flat


def count_calls(comm: distcomm.Communicator, method: str) -> list[int]:
    """From now on, count ``comm``'s calls of ``method`` (in the returned list's one item)."""
    calls, inner = [0], getattr(comm, method)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return inner(*args, **kwargs)

    setattr(comm, method, counted)
    return calls


def count_exchanges(comm: distcomm.Communicator) -> list[int]:
    """From now on, count the slots' exchanges ``comm`` makes (in the returned list's one item)."""
    return count_calls(comm, "_exchange_slots")
