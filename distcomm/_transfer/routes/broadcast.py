"""broadcast: the root's object to every rank. Small payloads from rank 0 may ride in the first
exchange; the rest go down a tree into buffers of their exact size (split in two halves when
large, so that the root sends them once)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..._calls import CallSpec
from ..._errors import FrameError
from ..._wire import frame as _frame
from ..._wire.memory import as_view, byte_tensor
from .base import Incoming, Outgoing, Route, Segment, check_receivable

if TYPE_CHECKING:
    from ..._communicator import Communicator

__all__ = ["BroadcastRoute", "broadcast_tree", "received_from", "tree_send"]


class BroadcastRoute(Route):
    """broadcast (and shared_random_seed, and an object reduction's result): the root's part to every rank."""

    name = "broadcast"
    carries = True
    expects_common = True

    def serialize(self, comm: Communicator, root: int, obj: Any, rank: int) -> tuple[list[list[memoryview]], int, str]:
        if rank != root:  # only the root's object travels
            return [], _frame.OK, ""
        return super().serialize(comm, root, obj, rank)

    def carried(self, comm: Communicator, root: int, out: Outgoing) -> list[memoryview]:
        # the transport's exchange may end in a broadcast from the root that has room for them
        if comm.rank != root or out.status != _frame.OK or not out.mine.later:
            return []
        return [seg for seg, (_, inline) in zip(out.parts[0], out.tables[0], strict=True) if inline is None]

    def move(self, comm: Communicator, spec: CallSpec, seq: int, out: Outgoing, slots: _frame.Slots,
             size: int) -> Incoming:
        root = spec.root
        head = slots[root]
        got = tree_broadcast(comm, root, head, out.parts, spec.timeout)
        return ({root: got} if comm.rank != root else {}), {root: bool(head.header.flags & _frame.PACKED)}

    def own_result(self, comm: Communicator, root: int, obj: Any) -> Any:
        return obj if comm.rank == root else None


class Tree(NamedTuple):
    """One rank's place in a broadcast tree, as offsets from the root (v = rank - root)."""

    parent: int | None  # whom this rank's half comes from
    children: list[int]  # whom it forwards its half to
    mates: list[int]  # whom it also sends its half to: they hold the other half
    other: int | None  # whom the other half comes from
    second: bool = False  # this rank's half (from its parent) is the second one


def broadcast_tree(world: int, v: int, split: bool) -> Tree:
    """Where rank v (counted from the root) receives and sends a broadcast's bytes.

    ``split=False``: a binary tree (v's parent (v - 1) // 2, children 2v + 1 and 2v + 2), the whole
    payload down every edge; the root sends it twice. ``split=True``: the root sends the first half
    to a binary tree over ranks 1..a and the second half to one over a + 1..world - 1 (a =
    ceil((world - 1) / 2)); then rank i of each tree sends its half to rank i of the other, and the
    first tree's last rank, when it has no counterpart, gets the second half from the second tree's
    last rank (a leaf). The root sends the payload once, no rank sends more than 1.5 times it (and a
    byte, for an odd size), and every rank receives it once.
    """
    if not split or world < 3:
        kids = [c for c in (2 * v + 1, 2 * v + 2) if c < world]
        return Tree(None if v == 0 else (v - 1) // 2, kids, [], None)
    n = world - 1
    a = (n + 1) // 2
    b = n - a
    if v == 0:
        return Tree(None, [1, 1 + a], [], None)
    first = v <= a
    start, size = (1, a) if first else (1 + a, b)
    i = v - start
    parent = 0 if i == 0 else start + (i - 1) // 2
    kids = [start + c for c in (2 * i + 1, 2 * i + 2) if c < size]
    if first:
        mate = 1 + a + min(i, b - 1)  # the first tree's unmatched last rank: the second tree's last
        return Tree(parent, kids, [mate] if i < b else [], mate)
    mates = [1 + i] + ([1 + b] if i == b - 1 and a > b else [])
    return Tree(parent, kids, mates, 1 + i, second=True)


def _cut(bufs: list[torch.Tensor], lo: int, hi: int, step: int) -> list[torch.Tensor]:
    """Views of bytes [lo, hi) of ``bufs`` laid end to end, in pieces of at most ``step`` bytes."""
    out, pos = [], 0
    for b in bufs:
        n = b.numel()
        start, end = max(lo - pos, 0), min(hi - pos, n)
        for i in range(start, end, step):
            out.append(b[i : min(i + step, end)])
        pos += n
    return out


def tree_broadcast(
    comm: Communicator, root: int, slot: _frame.Slot, parts: list[list[memoryview]], timeout: float | None
) -> list[Segment]:
    """Move the root's segments that didn't fit its slot to every rank; returns this rank's
    segments (receivers: inline views and received buffers; the root: nothing it needs)."""
    if not slot.parts:
        raise FrameError(f"broadcast: rank {root} sent no parts", op="broadcast", ranks=[root])
    entries = slot.parts[0]
    total = slot.later if len(slot.parts) == 1 else sum(n for n, inline in entries if inline is None)
    me = comm.rank
    if me == root:
        if not total or comm._carried(root, total) is not None:  # nothing follows, or it went with the slots
            return []
        later = [byte_tensor(parts[0][i]) for i, (_, inline) in enumerate(entries) if inline is None]
        if total > comm._BCAST_ONE_BUFFER:
            tree_send(comm, later, root, timeout)
        else:
            comm._broadcast_buffer(later[0] if len(later) == 1 else torch.cat(later), root, timeout)
        return []
    if total > comm._BCAST_ONE_BUFFER:  # exact-size buffers of their own, down the binary tree
        for n, inline in entries:
            if inline is None:
                check_receivable(comm, n, root, "broadcast")
        bufs = [torch.empty(n, dtype=torch.uint8) for n, inline in entries if inline is None]
        tree_send(comm, bufs, root, timeout)
        it = iter(bufs)
        return [(inline, True) if inline is not None else (as_view(next(it)), False) for _, inline in entries]
    if not total:
        return [(inline, True) for _, inline in entries if inline is not None]
    # one buffer for the segments that follow the slot; a pickle stream alone (no out-of-band
    # buffers, which land in torch's aligned memory; a packed segment holds them) in a bytearray,
    # which is cheaper to make and view. ``view`` exports it for as long as a segment lives, so
    # nothing can resize it under the tensor (torch.frombuffer holds a reference, not an export).
    if len(entries) == 1 and not slot.header.flags & _frame.PACKED:
        mem = bytearray(total)
        buf, view = torch.frombuffer(mem, dtype=torch.uint8), memoryview(mem)
    else:
        buf = torch.empty(total, dtype=torch.uint8)
        view = as_view(buf)
    carried = comm._carried(root, total)
    if carried is None:
        comm._broadcast_buffer(buf, root, timeout)
    else:  # copied out of the exchange's buffers, which the next call reuses
        view[:] = carried
    pos, segs = 0, []
    for n, inline in entries:
        if inline is not None:
            segs.append((inline, True))
        else:
            segs.append((view[pos : pos + n], False))
            pos += n
    return segs


def tree_send(comm: Communicator, bufs: list[torch.Tensor], root: int, timeout: float | None) -> None:
    """Send the root's ``bufs`` into every rank's down a tree, in pipelined chunks.

    Payloads over ``_BCAST_ONE_BUFFER`` split in two halves, each down a binary tree of half the
    ranks, and the two trees then swap halves rank by rank (see ``broadcast_tree``): the root
    sends the payload once and no rank more than 1.5 times (and a byte). Smaller ones go down one
    binary tree.
    A chunk is forwarded while the next one arrives.
    """
    world = comm.world_size
    v = (comm.rank - root) % world
    total = sum(b.numel() for b in bufs)
    split = total > comm._BCAST_ONE_BUFFER and world > 2
    tree = broadcast_tree(world, v, split)
    step = max(comm._TREE_CHUNK, _frame.aligned(-(-total // comm._TREE_MAX_CHUNKS)))
    half = total // 2 if split else total
    first, second = _cut(bufs, 0, half, step), _cut(bufs, half, total, step)
    if v == 0:  # the root: half to each tree (split), or all of it to each child; a chunk per step,
        peers = [(c + root) % world for c in tree.children]  # each step within the timeout
        routes = [(peers[0], first), (peers[1], second)] if split else [(p, first) for p in peers]
        for i in range(max(len(first), len(second))):
            comm._exchange_counted([(p, chunks[i]) for p, chunks in routes if i < len(chunks)], [], timeout)
        return
    mine, other = (second, first) if tree.second else (first, second)
    ranks = [(c + root) % world for c in (*tree.children, *tree.mates)]
    parent = ((tree.parent or 0) + root) % world
    source = None if tree.other is None else (tree.other + root) % world
    for i in range(max(len(mine), len(other)) + 1):  # receive chunk i while chunk i - 1 goes on
        sends = [(r, mine[i - 1]) for r in ranks] if 0 < i <= len(mine) else []
        recvs = [(parent, mine[i])] if i < len(mine) else []
        if source is not None and 0 < i <= len(other):
            recvs.append((source, other[i - 1]))
        if sends or recvs:
            comm._exchange_counted(sends, recvs, timeout)


def received_from(comm: Communicator, root: int, total: int) -> list[tuple[int, int, int]]:
    """What this rank receives of a payload of ``total`` bytes that ``tree_send`` moves: (rank,
    first byte, end) per sender, its half from its parent and the other half from its mate."""
    world = comm.world_size
    v = (comm.rank - root) % world
    split = total > comm._BCAST_ONE_BUFFER and world > 2
    tree = broadcast_tree(world, v, split)
    parent = ((tree.parent or 0) + root) % world
    if tree.other is None:
        return [(parent, 0, total)]
    half = total // 2
    mine, other = ((half, total), (0, half)) if tree.second else ((0, half), (half, total))
    return [(parent, *mine), ((tree.other + root) % world, *other)]
