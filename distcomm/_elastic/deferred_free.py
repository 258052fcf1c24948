"""Groups that may still have a transport thread waiting on a lost peer, held until that wait has
surely ended, then let go.

Freeing a gloo group joins its worker threads on the freeing thread. After a membership breaks, one
of them may still be connecting lazily to a peer that is gone, for up to the group's timeout:
freed then, the group would hold its caller that long (a shrink hung so in the kill
campaign), and torn down at interpreter exit under such a thread, it aborts the process
("terminate called without an active exception"). Held forever, every shrink would keep its
groups' threads and connections for the life of the process. So each is held for its timeout,
and freed at the next safe point after that (a later shrink, a close): at any moment a process
holds only the groups of the memberships that lost a rank within one timeout. Those of a
membership that lost no one have no peer to wait on, and go with its shrink (``free``).

Those a closing communicator is done with go at once, but off its caller's path (``let_go``)."""

from __future__ import annotations

import ctypes
import math
import threading
import time
from typing import Any

__all__ = ["DEFERRED", "DeferredFree", "let_go"]

MARGIN_SECONDS = 2.0
"""Held this much past the group's timeout: the transport's own timeout ends its wait a moment late."""


class DeferredFree:
    """What is held (``hold``) and until when; ``free_due`` lets go of what is past its time."""

    def __init__(self) -> None:
        self._held: list[tuple[float, Any]] = []
        self._lock = threading.Lock()

    def hold(self, things: Any, timeout: float | None) -> Any:
        """Keep ``things`` (groups, their pending work, a failed try that holds them) for ``timeout``
        seconds, the longest a transport thread of theirs can wait, and a margin (None: a group
        whose timeout this process doesn't know, held for good). Returns ``things``, for ``free``."""
        until = math.inf if timeout is None else time.monotonic() + timeout + MARGIN_SECONDS
        with self._lock:
            self._held.append((until, things))
        return things

    def free(self, held: list[Any]) -> None:
        """Let go of what ``hold`` returned, now: no peer of those groups was lost, so no transport
        thread of theirs waits on one."""
        ids = {id(things) for things in held}
        with self._lock:
            self._held = [(until, things) for until, things in self._held if id(things) not in ids]

    def free_due(self) -> int:
        """Let go of what is past its time, here and now (its threads are joined on this thread,
        at once: their waits ended). How many were let go."""
        now = time.monotonic()
        with self._lock:
            due = [things for until, things in self._held if until <= now]
            self._held = [(until, things) for until, things in self._held if until > now]
        count = len(due)
        del due  # (freed here, outside the lock)
        return count

    def __len__(self) -> int:
        return len(self._held)


DEFERRED = DeferredFree()
ctypes.pythonapi.Py_IncRef(ctypes.py_object(DEFERRED))  # never torn down at interpreter exit: see the module


def let_go(things: list[Any]) -> None:
    """Drop the last references to ``things`` (the groups of a communicator that closed, emptied
    from the list) on a thread of their own: tearing a gloo group down joins its threads, about 20
    ms each with the GIL released, which a shrink or an admit then need not wait for. Not a daemon
    thread: the interpreter joins it before it finalizes, where a teardown cut short aborts the process."""
    held = things[:]
    things.clear()
    threading.Thread(target=held.clear, name="distcomm-let-go").start()
