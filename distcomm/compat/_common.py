"""What the compat modules share: the framework's error types raised alike on every rank, the
communicator a ``group=`` argument names, and torch's global ranks as that communicator's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import torch.distributed as dist

from .._api import _for_group
from .._calls import Op
from .._communicator import Communicator
from .._errors import CollectiveError

__all__ = ["InvalidArgumentError", "InvalidAssertionError", "InvalidTypeError", "InvalidValueError",
           "UnsupportedArgumentError",
           "communicator", "refuse", "root_rank", "translated"]

_R = TypeVar("_R")


class InvalidArgumentError(CollectiveError):
    """A rank's argument was refused in a collective of a compat module: raised on every rank, as
    the framework's own error type (the subclasses) and as a CollectiveError naming the rank."""


class InvalidValueError(InvalidArgumentError, ValueError):
    """torch's ``ValueError`` for a bad argument (a gather list on the wrong rank, ...)."""


class InvalidAssertionError(InvalidArgumentError, AssertionError):
    """mmengine's ``AssertionError`` for a bad argument (not a list, not a dict, ...)."""


class UnsupportedArgumentError(InvalidArgumentError, NotImplementedError):
    """mmengine's ``NotImplementedError`` for an unknown device."""


class InvalidTypeError(InvalidArgumentError, TypeError):
    """A ``TypeError`` for a bad argument (a dict value that is not a tensor, ...)."""


_KINDS: dict[type[Exception], type[InvalidArgumentError]] = {
    ValueError: InvalidValueError, AssertionError: InvalidAssertionError, TypeError: InvalidTypeError,
    NotImplementedError: UnsupportedArgumentError}


def communicator(group: Any) -> Communicator:
    """The communicator a framework's ``group=`` names: the current one for None, else one over
    that torch process group (made collectively on first use, then kept)."""
    return _for_group(group)


def root_rank(group: Any, rank: int | None, group_rank: int | None) -> int:
    """torch's ``src``/``dst`` (a global rank) or ``group_src``/``group_dst`` (the group's) as a rank
    of the group's communicator; for ``group=None`` both are the current communicator's."""
    if rank is not None and group_rank is not None:
        raise ValueError("Can't specify both group_rank and global_rank")
    if group_rank is not None:
        return group_rank
    if rank is None:
        return 0
    return rank if group is None else dist.get_group_rank(group, rank)


def translated(call: Callable[..., _R], *args: Any, kind: type[Exception] | None = None) -> _R:
    """``call(*args)``; a refused argument (a CollectiveError of no finer kind) raised as the
    framework's type that the refusing rank named (see ``refuse``), else as ``kind`` where given."""
    try:
        return call(*args)
    except CollectiveError as e:
        if type(e) is not CollectiveError:  # a timeout, mismatch, lost peer...: distcomm's own
            raise
        text = str(e)
        named = next((k for k in _KINDS if f": {k.__name__}: " in text), kind)
        if named is None:
            raise
        raise _KINDS[named](text, op=e.op, ranks=e.ranks) from e


def refuse(comm: Communicator, op: Op, root: int, kind: type[Exception], problem: str) -> NoReturn:
    """Join the collective ``op`` that the other ranks call with this rank's argument refused: every
    rank that calls it through ``translated`` raises ``kind``, naming this rank and ``problem``."""
    translated(comm._refuse, op, root, f"{kind.__name__}: {problem}", kind=kind)
    raise AssertionError("unreachable")  # (_refuse raises)
