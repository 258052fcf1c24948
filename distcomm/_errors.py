"""The distcomm error hierarchy.

::

    DistCommError                      root: catch this to catch everything distcomm raises
    ├── CommunicatorStateError         the communicator is closed, broken, or used after fork
    ├── RankFailedError                (distcomm.testing) a rank of a test world raised or hung
    └── CollectiveError                a collective failed; raised on every rank that took part
        ├── SerializationError         a rank could not serialize or deserialize its object
        │   └── UnsafePayloadError     SafeSerializer refused a global that is not allowlisted
        ├── CollectiveMismatchError    ranks called different collectives (op, order or root)
        ├── CollectiveTimeoutError     a peer did not arrive within the timeout
        ├── PayloadTooLargeError       a rank's payload is over ``max_bytes``
        ├── PeerError                  a peer died or its connection closed
        ├── AuthenticationError        a peer could not prove it holds the job's key
        └── FrameError                 bytes on the wire are not a valid distcomm frame

Wrong arguments (a bad ``dst``, a non-dict to ``reduce_dict``) are ``ValueError`` or
``TypeError`` raised before any communication, as Python users expect.

This module imports nothing from the rest of the package, so every module can import it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "AuthenticationError",
    "CollectiveError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "CommunicatorStateError",
    "DistCommError",
    "FrameError",
    "PayloadTooLargeError",
    "PeerError",
    "RankFailedError",
    "SerializationError",
    "UnsafePayloadError",
]


class DistCommError(Exception):
    """Root of every error distcomm raises (besides plain ValueError/TypeError for bad arguments)."""


class CommunicatorStateError(DistCommError):
    """The communicator can't be used: closed, broken by an earlier failure, or inherited by fork."""


class CollectiveError(DistCommError):
    """A collective failed.

    Attributes:
        op: the collective's name (``"all_gather"``, ...), or None when unknown.
        ranks: the ranks the error is about (the failing or missing ones), possibly empty.
    """

    def __init__(self, message: str, *, op: str | None = None, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.op = op
        self.ranks: tuple[int, ...] = tuple(ranks)


class SerializationError(CollectiveError):
    """A rank could not serialize its object, or this rank could not deserialize a peer's."""


class UnsafePayloadError(SerializationError):
    """SafeSerializer refused to build a global that is not on its allowlist."""


class CollectiveMismatchError(CollectiveError):
    """Ranks disagree on which collective they are in (op, sequence number or root)."""


class CollectiveTimeoutError(CollectiveError):
    """A peer did not arrive within the timeout. ``ranks`` names those that never reported."""


class PayloadTooLargeError(CollectiveError):
    """A rank's serialized payload is larger than the communicator's ``max_bytes``."""


class PeerError(CollectiveError):
    """The transport lost a peer (it exited or its connection closed)."""


class AuthenticationError(CollectiveError):
    """A member of a new group could not prove it holds the job's key (an impostor in its place,
    or a process started with another key): raised on every member, naming it."""


class FrameError(CollectiveError):
    """Bytes received are not a valid distcomm frame (corrupt, truncated or foreign)."""


class RankFailedError(DistCommError):
    """A rank of a test world (run_threaded, spawn) raised or never finished.

    Attributes:
        rank: the rank that failed first (the root cause, where it can be told).
        exception: its exception (None when the rank hung or its process died).
        remote_traceback: the traceback text from that rank, when it ran in another process.
        errors: every failing rank's exception, by rank.
    """

    def __init__(
        self, message: str, *, rank: int, exception: BaseException | None = None,
        remote_traceback: str = "", errors: dict[int, BaseException] | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exception = exception
        self.remote_traceback = remote_traceback
        self.errors = dict(errors or {})


def is_rank_loss(error: BaseException) -> bool:
    """Whether ``error`` is a failure that the survivors go on from with ``shrink()``: distcomm's
    ``PeerError`` or ``CollectiveTimeoutError``, or what torch's own waits raise (DDP's, FSDP's, a
    user's ``torch.distributed`` call) when a peer is lost or its membership is broken: a
    ``torch.distributed.DistError``, or a RuntimeError with the transport's words for a closed
    connection or a timeout. Looks at what ``error`` was raised from too. Anything else (a bug, a
    mismatch) is no loss: retrying after a shrink would only fail again."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (PeerError, CollectiveTimeoutError)):
            return True
        if any(c.__name__ in _TORCH_LOSS_TYPES and c.__module__.startswith("torch") for c in type(e).__mro__):
            return True
        if isinstance(e, RuntimeError) and any(words in str(e) for words in _TRANSPORT_LOSS_WORDS):
            return True
        e = e.__cause__ or e.__context__
    return False


_TORCH_LOSS_TYPES = frozenset({"DistBackendError", "DistNetworkError"})
_TRANSPORT_LOSS_WORDS = (
    "Connection closed by peer", "Connection reset by peer", "caused pair closure", "Broken pipe",
    "Timed out waiting", "NCCL communicator was aborted", "Socket Timeout",
)


def transport_text(e: BaseException) -> str:
    """The transport's message as one line: its first, without the C++ source location gloo and
    torch put in front (``[.../pair.cc:553] Connection closed by peer ...``)."""
    lines = str(e).strip().splitlines()
    return _SOURCE_LOCATION.sub("", lines[0] if lines else type(e).__name__)


def clipped(text: str, limit: int) -> str:
    """``text`` cut at a word's end within ``limit`` characters (with an ellipsis), never inside a word."""
    if len(text) <= limit:
        return text
    cut = text.rfind(" ", 0, limit - 1)
    return text[: cut if cut > limit // 2 else limit - 1].rstrip(" ,;:") + "…"


_SOURCE_LOCATION = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")
