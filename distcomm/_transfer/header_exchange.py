"""The header exchange: every rank's slot in native collectives beyond small worlds, in two
levels over blocks of ranks (the machines, or rank 0 and runs of sqrt(world) ranks), ending in a
short summary that rank 0 broadcasts when the slots are alike but for one (with room for a small
broadcast's payload). The torch transports' ``_exchange_slots`` beyond small worlds."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from .._errors import FrameError
from .._wire import frame as _frame
from .._wire.frame import I64

if TYPE_CHECKING:
    from .._torch import _TorchCommunicator

__all__ = ["SUMMARY_CARRY", "SUMMARY_CARRY_ACROSS", "HeaderBufs", "binomial_children", "expand", "gather_headers",
           "header_blocks", "summarize", "summary_size", "table_index"]


SUMMARY_CARRY = 376
"""The bytes of a broadcast's payload from rank 0 that the header exchange's summary carries in a
world on one machine (``summary_size``): a broadcast from rank 0 of up to this many bytes after
its slot (a seed, a dict of a few dozen numbers, a short list of names) takes the exchange's two
native calls and no third. Every exchange's summary has room for them, at any op (its size can't
depend on what the ranks agree on before they have agreed): at a slot of 64 bytes, a summary of 512."""

SUMMARY_CARRY_ACROSS = 64
"""``SUMMARY_CARRY`` in a world across machines (a seed, a flag, a step count, a short name): there
the summary crosses the network on every call, each of the blocks' first ranks sending it to each
of its children, so it stays short (a barrier's busiest rank then sends 1.8x torch's on the wire at
8 hosts, against 1.7x with no room at all and 2.6x with the room of one machine)."""


def summary_size(size: int, carry: int) -> int:
    """The header exchange's summary for slots of ``size`` bytes: the odd rank + 1, the common
    slot, the odd slot (``summarize``), then ``carry`` bytes of a broadcast's payload."""
    return 8 + 2 * size + carry


def summarize(table: bytes | bytearray | memoryview, world: int, size: int, out: memoryview) -> int:
    """Write into ``out`` (8 + 2 * size bytes or more) the short form of a table of ``world`` slots
    when all but at most one are alike: the odd rank + 1 (0: none), the common slot, the odd slot
    (zeros: none); else -1. Bytes of ``out`` beyond those are left as they are.
    Returns the odd rank (-1: none; -2: the slots differ more).

    In bytes comparisons (memcmp) of the table against itself shifted by one slot: slots a..b-1
    are alike when the bytes of slots a..b-2 equal those of slots a+1..b-1. One comparison for a
    table with no odd slot, two with slot 0 odd (a broadcast from rank 0), a binary search of
    log2(world) prefixes for another odd slot. A ``bytes`` or ``bytearray`` table of exactly
    ``world`` slots is read in place, with nothing allocated; anything else is copied once."""
    data = table if isinstance(table, (bytes, bytearray)) and len(table) == world * size else \
        bytes(table[: world * size])
    if len(data) != world * size:
        raise ValueError(f"a table of {world} slots of {size} bytes needs {world * size} bytes, got {len(data)}")
    rows = memoryview(data)

    def alike(a: int, b: int) -> bool:  # slots a..b-1 are all the same
        return b - a <= 1 or data.startswith(rows[(a + 1) * size : b * size], a * size)

    odd, common = -1, 0
    # (the two common cases inline: every slot alike; every slot but slot 0, a broadcast from rank 0)
    if world > 1 and not data.startswith(rows[size:], 0):
        if world >= 3 and data.startswith(rows[2 * size :], size):
            odd, common = 0, 1
        else:  # the first slot unlike slot 0, then whether every slot after it is slot 0 again
            lo, hi = 1, world - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if alike(0, mid + 1):
                    lo = mid + 1
                else:
                    hi = mid
            rest = lo + 1
            back = rest == world or (alike(rest, world) and data.startswith(rows[:size], rest * size))
            odd = lo if back else -2
    I64.pack_into(out, 0, odd + 1 if odd >= -1 else -1)
    if odd == -2:
        return odd
    out[8 : 8 + size] = rows[common * size : (common + 1) * size]
    # no odd slot: zeros, not the slot of an earlier call's summary (``out`` is reused from call to call)
    out[8 + size : 8 + 2 * size] = rows[odd * size : (odd + 1) * size] if odd >= 0 else bytes(size)
    return odd


def expand(summary: memoryview, world: int, size: int) -> memoryview:
    """The table of ``world`` slots that a summary (``summarize``'s, not -1) stands for: the common
    slot repeated, the odd one in its place. One allocation, filled by repeated memcpy."""
    odd = I64.unpack_from(summary, 0)[0] - 1
    if not -1 <= odd < world:
        raise FrameError(f"the header exchange's summary names rank {odd} as the odd one, in a world of {world}")
    table = bytearray(summary[8 : 8 + size]) * world
    if odd >= 0:
        table[odd * size : (odd + 1) * size] = summary[8 + size : 8 + 2 * size]
    return memoryview(table)


MACHINE_BLOCK_MAX = 64
FLAT_WORLD = 32
"""Worlds of machines of one rank each, of up to this many ranks, exchange headers in one block: a
gather on rank 0 and gloo's binomial broadcast, two native calls and 1 + log2(world) hops, against
four calls and as many hops in two levels (rank 0 takes one 64-byte slot from each rank)."""


def header_blocks(world: int, machines: list[list[int]]) -> list[list[int]]:
    """The blocks of the header exchange (``gather_headers``): each block's
    first rank gathers its block's slots, and rank 0 gathers those blocks' tables from their first
    ranks. The machines, when each holds two ranks or more (and at most ``MACHINE_BLOCK_MAX``): the
    first level then stays inside each machine, and one machine is one block (a gather on rank 0);
    else (machines of one rank, or too large) rank 0 alone, and the other ranks in runs of
    ceil(sqrt(world - 1)) consecutive ranks: no rank handles more than about 2 sqrt(world)
    messages, and rank 0, which every table reaches, takes only the runs' tables (one message per
    run, not a run of its own as well)."""
    if world <= _frame.SMALL_WORLD or (world <= FLAT_WORLD and max(len(m) for m in machines) == 1):
        return [list(range(world))]
    if min(len(m) for m in machines) >= 2 and max(len(m) for m in machines) <= MACHINE_BLOCK_MAX \
            and machines[0][0] == 0:
        return [list(m) for m in machines]
    b = math.isqrt(world - 2) + 1
    return [[0]] + [list(range(i, min(i + b, world))) for i in range(1, world, b)]


def table_index(blocks: list[list[int]], world: int) -> np.ndarray[Any, Any] | None:
    """Where each rank's slot lies in the tables rank 0 gathers from the blocks' first ranks (block
    by block, each as long as the longest block): index[r] is rank r's row. None when those tables
    are the table itself (blocks of consecutive ranks, in order, all of one length), so they can
    land in it as they are."""
    per = max(len(b) for b in blocks)
    if all(b == list(range(i * per, (i + 1) * per)) for i, b in enumerate(blocks)) and len(blocks) * per == world:
        return None
    index = np.empty(world, dtype=np.intp)
    for i, b in enumerate(blocks):
        index[b] = np.arange(i * per, i * per + len(b))
    return index


Call = tuple[Callable[..., Any], tuple[Any, ...], str, int, int]
"""A native call of the header exchange: its post, its arguments but the options, the kind of
its options, the bytes it sends and receives on this rank."""


class Calls:
    """A run of the header exchange's native calls (``post_calls``), made once per layout: with
    the bytes they move on this rank, and each one's post and arguments with the options of the
    last timeout they ran with (a deadline's shrinking timeout makes them again, from the cache of
    options)."""

    __slots__ = ("calls", "posts", "received", "sent", "timeout")

    def __init__(self, calls: list[Call]) -> None:
        self.calls = calls
        self.sent, self.received = sum(c[3] for c in calls), sum(c[4] for c in calls)
        self.timeout: float | None = None
        self.posts: list[tuple[Callable[..., Any], tuple[Any, ...]]] | None = None


class HeaderBufs(NamedTuple):
    """One rank's buffers for the header exchange (``make_header_bufs``)."""

    table: bytearray | None  # rank 0: the table's memory
    out: torch.Tensor  # the table (every rank's slot, in rank order); rank 0's over ``table``
    view: memoryview  # of ``out``
    mine: torch.Tensor  # this rank's row of ``out``: what it sends in its block
    held: torch.Tensor  # what it sends up to rank 0 (a block's first rank: its block's slots)
    up: Calls  # the native calls up: in the block, then among the blocks' first ranks
    take: tuple[Any, Any, Any] | None  # rank 0, where the blocks' tables aren't laid out as the table:
    # np.take's (blocks' tables, index, the table), as numpy arrays over the buffers
    down: Calls  # the summary's way down: to the blocks' first ranks, then within each block
    down_table: Calls  # the table's, the same way, when the summary says it follows
    summary: torch.Tensor
    sview: memoryview  # of ``summary``
    carry: memoryview  # the summary's room for a broadcast's payload from rank 0 (_summary_carry bytes)


@functools.lru_cache(maxsize=4096)
def binomial_children(m: int, v: int) -> int:
    """How many ranks gloo's binomial broadcast in a group of ``m`` has rank ``v`` (from the root)
    send to: v + 2**k for every 2**k > v."""
    return sum(1 for k in range(m.bit_length()) if 2**k > v and v + 2**k < m)


def gather_headers(comm: _TorchCommunicator, slot: bytearray, size: int, timeout: float | None,
                    carry: Sequence[memoryview] = ()) -> tuple[memoryview, Any]:
    """Every rank's slot, in native collectives over the blocks of ``header_blocks``, in two levels.

    Up: each block's first rank gathers its block's slots (one message from each rank), and rank 0
    gathers those tables from the blocks' first ranks. Down: rank 0 broadcasts a short summary
    when every slot but at most one is the same (agreement-only calls, broadcast, scatter: the
    common slot and the odd one), or else the whole table after the summary that says so: to the
    blocks' first ranks, each of which broadcasts it in its block (gloo's binomial trees).
    When rank 0 is a broadcast's root and its slot the odd one, the summary also carries the
    segments that follow its slot (``carry``), where they fit (``SUMMARY_CARRY``; across
    machines ``SUMMARY_CARRY_ACROSS``).
    A rank alone in its block, or that leads none, makes two native calls (three with the table);
    one that leads a block of several, four (six). With one block (set-up, small worlds) it is a
    gather and a broadcast."""
    world, me, block = comm._world, comm._rank, comm._block
    b = comm._header_bufs.get(size)
    if b is None:
        b = comm._header_bufs[size] = make_header_bufs(comm, size)
    b.view[me * size : (me + 1) * size] = slot
    if comm._leader_group is not None and block == [me]:  # it leads a block of its own
        b.held[:size] = b.mine
    # rank 0, a broadcast's root: its payload into the summary's room now, before any native
    # call (nothing of the user's runs between them); read only where the summary then says so
    n = sum(seg.nbytes for seg in carry) if b.table is not None else 0
    if 0 < n <= b.carry.nbytes:
        pos = 0
        for seg in carry:
            b.carry[pos : pos + seg.nbytes] = _frame.flat(seg)
            pos += seg.nbytes
    post_calls(comm, b.up, timeout)
    if b.take is not None:  # rank 0: one pass in C over the blocks' tables, not a step per block
        src, index, dst = b.take
        np.take(src, index, axis=0, out=dst)
    sview = b.sview
    if b.table is not None:  # rank 0
        summarize(b.table, world, size, sview)
    post_calls(comm, b.down, timeout)
    odd = I64.unpack_from(sview, 0)[0] - 1
    comm._carry = b.carry if odd == 0 else None
    # what the summary says of the table, for the pipeline's agreement (``_frame.agreed``)
    alike = None if odd == -2 else (odd, bytes(sview[8 : 8 + size]))
    if odd == -2:
        post_calls(comm, b.down_table, timeout)
    elif me != 0:  # the table the summary stands for (this rank's own slot is in it, as rank 0 got it)
        return expand(sview, world, size), alike
    return b.view, alike


def post_calls(comm: _TorchCommunicator, run: Calls, timeout: float | None) -> None:
    posts = run.posts
    if posts is None or run.timeout != timeout:
        posts = run.posts = [(post, (*args, comm._opts(kind, timeout, root=0)))
                             for post, args, kind, _, _ in run.calls]
        run.timeout = timeout
    comm._count(run.sent, run.received)
    for post, args in posts:
        comm._native(post, args, timeout)


def make_header_bufs(comm: _TorchCommunicator, size: int) -> HeaderBufs:
    """The header exchange's buffers for slots of ``size`` bytes in this rank's place in the
    blocks, the views the native gathers fill and each native call's arguments: made once,
    reused by every call (as the small worlds' all-to-all reuses its buffers), so that a call
    makes no view per block or per rank. What the pipeline reads of the table it deserializes,
    and so copies, before the collective returns; a transport failure breaks the communicator,
    so no abandoned collective writes into them under a later call."""
    world, me, blocks, block = comm._world, comm._rank, comm._blocks, comm._block
    i, pos = comm._place
    # rank 0's table is a bytearray: its summary compares it as bytes, in place (no copy). It is
    # never resized (torch.frombuffer holds a reference to it, not an export).
    table = bytearray(world * size) if me == 0 else None
    out = torch.empty(world * size, dtype=torch.uint8) if table is None else \
        torch.frombuffer(table, dtype=torch.uint8)
    mine = out[me * size : (me + 1) * size]
    leaders = comm._leader_group if block[0] == me else None
    wide = max(len(b) for b in blocks) * size
    held = torch.zeros(wide, dtype=torch.uint8) if leaders is not None else mine  # what this rank sends up
    up: list[Call] = []
    if len(block) > 1:
        into = held if leaders is not None else out
        outs = [[into[j * size : (j + 1) * size] for j in range(len(block))]] if pos == 0 else []
        up.append((comm._block_group.gather, (outs, [mine]), "GatherOptions",
                   0 if pos == 0 else size, (len(block) - 1) * size if pos == 0 else 0))
    take = None
    if leaders is not None:
        outs = []
        if me == 0:  # the blocks' tables land in the table itself where they are laid out as it is
            index = comm._table_index
            into = out if index is None else torch.empty(len(blocks) * wide, dtype=torch.uint8)
            outs = [[into[j * wide : (j + 1) * wide] for j in range(len(blocks))]]
            if index is not None:
                take = (into.numpy().reshape(-1, size), index, out.numpy().reshape(world, size))
        up.append((leaders.gather, (outs, [held]), "GatherOptions",
                   0 if me == 0 else wide, (len(blocks) - 1) * wide if me == 0 else 0))
    # odd rank + 1 (0: none; -1: the table follows), the common slot, the odd one, the room for a broadcast
    summary = torch.zeros(summary_size(size, comm._summary_carry), dtype=torch.uint8)

    def down(buf: torch.Tensor) -> Calls:  # rank 0's buf to the blocks' first ranks, then in each block
        n = buf.numel()
        return Calls([(group.broadcast, ([buf],), "BroadcastOptions", binomial_children(members, v) * n,
                        0 if v == 0 else n)
                       for group, members, v in ((leaders, len(blocks), i), (comm._block_group, len(block), pos))
                       if group is not None and members > 1])

    sview = memoryview(summary.numpy())  # type: ignore[arg-type]
    return HeaderBufs(table, out, memoryview(out.numpy()), mine, held, Calls(up),  # type: ignore[arg-type]
                       take, down(summary), down(out), summary, sview, sview[8 + 2 * size :])
