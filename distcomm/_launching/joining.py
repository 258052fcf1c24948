"""A replacement's communicator before it has joined the members.

A torch script builds its model after ``from_env()``. Were a replacement let in there, every member
would wait in its next collective (the state's hand-over) for that build. So ``from_env()`` returns
to a replacement as soon as the members have seen it waiting, with a communicator that joins them at
its first use: only then does the process prove the job's key, which is what the members' ``admit()``
lets in on, and the members step on meanwhile.

Its first use is its first call, or the first read of what only joining tells: its rank, world
size, group, membership (whatever of the instance set-up makes). ``device_mesh()`` is not a use: it
returns a mesh over stand-ins that join at their first collective (``ElasticMesh.before_join``).
``device``, ``launcher`` and ``timeout`` are known before. The object is the one the script
holds: it becomes, in place, a plain instance of its class (``admit()`` compares communicators by
identity, and ``distcomm.current()`` returns this one).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from .._defaults import clear_default, set_default
from .._errors import CommunicatorStateError

if TYPE_CHECKING:
    from .._elastic.membership import Membership
    from .._torch import _TorchCommunicator

__all__ = ["join_now", "joining", "not_joined"]


def joining(cls: type[_TorchCommunicator], join: Callable[[Any], Exception | None], job_rank: int, world: int,
            **known: Any) -> Any:
    """A ``cls`` communicator that ``join`` makes, in place, at its first use; the process-wide
    default meanwhile. ``known``: the instance's attributes known before (its device, launcher).
    What ``join`` returns is a rank loss met once the communicator was made: its first use raises it."""
    comm = object.__new__(_joining_class(cls))
    comm.__dict__.update(known, _join=join, _waits_as=(job_rank, world))
    set_default(comm)
    return comm


def not_joined(comm: object) -> tuple[int, int] | None:
    """A replacement's job rank and the job's size, until it has joined; None for any other
    communicator (one that was closed, or failed to join, too: its use says why)."""
    join = comm.__dict__.get("_join")
    return None if join is None or getattr(join, "func", None) is _never else comm.__dict__["_waits_as"]


def join_now(comm: Any) -> None:
    """Join, if ``comm`` is a replacement that hasn't yet (what its first call would do); raises
    the loss of a member met as it joined, if no call has raised it yet."""
    if "_join" in comm.__dict__:
        comm._join_now()
    loss = comm.__dict__.pop("_loss_unraised", None)
    if loss is not None:
        raise loss


class _Joining:
    """Put before the communicator's class while the process waits to join (same name: messages
    that name the class read the same)."""

    _plain: type[_TorchCommunicator]
    _waits_as: tuple[int, int]

    def __getattr__(self, name: str) -> Any:  # (only for names the instance lacks: what set-up makes)
        if "_join" in self.__dict__ and name.startswith("_") and not name.startswith("__"):
            self._join_now(raise_loss=False)  # (a read, perhaps of its rank: the next call raises a loss)
            return getattr(self, name)
        return cast(Any, super()).__getattr__(name)  # (Communicator's: other libraries' spellings)

    @property
    def membership(self) -> Membership:
        self._join_now(raise_loss=False)  # (the class's defaults would say a membership of no one)
        return self.membership

    def _join_now(self, *, raise_loss: bool = True) -> None:
        join = self.__dict__.pop("_join", None)
        if join is None:  # (a use from another thread while this one joins)
            raise CommunicatorStateError(f"{type(self).__name__}: used while it joins the job, from another thread")
        known, plain = dict(self.__dict__), self._plain
        try:
            lost = join(self)
        except BaseException as e:
            # back as it was (what a failed set-up left would let a call run on a half-made one),
            # and every later use says why
            self.__class__ = _joining_class(plain)
            self.__dict__.clear()
            refused = join if getattr(join, "func", None) is _never else functools.partial(
                _never, f"joining the job failed ({e})")
            self.__dict__.update(known, _join=refused)
            raise
        if lost is not None:  # (made, and a member lost as it was: shrink() goes on from it)
            if raise_loss:
                raise lost
            self._loss_unraised = lost

    def close(self) -> None:
        """Closed before its first use: it never joins (it proved no key, so no admit lets it in)."""
        if "_join" in self.__dict__:
            self.__dict__["_join"] = functools.partial(_never, "it was closed before its first use")
            self.__dict__["_closed"] = True
            clear_default(cast(Any, self))
            mesh = self.__dict__.pop("_mesh", None)
            if mesh is not None:  # (its stand-ins for torch's groups go: see ElasticMesh.before_join)
                mesh.drop_stand_ins()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        rank, world = self._waits_as
        state = "closed" if self.__dict__.get("_closed") else "joins the members at its first use"
        return f"{type(self).__name__}(job rank {rank} of {world}, a replacement: {state})"


def _never(why: str, comm: object) -> None:
    raise CommunicatorStateError(f"{type(comm).__name__}: this replacement never joined the job: {why}")


@functools.cache
def _joining_class(cls: type[_TorchCommunicator]) -> type[Any]:
    return type(cls.__name__, (_Joining, cls), {"__qualname__": cls.__qualname__, "_plain": cls,
                                               "__module__": cls.__module__})
