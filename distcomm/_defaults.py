"""The process-wide default communicator: the one that owns the job's default group (made by
launch(), from_env() or spawn()). Every thread sees it; ``use()`` overrides it per thread or task."""

from __future__ import annotations

from ._communicator import Communicator

__all__ = ["clear_default", "get_default", "set_default"]

_default: list[Communicator] = []


def set_default(comm: Communicator | None) -> None:
    """Make ``comm`` the process-wide default communicator (None: no default)."""
    _default.clear()
    if comm is not None:
        _default.append(comm)


def clear_default(comm: Communicator) -> None:
    """No process-wide default any more, if it was ``comm``."""
    if _default and _default[0] is comm:
        _default.clear()


def get_default() -> Communicator | None:
    """The process-wide default, unless there is none or it is closed."""
    return _default[0] if _default and not _default[0]._closed else None
