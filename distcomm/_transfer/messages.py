"""Point-to-point objects: ``send``/``recv`` and ``isend``/``irecv`` between two ranks.

A message travels as a fixed-size header (its segments' count and total bytes), the segments'
sizes when there is more than one segment, then each segment into memory of its exact size: the
serializer's stream and its out-of-band buffers (large numpy arrays and tensors), which become the
received object's memory. The receiver checks the header against ``max_bytes`` before it
allocates anything. Messages between a pair are matched by tag and arrive in the order they were
sent: each (direction, peer, tag) is a lane that runs its messages one at a time (``_handles``),
so a message's buffers are posted before the next message's header.

The transports move the parts through two hooks, ``_send_message`` and ``_recv_message``; the
torch transports' are here (``torch_send``, ``torch_recv``), over the object group's gloo
send/recv, with tags of their own (``GLOO_TAG_BASE`` + tag) that never meet the collectives' (tag 0).
"""

from __future__ import annotations

import atexit
import datetime
import os
import struct
import sys
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from .._elastic.failure_report import membership_broke, store_host
from .._elastic.waits import wait_watched
from .._errors import (
    CollectiveError,
    CollectiveTimeoutError,
    DistCommError,
    FrameError,
    PayloadTooLargeError,
    PeerError,
    SerializationError,
    clipped,
    transport_text,
)
from .._handles import Handle, as_caller
from .._one_at_a_time import user_site
from .._wire.memory import as_view, byte_tensor
from .._wire.serialization import dumps_for, failure_text, serializer_for
from .._wire.tensor_pickle import CUDA_TARGET
from .routes.base import check_receivable
from .transport import front_door

if TYPE_CHECKING:
    from .._communicator import Communicator
    from .._torch import _TorchCommunicator

__all__ = ["EAGER_BYTES", "GLOO_TAG_BASE", "TAGS", "decode", "encode", "isend", "irecv", "settle_eager",
           "settle_limit", "torch_recv", "torch_send"]

_R = TypeVar("_R")

TAGS = 1 << 30
"""Tags are ints in [0, TAGS)."""
GLOO_TAG_BASE = 1 << 30
"""gloo's tag of a message of tag t is GLOO_TAG_BASE + t: apart from the collectives' 0 and from
the small tags of the user's own torch.distributed.send on the same group."""

_HEAD = struct.Struct("<4sIQQ")  # magic, version, number of segments, total bytes
_MAGIC = b"DCMS"
_VERSION = 1


def _check(comm: Communicator, name: str, peer: int, tag: int) -> None:
    """Bad arguments, before anything moves."""
    comm._check_root(name, peer)
    if peer == comm.rank:
        raise ValueError(f"{name}={peer} is this rank: a rank can't send a message to itself")
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)):
        raise TypeError(f"tag must be an int, got {type(tag).__name__}")
    if not 0 <= tag < TAGS:
        raise ValueError(f"tag must be in [0, 2**30), got {tag}")


def isend(comm: Communicator, obj: Any, dst: int, tag: int, timeout: float | datetime.timedelta | None,
          site: tuple[str, int]) -> Handle[None]:
    def move(peer: int, tag: int, t: float | None, what: str) -> None:
        comm._send_message(peer, tag, [byte_tensor(p) for p in encode(comm, obj, what)], t)

    return _start(comm, "send", dst, tag, timeout, site, move)


def irecv(comm: Communicator, src: int, tag: int, timeout: float | datetime.timedelta | None,
          site: tuple[str, int]) -> Handle[Any]:
    return _start(comm, "recv", src, tag, timeout, site, lambda peer, tag, t, what: _receive(comm, peer, tag, t, what))


def _start(comm: Communicator, direction: str, peer: int, tag: int, timeout: float | datetime.timedelta | None,
           site: tuple[str, int], move: Callable[[int, int, float | None, str], _R]) -> Handle[_R]:
    """Check the arguments now, then queue ``move(peer, tag, timeout, what)`` on the lane of
    (``direction``, peer, tag): messages between a pair on a tag stay in order."""
    sending = direction == "send"
    _check(comm, "dst" if sending else "src", peer, tag)
    peer, tag = int(peer), int(tag)
    comm._check_usable()
    t = comm._op_timeout(timeout)
    what = f"{direction} {'to' if sending else 'from'} rank {peer} (tag {tag})"

    def run() -> _R:
        comm._check_usable()
        return move(peer, tag, t, what)

    return comm._queues.submit_to_lane((direction, peer, tag), Handle(what, site), as_caller(run))


def encode(comm: Communicator, obj: Any, what: str) -> list[memoryview]:
    """``obj`` as the parts of a message: header, sizes (more than one segment), non-empty segments."""
    try:
        segs = [memoryview(s).cast("B") for s in dumps_for(comm, obj)]
    except DistCommError:
        raise
    except Exception as e:
        raise SerializationError(f"{what}: can't serialize the object: {failure_text(serializer_for(comm), obj, e)}",
                                 op="send") from e
    total = sum(s.nbytes for s in segs)
    if comm.max_bytes is not None and total > comm.max_bytes:
        raise PayloadTooLargeError(f"{what}: payload of {total} bytes is over max_bytes={comm.max_bytes}",
                                   op="send")
    parts = [memoryview(_HEAD.pack(_MAGIC, _VERSION, len(segs), total))]
    if len(segs) > 1:
        parts.append(memoryview(np.array([s.nbytes for s in segs], dtype="<u8").tobytes()))
    return parts + [s for s in segs if s.nbytes]


def _receive(comm: Communicator, src: int, tag: int, timeout: float | None, what: str) -> Any:
    deadline = None if timeout is None else time.monotonic() + timeout

    def left() -> float | None:
        return None if deadline is None else max(deadline - time.monotonic(), 0.001)

    head = torch.empty(_HEAD.size, dtype=torch.uint8)
    comm._recv_message(src, tag, [head], timeout)
    magic, version, n, total = _HEAD.unpack(bytes(as_view(head)))
    if magic != _MAGIC or version != _VERSION or n < 1 or n > total + 1:
        comm._mark_broken(f"{what}: not a distcomm message")
        raise FrameError(f"{what}: the bytes received are not a distcomm message header", op="recv", ranks=[src])
    if comm.max_bytes is not None and total > comm.max_bytes:  # before anything of that size is allocated
        comm._mark_broken(f"{what}: refused a message of {total} bytes")
        raise PayloadTooLargeError(f"{what}: the message announces {total} bytes, over max_bytes={comm.max_bytes}",
                                   op="recv", ranks=[src])
    check_receivable(comm, total + 8 * n, src, "recv")  # (no max_bytes: at most this machine's memory)
    sizes = [total]
    if n > 1:
        table = torch.empty(8 * n, dtype=torch.uint8)
        comm._recv_message(src, tag, [table], left())
        sizes = [int(s) for s in np.frombuffer(as_view(table), dtype="<u8")]
        if sum(sizes) != total:
            comm._mark_broken(f"{what}: inconsistent sizes")
            raise FrameError(f"{what}: the message's sizes don't add up to its total", op="recv", ranks=[src])
    bufs = [torch.empty(s, dtype=torch.uint8) for s in sizes]
    comm._recv_message(src, tag, [b for b in bufs if b.numel()], left())
    return decode(comm, [as_view(b) for b in bufs], what, src)


def decode(comm: Communicator, views: list[memoryview], what: str, src: int) -> Any:
    token = CUDA_TARGET.set(comm._cuda_target)  # CUDA tensors rebuilt where the collectives put them
    try:
        return serializer_for(comm).loads(views)
    except CollectiveError as e:
        e.args = (f"{what}: can't load the object: {e}",)
        e.op, e.ranks = "recv", (src,)
        raise
    except Exception as e:
        raise SerializationError(f"{what}: can't load the object: {type(e).__name__}: {e}", op="recv",
                                 ranks=[src]) from e
    finally:
        CUDA_TARGET.reset(token)


def parse(comm: Communicator, parts: list[memoryview], what: str, src: int) -> Any:
    """The object of a message's ``parts`` (as ``encode`` made them): the fake's record of a send."""
    _, _, n, total = _HEAD.unpack(bytes(parts[0]))
    sizes = [total] if n == 1 else [int(s) for s in np.frombuffer(parts[1], dtype="<u8")]
    it = iter(parts[1 if n == 1 else 2:])
    return decode(comm, [memoryview(bytearray(next(it))) if s else memoryview(b"") for s in sizes], what, src)


# ---------------------------------------------------------------- the torch transports
EAGER_BYTES = 60 << 10
"""A message smaller than this (header, sizes and segments) is sent eagerly: the send returns once
posted, from a copy, without waiting for the receiver (as MPI does below a threshold), so that two
ranks that send small messages on different tags before receiving them don't wait for each other.
Below the 64 KiB at which buffers travel out of band: the copy is of the pickle stream only."""


EAGER_PENDING = 256
"""Eager sends a communicator keeps in flight: past this, a send waits for its receiver (as MPI
falls back from eager to rendezvous), so that a producer faster than its consumer holds no more."""


def torch_send(comm: _TorchCommunicator, dst: int, tag: int, parts: list[torch.Tensor], timeout: float | None) -> None:
    what = f"send to rank {dst} (tag {tag})"
    g = comm._obj_group
    eager = sum(p.numel() for p in parts) < EAGER_BYTES and _room_for_eager(comm)
    if eager:
        parts = [p.clone() for p in parts]  # the sender may change its object once send returns
    try:
        works = [g.send([p], comm._at(dst), GLOO_TAG_BASE + tag) for p in parts]  # as the group numbers it
    except Exception as e:
        _failed(comm, e, what, dst, timeout)
    if eager:  # gloo needs the works (and their buffers) kept until the receiver has taken them
        with comm._eager_lock:  # sends on several lanes (threads) at once
            comm._eager.extend(works)
        if not comm._eager_at_exit:  # a script that never closes its communicator: at exit then
            comm._eager_at_exit = True
            atexit.register(_settle_at_exit, weakref.ref(comm))
        return
    _await(comm, works, dst, timeout, what)


def _room_for_eager(comm: _TorchCommunicator) -> bool:
    """Whether another eager send fits under ``EAGER_PENDING``, once the taken ones are let go."""
    with comm._eager_lock:
        if len(comm._eager) >= EAGER_PENDING // 2:
            comm._eager = [w for w in comm._eager if not w.is_completed()]
        return len(comm._eager) < EAGER_PENDING


def settle_eager(comm: _TorchCommunicator, timeout: float | None) -> int:
    """Before the groups go: wait, up to ``timeout``, for the eager sends' receivers to take them.
    Returns how many were not taken."""
    with comm._eager_lock:
        pending, comm._eager = comm._eager, []
    deadline = None if timeout is None else time.monotonic() + timeout
    lost = 0
    for w in pending:
        left = None if deadline is None else max(deadline - time.monotonic(), 0.001)
        try:
            w.wait() if left is None else w.wait(datetime.timedelta(seconds=left))
        except Exception:  # the peer is gone or never received it
            lost += 1
    return lost


_AT_EXIT_SECONDS = 60.0
"""The longest a process waits at exit for its eager sends' receivers (bounded by the timeout too)."""
FAILING_SECONDS = 2.0
"""The longest a rank that ends on an error waits for them: a receiver may be waiting in a
collective for this very rank, and would wait for its timeout while this one waits for it."""


def settle_limit(comm: _TorchCommunicator, failing: bool) -> float | None:
    """How long closing ``comm`` waits for its eager sends' receivers."""
    limit = comm._timeout
    if failing or comm._broken is not None:
        limit = FAILING_SECONDS if limit is None else min(limit, FAILING_SECONDS)
    return limit


def _settle_at_exit(ref: weakref.ref[_TorchCommunicator]) -> None:
    comm = ref()
    if comm is None or comm._closed or not comm._eager or os.getpid() != comm._pid:
        return
    dying = getattr(sys, "last_value", None) is not None  # the program ends on an uncaught error
    limit = settle_limit(comm, dying)
    limit = _AT_EXIT_SECONDS if limit is None else min(limit, _AT_EXIT_SECONDS)
    lost = settle_eager(comm, limit)
    if lost:
        print(f"distcomm: rank {comm.rank} exits with {lost} message(s) it sent that no receiver took within "
              f"{limit:g} s", file=sys.stderr)


def torch_recv(comm: _TorchCommunicator, src: int, tag: int, bufs: list[torch.Tensor], timeout: float | None) -> None:
    what = f"recv from rank {src} (tag {tag})"
    g = comm._obj_group
    try:
        works = [g.recv([b], comm._at(src), GLOO_TAG_BASE + tag) for b in bufs]
    except Exception as e:
        _failed(comm, e, what, src, timeout)
    _await(comm, works, src, timeout, what)


def _await(comm: _TorchCommunicator, works: list[Any], peer: int, timeout: float | None, what: str) -> None:
    """Wait for point-to-point ``works`` in a waiter thread (a timed-out wait can't be resumed)
    while this one watches the peer (a dead peer whose connection a child keeps open, a lost host,
    members that left to shrink)."""
    if not works:
        return
    try:
        wait_watched(comm, works, timeout, [peer] * len(works), what)
    except DistCommError:
        raise
    except Exception as e:
        _failed(comm, e, what, peer, timeout)


def _failed(comm: _TorchCommunicator, e: BaseException, what: str, peer: int, timeout: float | None) -> Any:
    """The transport's error as distcomm's; the pair's connection is gone, so is the communicator."""
    if isinstance(e, DistCommError):
        raise e
    if comm._waits_broken:  # (this process broke them: its membership broke)
        raise membership_broke(comm, what, what.split()[0]) from e
    text = transport_text(e)
    low = text.lower()
    comm._mark_broken(f"{what}: {clipped(text, 160)}")
    make: Callable[..., CollectiveError] = CollectiveError
    if "timed out" in low or "timeout" in low:
        raise CollectiveTimeoutError(f"{what} timed out after {timeout}s: {_peer_wait(comm, what, peer, timeout)[1]} "
                                     f"(transport: {text})", op=what.split()[0], ranks=[peer]) from e
    if "closed" in low or "reset" in low or "broken pipe" in low or "connection" in low:
        waited, said = _peer_wait(comm, what, peer, timeout)
        if waited:  # the peer's own timeout fired first, and closed the pair's connection: not a lost peer
            raise CollectiveTimeoutError(f"{what} timed out after {timeout}s: {said} (its timeout fired first; "
                                         f"transport: {text})", op=what.split()[0], ranks=[peer]) from e
        make = PeerError
    raise make(f"{what} failed: lost rank {peer}? (transport: {text})" if make is PeerError
               else f"{what} failed in the transport: {text}", op=what.split()[0], ranks=[peer]) from e


def _peer_wait(comm: _TorchCommunicator, what: str, peer: int, timeout: float | None) -> tuple[bool, str]:
    """Whether ``peer`` was waiting in a message of its own, and what it waited for, from the job's
    store: each side of a failed message writes what it waited for there and reads the other's (a
    pair may wait on different tags)."""
    sending = what.startswith("send")
    needed = f"rank {peer} didn't {'receive' if sending else 'send'} it"
    reports = comm._reports
    if reports is None or not comm._token:
        return False, needed
    key = f"distcomm/{comm._token}/p2p/"
    mine, theirs = f"{key}{comm._rank}/{peer}", f"{key}{peer}/{comm._rank}"
    try:
        reports.set(mine, what)
        deadline = time.monotonic() + (2.0 if timeout is None else min(2.0, max(0.5, timeout / 4)))
        if _appears(reports, theirs, deadline):
            said = reports.get(theirs).decode("utf-8", "replace")
            if store_host(comm) == comm._rank:
                _wait_until_read(reports, mine, deadline)
            else:  # (what the store's host waits for)
                reports.set(f"{theirs}/read", "")
            return True, f"{needed}; it was waiting in {said} (this rank: {what})"
    except Exception:  # noqa: S110 - the store may be gone with its host: the plain message will do
        pass
    return False, f"{needed} (it reported no wait on this rank)"


def _wait_until_read(store: Any, mine: str, deadline: float) -> None:
    """On the rank whose process serves the store: wait (until ``deadline``) until the peer has read
    this rank's wait, since this rank may raise and exit next, taking the store with it."""
    try:
        _appears(store, f"{mine}/read", deadline)
    except Exception:  # noqa: S110 - see above
        pass


def _appears(store: Any, key: str, deadline: float) -> bool:
    """Whether ``key`` is in ``store`` by ``deadline`` (polled)."""
    while not store.check([key]):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


class PointToPoint:
    """The front door's point-to-point objects (``Communicator`` inherits them; ``self`` is always one).

    Not collective: only the two ranks take part. Messages between a pair are matched by tag and
    arrive in the order they were sent. A timeout or a lost peer breaks the communicator (the
    pair's connection is gone)."""

    def send(self, obj: Any, dst: int, *, tag: int = 0, timeout: float | datetime.timedelta | None = None) -> None:
        """Send ``obj`` to rank ``dst``, which receives it with ``recv(src, tag=tag)``; may wait until
        ``dst`` takes it. ``tag``: an int in [0, 2**30). Large buffers travel out of band."""
        comm = front_door(self)
        isend(comm, obj, dst, tag, timeout, user_site()).wait()

    def recv(self, src: int, *, tag: int = 0, timeout: float | datetime.timedelta | None = None) -> Any:
        """The next object rank ``src`` sends this rank with ``tag``. Refuses a message over
        ``max_bytes`` before allocating it."""
        comm = front_door(self)
        return irecv(comm, src, tag, timeout, user_site()).wait()

    def isend(self, obj: Any, dst: int, *, tag: int = 0,
              timeout: float | datetime.timedelta | None = None) -> Handle[None]:
        """``send`` without waiting: a Handle (``obj`` is read when the message goes: keep it as it is
        until ``wait()`` returns)."""
        comm = front_door(self)
        return isend(comm, obj, dst, tag, timeout, user_site())

    def irecv(self, src: int, *, tag: int = 0, timeout: float | datetime.timedelta | None = None) -> Handle[Any]:
        """``recv`` without waiting: a Handle whose ``wait()`` returns the object."""
        comm = front_door(self)
        return irecv(comm, src, tag, timeout, user_site())
