"""FakeCommunicator: one rank under test, the other ranks scripted, the real pipeline in between."""

from __future__ import annotations

import datetime
import functools
import inspect
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _frame
from .._communicator import (
    _COLLECTIVES,
    _I64,
    _ROUTE,
    Communicator,
    Op,
    _all_to_all_problem,
    _broadcast_tree,
    _dict_problem,
    _dict_signature,
    _reduce_digest,
    _Slots,
    _tensor_fields,
    _tree_gather_totals,
)
from .._serialization import failure_text

__all__ = ["Call", "FakeCommunicator"]

PeerFn = Callable[[str, int, Any], Any]

_TENSOR_OPS = (Op.ALL_REDUCE, Op.REDUCE, Op.BROADCAST_TENSOR, Op.ALL_GATHER_TENSOR, Op.REDUCE_SCATTER_TENSOR)


@dataclass(frozen=True)
class Call:
    """One recorded collective: its name, its arguments, and what it returned (or raised)."""

    op: str
    args: dict[str, Any]
    result: Any = None
    error: BaseException | None = None


def _same(op: str, rank: int, obj: Any) -> Any:
    return obj


class FakeCommunicator(Communicator):
    """A communicator for one rank under test: no threads, no processes.

    ``peers(op, rank, obj)`` returns what rank ``rank`` contributes to the collective ``op``
    ("all_gather", "gather", "broadcast", "scatter", "reduce_dict", "all_reduce_dict"), given the
    object the rank under test passed; the default contributes the same object. Peers' objects go
    through the real pipeline (serialized, framed, transferred, deserialized), so an unpicklable
    object fails here as in a job, and results have the shapes the real communicators return.

    Every collective is recorded in ``calls`` for assertions.

    Args:
        rank: the rank under test.
        world_size: the size of the pretend world.
        peers: scripts the other ranks (see above).
        local_rank, local_size: what the properties report (default: rank and world_size).
        **kwargs: Communicator options (timeout, serializer, max_bytes, slot_bytes).
    """

    _alone = False  # objects go through the serializer and the pipeline at every world size

    def __init__(self, rank: int = 0, world_size: int = 1, *, peers: PeerFn | None = None,
                 local_rank: int | None = None, local_size: int | None = None, **kwargs: Any) -> None:
        for name, v, low in (("rank", rank, 0), ("world_size", world_size, 1)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"{name} must be an int >= {low}, got {v!r}")
        if rank >= world_size:
            raise ValueError(f"rank={rank} is out of range for world_size={world_size}")
        super().__init__(**kwargs)
        self._rank, self._size = rank, world_size
        self._local = (rank if local_rank is None else local_rank, world_size if local_size is None else local_size)
        self._peers: PeerFn = peers or _same
        self.calls: list[Call] = []
        self._depth = 0
        self._ctx: tuple[Op, int, Any] = (Op.BARRIER, -1, None)
        self._pending: dict[int, deque[memoryview]] = {}
        self._peer_segs: dict[int, list[memoryview]] = {}  # each peer's gather segments, for the tree
        self._peer_dicts: dict[int, Mapping[Any, torch.Tensor]] = {}
        self._names: list[Any] = []
        self._tensor_ctx: tuple[Op, str | None, Any] = (Op.ALL_REDUCE, None, None)
        self._fold_ctx: tuple[Op, str, Callable[[Any, Any], Any]] = (Op.REDUCE_OBJECT, "", lambda a, b: a)
        self._step1: dict[int, Any] = {}

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    # ------------------------------------------------------------------ recording
    def _record(self, op: str, args: dict[str, Any], fn: Callable[[], Any]) -> Any:
        self._depth += 1
        try:
            result = fn()
        except BaseException as e:
            if self._depth == 1:
                self.calls.append(Call(op, args, None, e))
            raise
        finally:
            self._depth -= 1
        if self._depth == 0:
            self.calls.append(Call(op, args, result))
        return result

    # ------------------------------------------------------------------ the scripted peers
    def _reduce_dict(self, input_dict: Mapping[Any, torch.Tensor], average: bool, dst: int | None,
                     timeout: float | datetime.timedelta | None) -> dict[Any, torch.Tensor]:
        label = "reduce_dict" if dst is not None else "all_reduce_dict"
        if isinstance(input_dict, Mapping):
            self._peer_dicts = {r: self._peers(label, r, input_dict) for r in range(self._size) if r != self._rank}
            try:
                self._names = sorted(input_dict)
            except TypeError:
                self._names = list(input_dict)
        return super()._reduce_dict(input_dict, average, dst, timeout)

    def _run(self, op: Op, root: int, obj: Any, timeout: float | None, **kwargs: Any) -> list[Any]:
        self._ctx = (op, root, obj)
        return super()._run(op, root, obj, timeout, **kwargs)

    def _tensor_op(self, op: Op, root: int, tensor: torch.Tensor, rop: str | None, check: bool,
                   timeout: float | datetime.timedelta | None) -> torch.Tensor:
        self._tensor_ctx = (op, rop, tensor)
        return super()._tensor_op(op, root, tensor, rop, check, timeout)

    def _reduce_objects(self, op: Op, obj: Any, name: str, fn: Callable[[Any, Any], Any], root: int,
                        timeout: float | datetime.timedelta | None) -> Any:
        self._fold_ctx = (op, name, fn)
        self._step1 = {self._rank: obj}
        return super()._reduce_objects(op, obj, name, fn, root, timeout)

    def _peer_tensor(self, r: int, tensor: Any) -> Any:
        out = self._peers(self._tensor_ctx[0].label, r, tensor)
        return out.to(tensor.device) if isinstance(out, torch.Tensor) and isinstance(tensor, torch.Tensor) else out

    def _gather_tensors(self, tensor: torch.Tensor, timeout: float | None) -> list[torch.Tensor]:
        out = [tensor if r == self._rank else self._peer_tensor(r, tensor) for r in range(self._size)]
        return [v.reshape(1) if v.dim() == 0 and tensor.dim() == 1 else v for v in out]  # 0-d: one row

    def _make_sub(self, groups: list[list[int]], mine: list[int] | None, timeout: float | None) -> Communicator | None:
        if mine is None:
            return None
        peers = self._peers
        return FakeCommunicator(mine.index(self._rank), len(mine), **self._sub_settings(timeout),
                                peers=lambda op, r, obj: peers(op, mine[r], obj))

    def _peer_slot(self, r: int, size: int) -> bytearray:
        """Peer r's slot for the call in progress; queues what r then sends to the rank under test."""
        op, root, obj = self._ctx
        seq = self._seq
        if op in (Op.BARRIER, Op.REDUCE_DICT, Op.ALL_REDUCE_DICT):
            digest = 0
            if op is not Op.BARRIER:
                problem = _dict_problem(self._peer_dicts[r])[1]  # a real peer would report its dict unfit
                if problem is not None:
                    return self._status_slot(r, _frame.INVALID, problem, size)
                digest = _reduce_digest(*_dict_signature(self._peer_dicts[r]))
            return _frame.encode(op, seq, root, digest, [], size)
        if op in _TENSOR_OPS:
            _, rop, own = self._tensor_ctx
            theirs = self._peer_tensor(r, own)
            problem = self._tensor_input_problem(op, theirs, rop)
            if problem is not None:
                return self._status_slot(r, _frame.INVALID, problem, size)
            digest, word = _tensor_fields(op, theirs, rop, None)
            return _frame.encode(op, seq, root, digest, [[memoryview(word)]], size)
        if op is Op.ALL_TO_ALL:
            return self._all_to_all_slot(r, obj, size)
        if op is Op.KEYS:
            names, shapes, work_dtype = _dict_signature(self._peer_dicts[r])
            pobj: Any = ([repr(k) for k in names], shapes, str(work_dtype))
        elif op is Op.TENSOR_INFO:
            _, rop, own = self._tensor_ctx
            theirs = self._peer_tensor(r, own)
            pobj = (str(theirs.dtype), tuple(theirs.shape), rop)
        elif op is Op.RESULT or op is Op.RESULTS:
            pobj = None
            if r == root:  # the root peer folds what every rank contributed, as a real root would
                fop, name, fn = self._fold_ctx
                objs = [self._step1[i] for i in range(self._size)]
                pobj = self._fold_payload(fop, objs, name, fn, root)
                if fop is Op.REDUCE_OBJECT and pobj[0]:
                    pobj = (True, None)
        else:
            pobj = self._peers(op.label, r, obj)
            if op in (Op.REDUCE_OBJECT, Op.ALL_REDUCE_OBJECT, Op.SCAN, Op.EXSCAN):
                self._step1[r] = pobj
            elif op is Op.SPLIT and pobj is obj:
                # unscripted: new_group's members are known; split puts every peer in this rank's color
                color, _, members = obj
                pobj = ((None if r not in members else 0) if members is not None else color, r, members)
        kind = _ROUTE[op]
        if kind is Op.SCATTER and r == root and (not isinstance(pobj, Sequence) or len(pobj) != self._size):
            raise ValueError(
                f"FakeCommunicator: scatter from src={root} needs the src's list of {self._size} objects: pass "
                f"it on the rank under test too, or script it with peers=")
        parts, status, message = self._serialize_local(op, root, pobj, rank=r)
        if status == _frame.OK and (over := self._over_max_bytes(sum(s.nbytes for p in parts for s in p))):
            status, message = _frame.TOO_LARGE, over  # what the peer's own check would report
        if status != _frame.OK:
            return self._status_slot(r, status, message, size)
        me = self._rank
        if kind is Op.SCATTER:
            if r != root:
                return _frame.encode(op, seq, root, 0, [], size)
            part_slot = self._scatter_slot_size(parts, root, size)
            built = [self._build_slot(op, seq, root, 0, [p], part_slot) for p in parts]  # as that root builds them
            status, message = self._scatter_slots_problem([d for _, _, d in built])
            if status != _frame.OK:
                return self._status_slot(r, status, message, size)
            sub, mine, decoded = built[me]
            if self._size <= _frame.SMALL_WORLD:  # the slot of this rank's part comes in the exchange
                self._feed(r, self._later(decoded, mine, 0))
                return sub
            self._feed(r, [memoryview(sub), *self._later(decoded, mine, 0)])
            return self._scatter_head(op, seq, root, 0, part_slot, size)[0]
        slot, parts, decoded = self._build_slot(op, seq, root, 0, parts, size)
        if kind is Op.GATHER and parts:
            self._peer_segs[r] = parts[0]  # every segment, should the gather go up the tree
        if kind is Op.BROADCAST:
            if r == root and me != root:  # the root's bytes reach this rank down the broadcast's tree
                self._feed_broadcast(root, self._later(decoded, parts, 0))
        elif kind is not Op.GATHER or me == root:
            self._feed(r, self._later(decoded, parts, 0))
        return slot

    def _feed_broadcast(self, root: int, later: list[memoryview]) -> None:
        """What ``_tree_send`` brings this rank: its half from its parent, the other from its mate."""
        world = self._size
        v = (self._rank - root) % world
        total = sum(seg.nbytes for seg in later)
        split = total > self._BCAST_ONE_BUFFER and world > 2
        tree = _broadcast_tree(world, v, split)
        if tree.other is None:
            self._feed(((tree.parent or 0) + root) % world, later)
            return
        stream = memoryview(b"".join(later))
        half = total // 2
        mine, other = (stream[half:], stream[:half]) if tree.second else (stream[:half], stream[half:])
        self._feed(((tree.parent or 0) + root) % world, [mine])
        self._feed((tree.other + root) % world, [other])

    def _status_slot(self, r: int, status: int, message: str, size: int) -> bytearray:
        op, root, _ = self._ctx
        full = _frame.message_bytes(message)
        if len(full) > size - _frame.HEADER_SIZE:  # the rest of a long message follows the slots
            self._feed(r, [memoryview(full)])
        return _frame.encode_status(status, op, self._seq, root, message, size)

    def _all_to_all_slot(self, r: int, objs: Any, size: int) -> bytearray:
        """Peer r's all_to_all: its slot, then its part's size and its part for the rank under test."""
        theirs = self._peers("all_to_all", r, objs)
        problem = _all_to_all_problem(theirs, self._size)  # what that rank's own check would report
        if problem is not None:
            return self._status_slot(r, _frame.INVALID, problem, size)
        try:
            segments = [[] if d == r else self.serializer.dumps(o) for d, o in enumerate(theirs)]
        except Exception as e:
            sent = [None if d == r else o for d, o in enumerate(theirs)]  # that rank's own entry stays there
            return self._status_slot(r, _frame.SERIALIZE_FAILED, failure_text(self.serializer, sent, e, "objs"), size)
        over = self._over_max_bytes(sum(_frame.packed_size(segs) for d, segs in enumerate(segments) if d != r))
        if over is not None:
            return self._status_slot(r, _frame.TOO_LARGE, over, size)
        part = _frame.pack(segments[self._rank])
        self._feed(r, [memoryview(_I64.pack(len(part))), memoryview(part)])
        return _frame.encode(Op.ALL_TO_ALL, self._seq, -1, 0, [], size)

    @staticmethod
    def _later(slot: _frame.Slot, parts: list[list[memoryview]], p: int) -> list[memoryview]:
        """The segments of part ``p`` that travel after the slot (as ``_build_slot`` decoded it)."""
        table = slot.parts[p]
        return [seg for (_, inline), seg in zip(table, parts[p], strict=True) if inline is None and seg.nbytes]

    def _feed(self, src: int, views: list[memoryview]) -> None:
        self._pending.setdefault(src, deque()).extend(memoryview(v).cast("B") for v in views)

    # ------------------------------------------------------------------ transport
    def _allgather_slots(self, slot: bytearray, size: int, timeout: float | None,
                         own: Sequence[bytearray] = ()) -> memoryview:
        if own and self._size > _frame.SMALL_WORLD:
            raise ValueError(f"slots of each rank's own are sent in worlds of up to {_frame.SMALL_WORLD} ranks")
        self._pending = {}
        self._peer_segs = {}
        rows = [slot if r == self._rank else self._peer_slot(r, size) for r in range(self._size)]
        self._count(size * (self._size - 1), size * (self._size - 1))
        raw = memoryview(b"".join(rows))
        op, root, _ = self._ctx
        if _ROUTE[op] is Op.GATHER and self._size > _frame.SMALL_WORLD and all(row[5] == _frame.OK for row in rows):
            totals = _tree_gather_totals(_Slots(raw, size, 0, None), self._size, root, self._TREE_GATHER_BYTES)
            if totals is not None:
                self._feed_tree(root, totals)
        return raw

    def _feed_tree(self, root: int, totals: Any) -> None:
        """What this rank's children in ``_tree_gather``'s tree send it: each child's subtree's
        segments, in rank order, as one stream."""
        self._pending = {}
        world = self._size
        v = (self._rank - root) % world
        low = v & -v if v else 1 << max(world - 1, 1).bit_length()
        end, k = min(v + low, world), 1
        while k < low and v + k < world:
            ranks = [(u + root) % world for u in range(v + k, min(v + 2 * k, end))]
            if sum(int(totals[r]) for r in ranks):
                self._feed((v + k + root) % world, [seg for r in ranks for seg in self._peer_segs.get(r, [])])
            k *= 2

    def _exchange(
        self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]], timeout: float | None
    ) -> None:
        for src, buf in recvs:  # what src sends, as one stream of bytes, cut to the buffers posted
            out, filled = buf.numpy(), 0
            queue = self._pending[src]
            while filled < out.nbytes:
                seg = queue.popleft()
                take = min(seg.nbytes, out.nbytes - filled)
                out[filled : filled + take] = seg[:take]
                if take < seg.nbytes:
                    queue.appendleft(seg[take:])
                filled += take

    def _reduce_tensor(self, tensor: torch.Tensor, dst: int | None, timeout: float | None) -> None:
        total = torch.zeros_like(tensor)
        for r in range(self._size):
            if r == self._rank:
                total += tensor
            else:
                d = self._peer_dicts[r]
                total += torch.cat([torch.as_tensor(d[k]).detach().reshape(-1) for k in self._names]).to(tensor)
        if dst is None or dst == self._rank:
            tensor.copy_(total)


# Every public collective is recorded in ``calls`` with its arguments (but timeout and check).


def _recorded(name: str) -> Callable[..., Any]:
    base = getattr(Communicator, name)
    sig = inspect.signature(base)

    @functools.wraps(base)
    def method(self: FakeCommunicator, *args: Any, **kwargs: Any) -> Any:
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        recorded = {k: v for k, v in bound.arguments.items() if k not in ("self", "timeout", "check")}
        return self._record(name, recorded, lambda: base(self, *args, **kwargs))

    return method


for _name in _COLLECTIVES:
    setattr(FakeCommunicator, _name, _recorded(_name))
