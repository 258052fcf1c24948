"""The active communicator: ``use(comm)`` installs it, ``current()`` returns it."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from ._communicator import Communicator
from ._local import LocalCommunicator

__all__ = ["current", "use"]

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
    """The communicator installed with use(), or None."""
    return _ACTIVE.get()


def current() -> Communicator:
    """The active communicator.

    With none installed: a communicator over torch.distributed's default group when it is
    initialized (created on first use, which is collective: every rank must get there), else a
    LocalCommunicator.
    """
    comm = _ACTIVE.get()
    if comm is not None:
        return comm
    if dist.is_available() and dist.is_initialized():
        default = dist.distributed_c10d._get_default_group()
        for group, c in _implicit:
            if group is default and not c._closed:
                return c
        _implicit.clear()
        from ._torch import GlooCommunicator, NcclCommunicator

        backend = str(dist.get_backend(default))
        implicit: Communicator = GlooCommunicator() if "gloo" in backend else NcclCommunicator()
        _implicit.append((default, implicit))
        return implicit
    return LocalCommunicator()
