"""Snapshots of a sharded job's state, each rank's copy held by its neighbour, so that a job with
no whole replica (plain FSDP) outlives a lost rank without a checkpoint on disk.

``comm.snapshot(model, optimizer, progress)`` after each step copies this rank's part of the
state (its DTensors' local shards, and what isn't a tensor) into host memory, then, on a thread of
its own over a group of its own (a ``dup`` of the membership's communicator: its messages never
meet the training's collectives), sends that copy to its *holder* and takes its predecessor's.
The holder of job rank r is the next rank, (r + 1) % W; in a job over several machines of L ranks
each, the rank at the same local index on the next machine, (r + L) % W, so that one lost machine
loses no copy it held of another's.

Each rank keeps its own two newest copies and the two newest it holds for its predecessor: the
copy being written never leaves it without a complete one. A copy is complete once all its bytes
are in; what the restore takes (``_elastic.restore``) is the newest step that every rank's own copy
or its holder's copy is complete for.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from .._errors import is_rank_loss
from .snapshot_copy import Copy, HostCopies

if TYPE_CHECKING:
    from .._communicator import Communicator
    from .._torch import _TorchCommunicator

__all__ = ["Snapshots", "holder_of", "snapshots_of"]

_SIZES_TAG = 0x3FFF_5B00  # (the exchange's tags, apart from the state calls')
_HEADER_TAG = 0x3FFF_5B01
_BYTES_TAG = 0x3FFF_5B02
_GLOO_TAG_BASE = 1 << 30  # (distcomm's point-to-point tags sit above torch's own)


def holder_of(job_rank: int, world: int, local_size: int) -> int:
    """The job rank that holds ``job_rank``'s copies: the same local index on the next machine
    where the job spans several machines of ``local_size`` ranks, else the next rank."""
    stride = local_size if 0 < local_size < world and world % local_size == 0 else 1
    return (job_rank + stride) % world


class Snapshots:
    """The copies one rank keeps: its own and its predecessor's, two steps of each."""

    def __init__(self) -> None:
        self.own: list[Copy | None] = [None, None]
        self.held: list[Copy | None] = [None, None]
        self.held_for: int | None = None
        """The job rank whose copies ``held`` are."""
        self.holders: dict[int, int] = {}
        """Each job rank's holder, as the last exchange had them."""
        self.step = 0
        """The loop's step, as this rank counts it: its calls of ``snapshot`` (set back by a restore).
        A snapshot is labelled with it: ranks that snapshot in step label alike."""
        self.restoring = False
        """Set by a shrink that found no whole replica: the next ``sync_state`` restores."""
        self._channel: Communicator | None = None
        self._of: Communicator | None = None
        self._sending: threading.Thread | None = None
        self._failed: BaseException | None = None
        self._copying = HostCopies()

    # ------------------------------------------------------------ taking one
    def take(self, comm: Communicator, objects: tuple[object, ...], every: int = 1) -> None:
        """``Communicator.snapshot``: copy this rank's state to host memory and hand it to the
        exchange's thread. Waits for the previous exchange first (each rank's exchanges pair with
        its neighbours', step by step); raises what it met where that was a lost rank of this
        membership (the loop's shrink follows). Only every ``every``-th call takes one."""
        self.step += 1
        if self.step % every:
            return
        self.settle()
        failed, self._failed = self._failed, None
        if failed is not None and self._of is comm:
            raise failed
        if self._of is not comm:  # (a dup is a collective: every member is here)
            self._channel = comm.dup() if comm.world_size > 1 and _exchanges(comm) else None
            self._of = comm
        self._copying.guard(objects)
        ring = self._ring(comm) if self._channel is not None else None
        i = self._older_index(self.own)  # (emptied first: while it is written, the other is the complete copy)
        old, self.own[i] = self.own[i], None
        copy, rest = self._copying.start(objects, self.step, old)
        self.own[i] = copy
        self._sending = threading.Thread(target=self._background, args=(rest, copy, ring),
                                         name="distcomm-snapshot", daemon=True)
        self._sending.start()

    def _ring(self, comm: Communicator) -> tuple[int, int, int]:
        """This rank's holder and predecessor (its ranks in ``comm``), and the predecessor's job rank;
        every member's holder is kept (what a shrink asks: ``unrestorable``)."""
        job = comm.membership.job_ranks
        n, me, local = len(job), comm.rank, _local_size(comm)
        self.holders = {job[i]: job[holder_of(i, n, local)] for i in range(n)}
        prv = next(i for i in range(n) if holder_of(i, n, local) == me)
        return holder_of(me, n, local), prv, job[prv]

    def settle(self) -> None:
        """Wait for the exchange in flight (a shrink or an admit breaks it where a rank is lost)."""
        if self._sending is not None:
            self._sending.join()
            self._sending = None

    @staticmethod
    def _older_index(slots: list[Copy | None]) -> int:
        """The slot a new copy overwrites (its buffer reused): the empty or older one."""
        steps = [c.step if c is not None else -1 for c in slots]
        return steps.index(min(steps))

    # ------------------------------------------------------------ the exchange with the neighbours
    def _background(self, rest: Callable[[], None], copy: Copy, ring: tuple[int, int, int] | None) -> None:
        """The snapshot's thread: the rest of the host copy (``rest``: what only an optimizer's step
        changes), then the exchange: ``copy`` to this rank's holder, its predecessor's taken, at once
        (a ring: every rank sends and receives). What it meets is kept for ``take``."""
        try:
            self._copying.finish(rest)
            if ring is not None and self._channel is not None:
                self._swap(self._channel, copy, *ring)
        except BaseException as e:  # (kept, not raised: a thread's error would go to stderr and nowhere else)
            failed = e if is_rank_loss(e) else RuntimeError(f"snapshot: its exchange failed: {e}")
            if failed is not e:
                failed.__cause__ = e
            self._failed = failed

    def _swap(self, channel: Communicator, copy: Copy, nxt: int, prv: int, prv_job: int) -> None:
        """The sizes first (a predecessor's shards may be another size), then the copies."""
        copy.wait()
        mine = torch.tensor([copy.step, len(copy.header), copy.flat.numel()], dtype=torch.int64)
        theirs = torch.zeros(3, dtype=torch.int64)
        _both(channel, prv, [theirs], nxt, [mine], _SIZES_TAG)
        step, header_len, flat_len = (int(v) for v in theirs.tolist())
        i = self._older_index(self.held) if self.held_for == prv_job else 0
        if self.held_for != prv_job:  # (a new predecessor: the copies held are another rank's)
            self.held, self.held_for = [None, None], prv_job
        old, self.held[i] = self.held[i], None  # (emptied first: while it is written, the other is complete)
        flat = old.flat if old is not None and old.flat.numel() == flat_len else torch.empty(flat_len,
                                                                                            dtype=torch.uint8)
        header = torch.empty(header_len, dtype=torch.uint8)
        _both(channel, prv, [header, flat], nxt, [torch.frombuffer(bytearray(copy.header), dtype=torch.uint8),
                                                  copy.flat], _HEADER_TAG)
        self.held[i] = Copy(step, header.numpy().tobytes(), flat)

    # ------------------------------------------------------------ what a restore reads
    def catalogue(self, job_rank: int) -> tuple[int, list[int], int | None, list[int]]:
        """This rank's complete copies: (its job rank, its own steps, whose copies it holds, their steps)."""
        self.settle()
        return (job_rank, sorted(c.step for c in self.own if c is not None), self.held_for,
                sorted(c.step for c in self.held if c is not None))

    def own_at(self, step: int) -> Copy:
        return next(c for c in self.own if c is not None and c.step == step)

    def held_at(self, step: int) -> Copy:
        return next(c for c in self.held if c is not None and c.step == step)

    def restored(self, step: int, holders: dict[int, int], objects: tuple[object, ...] | None) -> None:
        """The job went back to ``step``: newer copies are of a state that no longer is; ``holders``:
        who holds a copy of whom now (alike on every rank); ``objects``: the state a replacement
        just received, kept as its own copy of ``step`` (so that a loss before the next snapshot
        finds every rank's own copy)."""
        self.own = [c if c is not None and c.step <= step else None for c in self.own]
        self.held = [c if c is not None and c.step <= step else None for c in self.held]
        if objects is not None:
            copy, rest = self._copying.start(objects, step, None)
            self._copying.finish(rest)
            self.own = [copy, None]
        self.step, self.holders, self.restoring = step, holders, False

    def unrestorable(self, lost: tuple[int, ...]) -> str:
        """Why the copies can't bring back the job ranks ``lost``, or "": none taken yet, or a lost
        rank's holder lost with it."""
        if not self.holders:  # (alike on every rank: set as each snapshot is taken, and by a restore)
            return "no snapshot was taken yet (comm.snapshot after each step)"
        unheld = [r for r in lost if r not in self.holders]
        if unheld:
            return f"no copy of rank(s) {unheld} is held yet: the rank that held it was replaced since"
        gone = [(r, self.holders[r]) for r in lost if self.holders[r] in lost]
        if gone:
            pairs = ", ".join(f"rank {r}'s copies were held by rank {h}" for r, h in gone)
            return f"their snapshots went with them ({pairs}, lost too)"
        return ""


def _both(channel: Communicator, src: int, into: list[torch.Tensor], dst: int, out: list[torch.Tensor],
          tag: int) -> None:
    """Receive ``into`` from ``src`` and send ``out`` to ``dst``, all at once, on ``channel``'s group
    (watched: a peer that is gone fails the wait)."""
    from .waits import wait_watched  # (imported here: the waits import the membership, which imports this)

    torch_comm: _TorchCommunicator = channel  # type: ignore[assignment]
    group = torch_comm._obj_group
    works, peers = [], []
    for t in (t for t in into if t.numel()):
        works.append(group.recv([t], torch_comm._at(src), _GLOO_TAG_BASE + tag))
        peers.append(src)
    for t in (t for t in out if t.numel()):
        works.append(group.send([t], torch_comm._at(dst), _GLOO_TAG_BASE + tag))
        peers.append(dst)
    wait_watched(torch_comm, works, torch_comm._op_timeout(None), peers, f"send to rank {dst} (snapshot)")


def _exchanges(comm: Communicator) -> bool:
    """Whether ``comm``'s transport carries the exchange: torch's groups (an in-process world keeps
    host copies only, and its shrink restores none)."""
    return hasattr(comm, "_obj_group")


def _local_size(comm: Communicator) -> int:
    try:
        return int(comm.local_size)
    except Exception:  # (a communicator that doesn't know its machines: one ring over the ranks)
        return comm.world_size


def snapshots_of(comm: Communicator) -> Snapshots | None:
    """The job's snapshots, kept with its mesh (they are of its shards); made at the first snapshot."""
    mesh = comm._mesh
    if mesh is None:
        return None
    if mesh.snapshots is None:
        mesh.snapshots = Snapshots()
    return mesh.snapshots

