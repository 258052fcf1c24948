"""The active communicator: ``use(comm)`` installs it, ``current()`` returns it."""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import threading
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ._communicator import Communicator
from ._defaults import get_default
from ._errors import CommunicatorStateError
from ._launching.launchers import detect, inherited
from ._local import LocalCommunicator
from ._torch import GlooCommunicator, NcclCommunicator

__all__ = ["active", "current", "use"]

_ACTIVE: contextvars.ContextVar[Communicator | None] = contextvars.ContextVar("distcomm_active", default=None)

# The communicator adopted implicitly over torch.distributed's default group when none is
# installed, keyed by that group (so a destroyed and re-created group gets a new one).
_implicit: list[tuple[Any, Communicator]] = []

@contextlib.contextmanager
def use(comm: Communicator) -> Iterator[Communicator]:
    """Install ``comm`` as the active communicator for the body of the ``with`` block.

    Nestable; the previous one is restored on exit, also after an exception. The active
    communicator lives in a ContextVar: threads and asyncio tasks each see their own.
    """
    if not isinstance(comm, Communicator):
        raise TypeError(f"use() needs a distcomm.Communicator, got {type(comm).__name__}")
    token = _ACTIVE.set(comm)
    try:
        yield comm
    finally:
        _ACTIVE.reset(token)


def active() -> Communicator | None:
    """The communicator installed with use() in this thread or task, else the process-wide default, or None."""
    comm = _ACTIVE.get()
    if comm is None:
        return get_default()
    while comm._successor is not None:  # a shrink or admit replaced it: use(comm) follows
        comm = comm._successor
    return comm


def current() -> Communicator:
    """The active communicator.

    With none installed in this thread or task: the process-wide default (the communicator that
    launch(), from_env() or spawn() made), else a communicator over torch.distributed's default
    group when it is initialized (created on first use, which is collective: every rank must get
    there, from its main thread), else a LocalCommunicator.

    Raises:
        CommunicatorStateError: none is set up, and a launcher started this process as one of
            several (torchrun, srun, mpirun): a world of one would silently compute alone. (A
            process a rank started with multiprocessing, such as a data loader's worker, gets a
            LocalCommunicator, unless its launcher variables were set for it after it started, as
            elastic_launch's workers' are.) Setting
            one up is left to the script (``distcomm.from_env()``): it connects to a rendezvous and
            picks a backend and a timeout, which a getter shouldn't do behind the user's back, and a
            rank that never called a helper would leave the others waiting for the timeout.
    """
    comm = active()
    if comm is not None:
        return comm
    if dist.is_available() and dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        for group, c in _implicit:
            if group is default and not c._closed:
                return c
        if threading.current_thread() is not threading.main_thread():
            # adopting the group is collective: from a helper thread it would meet the main thread's calls
            raise CommunicatorStateError(
                "no communicator is installed in this thread, and adopting torch.distributed's default group "
                "from a thread other than the main thread would start a collective that the other ranks' main "
                "threads don't expect; install one with distcomm.use(comm) in this thread, or call "
                "distcomm.current() once in the main thread first")
        _implicit.clear()
        backend = str(dist.get_backend(default))
        implicit: Communicator = GlooCommunicator() if "gloo" in backend else NcclCommunicator()
        _implicit.append((default, implicit))
        atexit.register(_let_go, implicit)
        return implicit
    env = detect()
    # a process Python's multiprocessing started (a data loader's worker) inherits the launcher's
    # variables but is a helper of its rank, not a rank: a world of one, as before. One whose own
    # launcher variables were set for it (elastic_launch's workers, mp.spawn's) is a rank.
    if env.world_size > 1 and not inherited(env):
        raise CommunicatorStateError(
            f"no distcomm communicator is set up, and {env.launcher} started this process as rank {env.rank} "
            f"of {env.world_size}: alone, it would compute as a world of one. Set one up once at the start "
            f"of the script: `comm = distcomm.from_env()` (then `with comm:` or `comm.close()` at the end), "
            f"or run the work under `distcomm.launch(main, N)`")
    return LocalCommunicator()


def _let_go(comm: Communicator) -> None:
    """At exit, close a communicator adopted implicitly: the user may have destroyed the default
    group without closing it, and the group's threads, kept alive by it, would otherwise be torn
    down during interpreter finalisation, which can abort the process."""
    _implicit[:] = [(g, c) for g, c in _implicit if c is not comm]
    with contextlib.suppress(Exception):  # calls still pending: closing would break them
        comm.close()
