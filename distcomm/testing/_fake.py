"""FakeCommunicator: one rank under test, the other ranks scripted, the real pipeline in between."""

from __future__ import annotations

import functools
import inspect
import struct
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .._calls import CallSpec, Op
from .._communicator import COLLECTIVES, Communicator
from .._ops import fold_tensors, object_op, tensor_op
from .._ordering import results_problem
from .._reductions import (
    as_tensors,
    dict_op,
    dict_problem,
    dict_signature,
    fold_payload,
    keys_info,
    reduce_digest,
    work_tensor,
)
from .._tensors import carried_bytes, tensor_fields, tensor_input_problem
from .._transfer.all_to_all import all_to_all_problem
from .._transfer.messages import encode, parse
from .._transfer.routes import BROADCAST, GATHER, ROUTES, SCATTER, build_slot, over_max_bytes
from .._transfer.routes.broadcast import received_from
from .._transfer.routes.gather import subtrees, tree_gather_totals
from .._transfer.routes.scatter import part_slot_size, parts_problem, scatter_head
from .._wire import frame as _frame
from .._wire.serialization import failure_text

__all__ = ["Call", "FakeCommunicator"]

PeerFn = Callable[[str, int, Any], Any]

_TENSOR_OPS = (Op.ALL_REDUCE, Op.REDUCE, Op.BROADCAST_TENSOR, Op.ALL_GATHER_TENSOR, Op.REDUCE_SCATTER_TENSOR)
_TENSOR_LABELS = {op.label for op in _TENSOR_OPS}  # the public methods' names too
_FOLD_OPS = (Op.REDUCE_OBJECT, Op.ALL_REDUCE_OBJECT, Op.SCAN, Op.EXSCAN)


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

    Point to point: ``recv(src, tag=t)`` receives ``peers("recv", src, t)``; without ``peers=`` it
    raises ValueError (no peer has anything to send). What ``send`` sends is loaded back and recorded
    as ``Call("send", {"obj", "dst", "tag"})``.

    Every collective is recorded in ``calls`` for assertions (messages too).

    Args:
        rank: the rank under test.
        world_size: the size of the pretend world.
        peers: scripts the other ranks (see above).
        local_rank, local_size: what the properties report (default: rank and world_size).
        **kwargs: Communicator options (timeout, serializer, max_bytes, slot_bytes).
    """

    _world_of_one_shortcut = False  # objects go through the serializer and the pipeline at every world size
    _moves_bytes = False  # (each message is recorded as the object it holds)

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
        # the public collective in progress, as the user called it: its name and arguments
        self._called: tuple[str, dict[str, Any]] = ("synchronize", {})
        self._pending: dict[int, deque[memoryview]] = {}  # what each peer sends the rank under test, in order
        self._peer_segs: dict[int, list[memoryview]] = {}  # each peer's gather segments, for the tree
        self._peer_dicts: dict[int, Mapping[Any, torch.Tensor]] = {}
        self._names: list[Any] = []
        self._step1: dict[int, Any] = {}  # an object reduction's objects, by rank
        self._in_order: dict[int, Any] = {}  # gather_in_order's peers' results, by rank
        self._inbox: dict[tuple[int, int], deque[memoryview]] = {}  # scripted messages' parts, by (src, tag)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._size

    # ------------------------------------------------------------------ recording
    def _record(self, op: str, args: dict[str, Any], fn: Callable[[], Any]) -> Any:
        self._depth += 1
        self._called = (op, args)
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
    def _user_reduce_op(self) -> str | None:
        """The reduce op of the tensor collective in progress, as its transport sees it."""
        name, args = self._called
        return tensor_op(args["op"]) if "op" in args and name in _TENSOR_LABELS else None

    def _dict_op(self) -> str:
        """The reduction of the reduce_dict in progress, as the user asked for it."""
        args = self._called[1]
        return dict_op(args.get("average", True), args.get("op"))

    def _start_exchange(self, spec: CallSpec) -> None:
        """Learn what the peers need to know of a collective before its first exchange."""
        op = spec.op
        if op in (Op.REDUCE_DICT, Op.ALL_REDUCE_DICT) and isinstance(spec.obj, Mapping):
            self._peer_dicts = {r: _as_dict_values(self._peers(op.label, r, spec.obj))
                                for r in range(self._size) if r != self._rank}
            try:
                self._names = sorted(spec.obj)
            except TypeError:
                self._names = list(spec.obj)
        elif op in _FOLD_OPS:
            self._step1 = {self._rank: spec.obj}

    def _peer_tensor(self, r: int, tensor: Any) -> Any:
        out = self._peers(self._called[0], r, tensor)
        return out.to(tensor.device) if isinstance(out, torch.Tensor) and isinstance(tensor, torch.Tensor) else out

    def _gather_tensors(self, tensor: torch.Tensor, timeout: float | None) -> list[torch.Tensor]:
        out = [tensor if r == self._rank else self._peer_tensor(r, tensor) for r in range(self._size)]
        return [v.reshape(1) if v.dim() == 0 and tensor.dim() == 1 else v for v in out]  # 0-d: one row

    def _make_sub(self, groups: list[list[int]], mine: list[int] | None, timeout: float | None) -> Communicator | None:
        if mine is None:
            return None
        peers = self._peers
        return FakeCommunicator(mine.index(self._rank), len(mine), **self._sub_settings(timeout),
                                peers=None if peers is _same else lambda op, r, obj: peers(op, mine[r], obj))

    def _peer_slot(self, r: int, size: int) -> bytearray:
        """Peer r's slot for the call in progress; queues what r then sends to the rank under test.
        Each family's collectives say how (``_PEER_SLOTS``); the others are routed objects."""
        spec = self._call
        assert spec is not None
        return _PEER_SLOTS.get(spec.op, FakeCommunicator._routed_slot)(self, spec, r, size)

    # ---- how a scripted peer's slot is built, per family (the table ``_PEER_SLOTS`` after the class)
    def _header_slot(self, spec: CallSpec, r: int, size: int) -> bytearray:
        """A header alone: synchronize, and reduce_dict's agreement on keys, shapes and op (with the
        peer's values where its call rides in its check, as a real rank's would)."""
        if spec.op is Op.SYNCHRONIZE:
            return _frame.encode(spec.op, self._seq, spec.root, 0, [], size)
        theirs, op = self._peer_dicts[r], self._dict_op()
        problem = dict_problem(theirs, op)[1]  # as that peer would report it
        if problem is not None:
            return self._status_slot(r, _frame.INVALID, problem, size)
        names, shapes, work_dtype, unsigned = dict_signature(theirs)
        segments = []
        if names:  # its values, where its call rides in its check
            work = work_tensor([torch.as_tensor(theirs[k]) for k in names], work_dtype, op).to(self.device)
            carried = carried_bytes(self, spec.op, work, op)
            segments = [[memoryview(carried)]] if carried is not None else []
        return _frame.encode(spec.op, self._seq, spec.root, reduce_digest(names, shapes, work_dtype, unsigned, op),
                             segments, size)

    def _count_slot(self, spec: CallSpec, r: int, size: int) -> bytearray:
        """gather_in_order's first exchange: each peer's count of its results (then a gather)."""
        if spec.serialize:
            return self._routed_slot(spec, r, size)
        args = self._called[1]
        theirs = self._in_order[r] = self._peers(spec.op.label, r, args["results"])
        problem = results_problem(theirs, args["size"], args["sharding"])
        if problem is not None:
            return self._status_slot(r, _frame.INVALID, problem, size)
        count = [[memoryview(struct.pack("<q", len(theirs)))]]
        return _frame.encode(spec.op, self._seq, spec.root, spec.digest, count, size)

    def _tensor_slot(self, spec: CallSpec, r: int, size: int) -> bytearray:
        """A tensor collective's check: the peer's tensor's digest and 8 bytes (or its bytes, where the
    call rides in its check)."""
        reduce_op = self._user_reduce_op()
        theirs = self._peer_tensor(r, spec.obj)
        problem = tensor_input_problem(self, spec.op, theirs, reduce_op)
        if problem is not None:
            return self._status_slot(r, _frame.INVALID, problem, size)
        digest, word = tensor_fields(spec.op, theirs, reduce_op, None)
        carried = carried_bytes(self, spec.op, theirs, reduce_op)  # (that rank decides from its own tensor)
        return _frame.encode(spec.op, self._seq, spec.root, digest, [[memoryview(carried or word)]], size)

    def _all_to_all_slot(self, spec: CallSpec, r: int, size: int) -> bytearray:
        """Peer r's all_to_all: its slot, then its part's size and its part for the rank under test."""
        theirs = self._peers("all_to_all", r, spec.obj)
        problem = all_to_all_problem(theirs, self._size)  # what that rank's own check would report
        if problem is not None:
            return self._status_slot(r, _frame.INVALID, problem, size)
        try:
            segments = [[] if d == r else self.serializer.dumps(o) for d, o in enumerate(theirs)]
        except Exception as e:
            sent = [None if d == r else o for d, o in enumerate(theirs)]  # that rank's own entry stays there
            return self._status_slot(r, _frame.SERIALIZE_FAILED, failure_text(self.serializer, sent, e, "objs"), size)
        over = over_max_bytes(self, sum(_frame.packed_size(segs) for d, segs in enumerate(segments) if d != r))
        if over is not None:
            return self._status_slot(r, _frame.TOO_LARGE, over, size)
        part = _frame.pack(segments[self._rank])
        self._feed(r, [memoryview(_frame.I64.pack(len(part))), memoryview(part)])
        return _frame.encode(Op.ALL_TO_ALL, self._seq, -1, 0, [], size)

    def _routed_slot(self, spec: CallSpec, r: int, size: int) -> bytearray:
        """An object that travels by its op's route: the peer's object (``_peer_object``), serialized
        and framed by the route's own code, and what the route's plan sends this rank after it."""
        op, root, seq = spec.op, spec.root, self._seq
        pobj = self._peer_object(spec, r)
        route = ROUTES[op]
        if route is SCATTER and r == root and (not isinstance(pobj, Sequence) or len(pobj) != self._size):
            raise ValueError(
                f"FakeCommunicator: scatter from src={root} needs the src's list of {self._size} objects: pass "
                f"it on the rank under test too, or script it with peers=")
        parts, status, message = route.serialize(self, root, pobj, r)
        if status == _frame.OK and (over := over_max_bytes(self, sum(s.nbytes for p in parts for s in p))):
            status, message = _frame.TOO_LARGE, over  # what the peer's own check would report
        if status != _frame.OK:
            return self._status_slot(r, status, message, size)
        if route is SCATTER:
            return self._scatter_slot(spec, r, parts, size)
        slot, parts, decoded = build_slot(op, seq, root, 0, parts, size)
        if route is GATHER and parts:
            self._peer_segs[r] = parts[0]  # every segment, should the gather go up the tree
        if route is BROADCAST:
            if r == root and self._rank != root:  # the root's bytes reach this rank down the broadcast's tree
                self._feed_broadcast(root, self._later(decoded, parts, 0))
        elif route is not GATHER or self._rank == root:
            self._feed(r, self._later(decoded, parts, 0))
        return slot

    def _peer_object(self, spec: CallSpec, r: int) -> Any:
        """What peer r contributes to a routed collective: scripted, or what a real peer would send
        on an exchange of another collective's (the error path's, an object reduction's outcome)."""
        op, obj = spec.op, spec.obj
        if op is Op.KEYS:
            return keys_info(*dict_signature(self._peer_dicts[r]), self._dict_op())
        if op is Op.TENSOR_INFO:
            theirs = self._peer_tensor(r, self._called[1]["tensor"])
            return str(theirs.dtype), tuple(theirs.shape), self._user_reduce_op(), theirs.device.type
        if op is Op.RESULT or op is Op.RESULTS:
            return self._fold_outcome(spec, r)
        if op is Op.GATHER and self._called[0] == "gather_in_order":
            return self._in_order[r]  # the results that peer counted
        pobj = self._peers(op.label, r, obj)
        if op in _FOLD_OPS:
            self._step1[r] = pobj
        elif op is Op.SPLIT and pobj is obj:
            # unscripted: new_group's members are known; split puts every peer in this rank's color
            color, _, members = obj
            pobj = ((None if r not in members else 0) if members is not None else color, r, members)
        return pobj

    def _fold_outcome(self, spec: CallSpec, r: int) -> Any:
        """An object reduction's outcome from its root peer, folded as a real root would (None off it)."""
        if r != spec.root:
            return None
        assert spec.stat is not None  # the reduction this result is of
        name, fn = object_op(self._called[1]["op"])
        pobj = fold_payload(spec.stat, [self._step1[i] for i in range(self._size)], name, fn, spec.root)
        return (True, None) if spec.stat is Op.REDUCE_OBJECT and pobj[0] else pobj

    def _scatter_slot(self, spec: CallSpec, r: int, parts: list[list[memoryview]], size: int) -> bytearray:
        """A scatter's slot from peer r: a header off the root; from the root, this rank's part as
        the root builds it (in its slot in small worlds, else after a header that announces it)."""
        op, root, seq, me = spec.op, spec.root, self._seq, self._rank
        if r != root:
            return _frame.encode(op, seq, root, 0, [], size)
        part_slot = part_slot_size(self, parts, root, size)
        built = [build_slot(op, seq, root, 0, [p], part_slot) for p in parts]  # as that root builds them
        status, message = parts_problem(self, [d for _, _, d in built])
        if status != _frame.OK:
            return self._status_slot(r, status, message, size)
        sub, mine, decoded = built[me]
        if self._size <= _frame.SMALL_WORLD:  # the slot of this rank's part comes in the exchange
            self._feed(r, self._later(decoded, mine, 0))
            return sub
        self._feed(r, [memoryview(sub), *self._later(decoded, mine, 0)])
        return scatter_head(op, seq, root, 0, part_slot, size)[0]

    def _feed_broadcast(self, root: int, later: list[memoryview]) -> None:
        """What the broadcast's tree brings this rank, from whom (the route's own plan of it)."""
        stream = memoryview(b"".join(later))
        for src, lo, hi in received_from(self, root, stream.nbytes):
            self._feed(src, [stream[lo:hi]])

    def _status_slot(self, r: int, status: int, message: str, size: int) -> bytearray:
        assert self._call is not None
        op, root = self._call.op, self._call.root
        full = _frame.message_bytes(message)
        if len(full) > size - _frame.HEADER_SIZE:  # the rest of a long message follows the slots
            self._feed(r, [memoryview(full)])
        return _frame.encode_status(status, op, self._seq, root, message, size)

    @staticmethod
    def _later(slot: _frame.Slot, parts: list[list[memoryview]], p: int) -> list[memoryview]:
        """The segments of part ``p`` that travel after the slot (as ``build_slot`` decoded it)."""
        table = slot.parts[p]
        return [seg for (_, inline), seg in zip(table, parts[p], strict=True) if inline is None and seg.nbytes]

    def _feed(self, src: int, views: list[memoryview]) -> None:
        self._pending.setdefault(src, deque()).extend(memoryview(v).cast("B") for v in views)

    # ------------------------------------------------------------------ transport
    def _allgather_slots(self, slot: bytearray, size: int, timeout: float | None,
                         own: Sequence[bytearray] = ()) -> memoryview:
        if own and self._size > _frame.SMALL_WORLD:
            raise ValueError(f"slots of each rank's own are sent in worlds of up to {_frame.SMALL_WORLD} ranks")
        spec = self._call
        assert spec is not None
        self._pending = {}
        self._peer_segs = {}
        self._start_exchange(spec)
        rows = [slot if r == self._rank else self._peer_slot(r, size) for r in range(self._size)]
        self._count(size * (self._size - 1), size * (self._size - 1))
        raw = memoryview(b"".join(rows))
        if (ROUTES[spec.op] is GATHER and self._size > _frame.SMALL_WORLD
                and all(row[5] == _frame.OK for row in rows)):
            totals = tree_gather_totals(_frame.Slots(raw, size, 0, None), self._size, spec.root,
                                        self._TREE_GATHER_BYTES)
            if totals is not None:
                self._feed_tree(spec.root, totals)
        return raw

    def _feed_tree(self, root: int, totals: Any) -> None:
        """What this rank's children in the gather's tree send it: each child's subtree's segments,
        in rank order, as one stream (the route's own tree)."""
        self._pending = {}
        world = self._size
        _, children = subtrees(world, (self._rank - root) % world)
        for first, end in children:
            ranks = [(u + root) % world for u in range(first, end)]
            if sum(int(totals[r]) for r in ranks):
                self._feed((first + root) % world, [seg for r in ranks for seg in self._peer_segs.get(r, [])])

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

    # Point-to-point messages: what a peer sends is scripted, ``peers("recv", src, tag)``; what the
    # rank under test sends is loaded back and recorded. Both go through the real encoding.
    def _send_message(self, dst: int, tag: int, parts: list[torch.Tensor], timeout: float | None) -> None:
        obj = parse(self, [memoryview(p.numpy()) for p in parts], f"send to rank {dst} (tag {tag})", self._rank)  # type: ignore[arg-type]
        self.calls.append(Call("send", {"obj": obj, "dst": dst, "tag": tag}))

    def _recv_message(self, src: int, tag: int, bufs: list[torch.Tensor], timeout: float | None) -> None:
        box = self._inbox.setdefault((src, tag), deque())
        if not box:  # the header of the next message: the scripted peer sends it now
            if self._peers is _same:  # (the rank under test passed no object a peer could echo)
                raise ValueError(f"FakeCommunicator: recv from rank {src} (tag {tag}): no peer is scripted to "
                                 f"send it; pass peers=fn, where fn('recv', {src}, {tag}) returns what {src} sends")
            obj = self._peers("recv", src, tag)
            box.extend(encode(self, obj, f"send from rank {src} (tag {tag})"))
            self.calls.append(Call("recv", {"src": src, "tag": tag}, obj))
        for buf in bufs:
            memoryview(buf.numpy())[:] = box.popleft()  # type: ignore[arg-type]

    def _reduce_tensor(self, tensor: torch.Tensor, dst: int | None, timeout: float | None) -> None:
        self._fold_dicts(tensor, dst, "sum")

    def _tensor_reduce(self, tensor: torch.Tensor, dst: int | None, op: str, timeout: float | None) -> None:
        if self._called[0] in ("reduce_dict", "all_reduce_dict"):  # its max or min: the peers' dicts
            self._fold_dicts(tensor, dst, op)
        else:
            super()._tensor_reduce(tensor, dst, op, timeout)

    def _fold_dicts(self, tensor: torch.Tensor, dst: int | None, op: str) -> None:
        """reduce_dict's reduction: this rank's values (``tensor``) with the peers' dicts' values."""
        values = [tensor if r == self._rank else work_tensor(
            [torch.as_tensor(self._peer_dicts[r][k]) for k in self._names], tensor.dtype, self._dict_op()).to(tensor)
            for r in range(self._size)]
        if dst is None or dst == self._rank:
            tensor.copy_(fold_tensors(values, op))


_PeerSlot = Callable[[FakeCommunicator, CallSpec, int, int], bytearray]
_PEER_SLOTS: dict[Op, _PeerSlot] = {
    **dict.fromkeys((Op.SYNCHRONIZE, Op.REDUCE_DICT, Op.ALL_REDUCE_DICT), FakeCommunicator._header_slot),
    Op.GATHER_IN_ORDER: FakeCommunicator._count_slot,
    **dict.fromkeys(_TENSOR_OPS, FakeCommunicator._tensor_slot),
    Op.ALL_TO_ALL: FakeCommunicator._all_to_all_slot,
}
"""How a scripted peer's slot is built for the collectives that don't travel as a routed object:
one builder per family. A collective of an existing family joins its builder's entry; a routed
collective needs none (``_routed_slot``, with ``_peer_object`` for what the peer contributes)."""


def _as_dict_values(d: Any) -> Any:
    return as_tensors(d) if isinstance(d, Mapping) else d


# Every public collective, and the membership calls, are recorded in ``calls`` with their arguments (but
# timeout and check).


def _recorded(name: str) -> Callable[..., Any]:
    base = getattr(Communicator, name)
    sig = inspect.signature(base)

    @functools.wraps(base)
    def method(self: FakeCommunicator, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if async_op is not False:  # queued: the worker calls this method again, which records it when it runs
            return base(self, *args, async_op=async_op, **kwargs)
        self._queues.turn()  # a blocking call waits for the queued ones before it records
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        recorded = {k: v for k, v in bound.arguments.items() if k not in ("self", "timeout", "check")}
        return self._record(name, recorded, lambda: base(self, *args, **kwargs))

    return method


for _name in (*COLLECTIVES, "shrink", "admit", "sync_state", "check_identical"):
    setattr(FakeCommunicator, _name, _recorded(_name))
