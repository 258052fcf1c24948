"""Non-blocking calls: ``async_op=True`` and ``isend``/``irecv`` return a ``Handle`` at once.

A communicator's non-blocking collectives run on one worker thread of its own (``Queue``), one at
a time, in the order they were started: every rank runs the same calls in the same order, so a
mismatch, a timeout or a lost peer raises the same error on every rank, from ``Handle.wait()``. A
blocking collective called while some are queued waits its turn (``Queues.turn``). The worker is
the only thread that runs collectives while work is queued, and it goes through the same
``_one_at_a_time.exclusive`` check as any caller, so a second user thread is still refused as before.

Point-to-point messages run on lanes, one per (direction, peer, tag), each a queue of its own: the
messages between a pair on a tag stay in order, and a receive never holds up a collective.
"""

from __future__ import annotations

import datetime
import threading
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from ._agreement import where
from ._errors import CommunicatorStateError
from ._wire.memory import seconds
from ._wire.serialization import carry_serializer

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["Handle", "Queue", "Queues", "as_caller", "refuse_close", "start_collective"]

_R = TypeVar("_R")
_UNSET: Any = object()


class Handle(Generic[_R]):
    """A call started without waiting (``async_op=True``, ``isend``, ``irecv``).

    ``wait()`` returns what the blocking call returns, or raises what it raises; it may be called
    again (the same result, or the same error). The objects passed to the call are read when it
    runs, not when it is started: don't change them before ``wait()`` returns.
    """

    __slots__ = ("_error", "_event", "_name", "_site", "_traceback", "_value")

    def __init__(self, name: str, site: tuple[str, int]) -> None:
        self._name = name
        self._site = site
        self._event = threading.Event()
        self._value: Any = _UNSET
        self._error: BaseException | None = None
        self._traceback: Any = None

    def done(self) -> bool:
        """Whether the call has finished (returned or raised): ``wait()`` then returns at once."""
        return self._event.is_set()

    def wait(self, timeout: float | datetime.timedelta | None = None) -> _R:
        """The call's result (what the blocking call returns), once it has finished; raises its error.

        ``timeout``: seconds to wait at most (None: until it finishes; the call itself is bounded by
        the communicator's timeout). When they run out, TimeoutError; the call goes on, and the
        handle can be waited on again.
        """
        limit = seconds(timeout, None)
        if not self._event.wait(limit):
            raise TimeoutError(f"{self._name} (started at {where(self._site)}) has not finished after {limit}s; "
                               f"it is still running: call wait() again")
        if self._error is not None:  # with the call's traceback, not one grown by every wait()
            raise self._error.with_traceback(self._traceback)
        return self._value  # type: ignore[no-any-return]

    def _store(self, value: Any, error: BaseException | None) -> None:
        self._value, self._error = value, error
        self._traceback = error.__traceback__ if error is not None else None

    def __repr__(self) -> str:
        state = ("failed" if self._error is not None else "done") if self._event.is_set() else "pending"
        return f"Handle({self._name} at {where(self._site)}, {state})"


class Queue:
    """Calls run one at a time, in order, on a thread of their own (started when work comes, ended
    when none is left)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._calls: deque[tuple[Handle[Any], Callable[[], Any]]] = deque()
        self._running: Handle[Any] | None = None
        self._thread = 0  # the serving thread's ident while it serves
        self.site: tuple[str, int] = ("?", 0)  # the user's call site of the call running

    def submit(self, handle: Handle[Any], fn: Callable[[], Any]) -> Handle[Any]:
        with self._cond:
            self._calls.append((handle, fn))
            if not self._thread:
                self._thread = -1  # starting
                threading.Thread(target=self._serve, name="distcomm-async", daemon=True).start()
        return handle

    def _serve(self) -> None:
        while True:
            with self._cond:
                self._thread = threading.get_ident()
                if not self._calls:
                    self._thread = 0
                    self._cond.notify_all()
                    return
                handle, fn = self._calls.popleft()
                self._running = handle
                self.site = handle._site
            finished = _outcome(handle, fn)
            # Let go of the call (its arguments, its result) before its handle says it is done: once
            # the caller has it, the interpreter may exit, and a tensor freed from this daemon thread
            # during finalisation aborts the process. And no longer count it as running, so that a
            # close() right after wait() or done() finds nothing pending.
            del handle, fn
            with self._cond:
                self._running = None
                self._cond.notify_all()
            finished.set()

    def on_thread(self) -> bool:
        """Whether the caller is this queue's thread (running one of its calls)."""
        return self._thread == threading.get_ident()

    def drain(self) -> None:
        """Wait until every call submitted so far has finished."""
        with self._cond:
            while self._calls or self._running is not None:
                self._cond.wait()

    def pending(self) -> list[Handle[Any]]:
        with self._cond:
            return ([self._running] if self._running is not None else []) + [h for h, _ in self._calls]

    def idle(self) -> bool:
        """Nothing queued, nothing running, no thread serving."""
        with self._cond:
            return not self._calls and self._running is None and not self._thread


def _outcome(handle: Handle[Any], fn: Callable[[], Any]) -> threading.Event:
    """Run ``fn`` and store its result or error in ``handle``; the event that tells its waiters."""
    try:
        handle._store(fn(), None)
    except BaseException as e:
        handle._store(None, e)
    return handle._event


LANES_KEPT = 64
"""Point-to-point lanes kept before the idle ones are let go."""


class Queues:
    """A communicator's queue of non-blocking collectives and its point-to-point lanes."""

    def __init__(self) -> None:
        self.collectives: Queue | None = None
        self._lanes: dict[tuple[str, int, int], Queue] = {}
        self._lock = threading.Lock()

    def turn(self) -> tuple[str, int] | None:
        """Before a collective runs: on the worker, the user's call site of the queued call; on any
        other thread, wait first for the queued collectives (a blocking call waits its turn)."""
        q = self.collectives
        if q is None:
            return None
        if q.on_thread():
            return q.site
        q.drain()
        return None

    def collective_queue(self) -> Queue:
        with self._lock:
            if self.collectives is None:
                self.collectives = Queue()
            return self.collectives

    def submit_to_lane(self, key: tuple[str, int, int], handle: Handle[_R], fn: Callable[[], _R]) -> Handle[_R]:
        """Queue ``fn`` on the lane ``key`` (direction, peer, tag). Idle lanes are let go once there
        are more than ``LANES_KEPT`` (a tag per step would otherwise keep one per step): under the
        lock that every submission takes, so no call lands on a lane being let go."""
        with self._lock:
            q = self._lanes.get(key)
            if q is None:
                if len(self._lanes) >= LANES_KEPT:
                    self._lanes = {k: v for k, v in self._lanes.items() if not v.idle()}
                q = self._lanes[key] = Queue()
            q.submit(handle, fn)
        return handle

    def lanes(self) -> int:
        return len(self._lanes)

    def pending(self) -> list[Handle[Any]]:
        with self._lock:
            queues = ([self.collectives] if self.collectives is not None else []) + list(self._lanes.values())
        return [h for q in queues for h in q.pending()]



def refuse_close(name: str, pending: list[Handle[Any]]) -> None:
    """Raise if calls are still pending: closing under them would hang or break them."""
    if pending:
        calls = ", ".join(f"{h._name} at {where(h._site)}" for h in pending[:8])
        more = f" and {len(pending) - 8} more" if len(pending) > 8 else ""
        raise CommunicatorStateError(
            f"close() was called on a {name} with {len(pending)} non-blocking "
            f"call{'s' if len(pending) > 1 else ''} still pending ({calls}{more}): wait() on their handles first")


def start_collective(comm: Communicator, name: str, args: tuple[Any, ...], kwargs: dict[str, Any], async_op: Any,
                     site: tuple[str, int]) -> Handle[Any]:
    """Queue the collective ``name`` on ``comm``'s worker; its handle."""
    if async_op is not True:
        raise TypeError(f"async_op must be a bool, got {type(async_op).__name__}")
    comm._check_usable()
    method = getattr(comm, name)  # the instance's: a double's wrapper (the fake records it) runs too
    return comm._queues.collective_queue().submit(Handle(name, site), as_caller(lambda: method(*args, **kwargs)))


def as_caller(fn: Callable[[], _R]) -> Callable[[], _R]:
    """``fn`` to run on a worker thread in the caller's thread-local state, as the blocking call
    would: its grad mode and inference mode (a new thread has grad on: a result would carry a
    grad_fn that the blocking call under no_grad doesn't), and its current CUDA device and stream
    (a new thread starts on device 0 and its default stream: received CUDA tensors would land on
    device 0, and the caller's stream's work would not be ordered first); and the loader it chose
    for what peers send (``serializing_with``)."""
    fn = carry_serializer(fn)
    grad, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    device, stream = (torch.cuda.current_device(), torch.cuda.current_stream()) if cuda else (None, None)

    if grad and not inference and device is None:
        return fn  # what a new thread starts with: nothing to carry

    def run() -> _R:
        with torch.inference_mode() if inference else torch.set_grad_enabled(grad):
            if device is None:
                return fn()
            with torch.cuda.device(device), torch.cuda.stream(stream):
                return fn()

    return run
