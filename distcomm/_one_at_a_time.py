"""One collective at a time: the wrapper every public collective of a ``Communicator`` runs
through (``exclusive``). It refuses a second collective while one runs, notes the user's call site
for the other ranks' error messages, queues ``async_op=True`` calls on the communicator's worker
(``_handles``), and opens a ``torch.profiler`` span when a profiler records (``_tracing``)."""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ._errors import CommunicatorStateError
from ._handles import start_collective
from ._tracing import profiling, traced

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["COLLECTIVES", "exclusive", "user_site"]

COLLECTIVES = ("synchronize", "all_gather", "gather", "broadcast", "scatter", "shared_random_seed", "reduce_dict",
               "all_reduce_dict", "all_reduce", "reduce", "broadcast_tensor", "all_gather_tensor",
               "reduce_scatter_tensor", "reduce_object", "all_reduce_object", "scan", "exscan", "all_to_all",
               "split", "new_group", "create_local_groups", "dup", "gather_in_order")
"""The public collectives: each holds the communicator while it runs (see ``exclusive``)."""

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def user_site() -> tuple[str, int]:
    """The user's call site: the first frame outside distcomm."""
    f: Any = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE_DIR):
        f = f.f_back
    return ("?", 0) if f is None else (f.f_code.co_filename, f.f_lineno)


def exclusive(method: Callable[..., Any]) -> Callable[..., Any]:
    """Refuse a second collective on a communicator while one runs: from another thread (the two
    would interleave their messages), or from the same thread (an object's ``__setstate__`` calling
    a collective while a result loads).

    Also the one place ``async_op=True`` is taken: the call is queued on the communicator's worker
    and a ``Handle`` returned (``_handles``); the worker runs it through this same wrapper. A
    blocking call made while calls are queued waits for them first."""

    @functools.wraps(method)
    def run(self: Communicator, *args: Any, async_op: bool = False, **kwargs: Any) -> Any:
        if async_op is not False:
            return start_collective(self, method.__name__, args, kwargs, async_op, user_site())
        # on the worker: where the user started the call; elsewhere, after the queued calls
        queued_at = None if self._queues.collectives is None else self._queues.turn()
        if not self._busy.acquire(False):
            name = type(self).__name__
            if self._busy_thread == threading.get_ident():
                raise CommunicatorStateError(
                    f"{method.__name__} was called on a {name} while another of its collectives runs in the same "
                    f"thread (for example from an object's __setstate__ while a result loads); call it after "
                    f"that collective returns")
            why = (f"{method.__name__} was called on a {name} from two threads at once; a communicator serves one "
                   f"thread at a time (their messages would interleave): give each thread its own communicator "
                   f"(comm.dup(), comm.split or comm.new_group), or hold a lock around the calls")
            # Each rank may refuse a different thread, and the threads left would then pair up wrongly:
            # from now on this rank fails every collective, and its peers learn it in that call's exchange.
            self._misused = self._misused or f"rank {self.rank} was used from two threads at once ({method.__name__})"
            raise CommunicatorStateError(why)
        self._busy_thread = threading.get_ident()
        # the user's call site, for other ranks' error messages (``user_site``, inlined: the hot path)
        if queued_at is None:
            f: Any = sys._getframe(1)
            while f is not None and f.f_code.co_filename.startswith(_PACKAGE_DIR):
                f = f.f_back
            queued_at = ("?", 0) if f is None else (f.f_code.co_filename, f.f_lineno)
        self._site = queued_at
        entry = self._seq
        try:
            if profiling():  # a span in torch.profiler's trace
                out = traced(self, method.__name__, lambda: method(self, *args, **kwargs))
            else:
                out = method(self, *args, **kwargs)
            self._done, self._raised = (self._op_label, self._seq, self._site), None
            return out
        except BaseException as e:
            reached = self._seq != entry  # or it failed before its first exchange (bad input)
            self._raised = (self._op_label if reached else method.__name__, self._seq if reached else None,
                            self._site, type(e).__name__)
            raise
        finally:
            self._busy_thread = 0
            self._busy.release()

    return run
