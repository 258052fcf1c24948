"""FakeCommunicator: one rank under test, the other ranks scripted, the real pipeline in between."""

from __future__ import annotations

import datetime
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .. import _frame
from .._communicator import Communicator, Op, _dict_signature, _reduce_digest

__all__ = ["Call", "FakeCommunicator"]

PeerFn = Callable[[str, int, Any], Any]


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
        self._peer_dicts: dict[int, Mapping[Any, torch.Tensor]] = {}
        self._names: list[Any] = []

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

    def synchronize(self, timeout: float | datetime.timedelta | None = None) -> None:
        self._record("synchronize", {}, lambda: super(FakeCommunicator, self).synchronize(timeout))

    def all_gather(self, obj: Any, *, timeout: float | datetime.timedelta | None = None) -> list[Any]:
        out: list[Any] = self._record("all_gather", {"obj": obj},
                                      lambda: super(FakeCommunicator, self).all_gather(obj, timeout=timeout))
        return out

    def gather(self, obj: Any, dst: int = 0, *, timeout: float | datetime.timedelta | None = None) -> list[Any]:
        out: list[Any] = self._record("gather", {"obj": obj, "dst": dst},
                                      lambda: super(FakeCommunicator, self).gather(obj, dst, timeout=timeout))
        return out

    def broadcast(self, obj: Any = None, src: int = 0, *, timeout: float | datetime.timedelta | None = None) -> Any:
        return self._record("broadcast", {"obj": obj, "src": src},
                            lambda: super(FakeCommunicator, self).broadcast(obj, src, timeout=timeout))

    def scatter(self, objs: Sequence[Any] | None = None, src: int = 0, *,
                timeout: float | datetime.timedelta | None = None) -> Any:
        return self._record("scatter", {"objs": objs, "src": src},
                            lambda: super(FakeCommunicator, self).scatter(objs, src, timeout=timeout))

    def shared_random_seed(self, *, timeout: float | datetime.timedelta | None = None) -> int:
        out: int = self._record("shared_random_seed", {},
                                lambda: super(FakeCommunicator, self).shared_random_seed(timeout=timeout))
        return out

    def reduce_dict(self, input_dict: Mapping[Any, torch.Tensor], average: bool = True, *,
                    timeout: float | datetime.timedelta | None = None) -> dict[Any, torch.Tensor]:
        out: dict[Any, torch.Tensor] = self._record(
            "reduce_dict", {"input_dict": input_dict, "average": average},
            lambda: super(FakeCommunicator, self).reduce_dict(input_dict, average, timeout=timeout))
        return out

    def all_reduce_dict(self, input_dict: Mapping[Any, torch.Tensor], average: bool = True, *,
                        timeout: float | datetime.timedelta | None = None) -> dict[Any, torch.Tensor]:
        out: dict[Any, torch.Tensor] = self._record(
            "all_reduce_dict", {"input_dict": input_dict, "average": average},
            lambda: super(FakeCommunicator, self).all_reduce_dict(input_dict, average, timeout=timeout))
        return out

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

    def _peer_slot(self, r: int, size: int) -> bytearray:
        """Peer r's slot for the call in progress; queues what r then sends to the rank under test."""
        op, root, obj = self._ctx
        seq = self._seq
        if op in (Op.BARRIER, Op.REDUCE_DICT, Op.ALL_REDUCE_DICT):
            digest = 0
            if op is not Op.BARRIER:
                digest = _reduce_digest(*_dict_signature(self._peer_dicts[r]))
            return _frame.encode(op, seq, root, digest, [], size)
        if op is Op.KEYS:
            names, shapes, work_dtype = _dict_signature(self._peer_dicts[r])
            pobj: Any = ([repr(k) for k in names], shapes, str(work_dtype))
        else:
            pobj = self._peers(op.label, r, obj)
        if op is Op.SCATTER and r == root and (not isinstance(pobj, Sequence) or len(pobj) != self._size):
            raise ValueError(
                f"FakeCommunicator: scatter from src={root} needs the src's list of {self._size} objects: pass "
                f"it on the rank under test too, or script it with peers=")
        parts, status, message = self._serialize_local(op, root, pobj, rank=r)
        if status != _frame.OK:
            full = _frame.message_bytes(message)
            if len(full) > size - _frame.HEADER_SIZE:  # the rest of a long message follows the slots
                self._feed(r, [memoryview(full)])
            return _frame.encode_status(status, op, seq, root, message, size)
        me = self._rank
        if op is Op.SCATTER:
            if r != root:
                return _frame.encode(op, seq, root, 0, [], size)
            sub, mine = self._build_slot(op, seq, root, 0, [parts[me]], size)
            self._feed(r, [memoryview(sub), *self._later(sub, mine, 0)])
            return _frame.encode(op, seq, root, 0, [], size)
        slot, parts = self._build_slot(op, seq, root, 0, parts, size)
        if op is Op.BROADCAST:
            v = (me - root) % self._size
            if r == root and v:  # the root's bytes reach this rank through its parent in the tree
                self._feed(((v - 1) // 2 + root) % self._size, self._later(slot, parts, 0))
        elif op is not Op.GATHER or me == root:
            self._feed(r, self._later(slot, parts, 0))
        return slot

    @staticmethod
    def _later(slot: bytearray, parts: list[list[memoryview]], p: int) -> list[memoryview]:
        """The segments of part ``p`` that travel after the slot."""
        table = _frame.decode(slot).parts[p]
        return [seg for (_, inline), seg in zip(table, parts[p], strict=True) if inline is None and seg.nbytes]

    def _feed(self, src: int, views: list[memoryview]) -> None:
        self._pending.setdefault(src, deque()).extend(memoryview(v).cast("B") for v in views)

    # ------------------------------------------------------------------ transport
    def _allgather_slots(self, slot: bytearray, size: int, timeout: float | None) -> memoryview:
        self._pending = {}
        rows = [slot if r == self._rank else self._peer_slot(r, size) for r in range(self._size)]
        self._count(size * (self._size - 1), size * (self._size - 1))
        return memoryview(b"".join(rows))

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
