"""Forming a membership's torch group with its members watched.

torch forms a group in the store: each rank writes its address and waits for every other rank's.
A member that dies before writing its own leaves the others waiting until the timeout, and then
failing with a raw store error; in a shrink or an admit, where members die most, that is a minute
lost and a job ended. Here the group forms over ``WatchedStore``, whose waits look at the members
between looks at the keys: a member found gone, or a shrink of the membership begun elsewhere,
ends the wait at once, and ``start_seat`` then agrees on the survivors and forms again. A member
that dies after writing its address is met by the group's first calls instead (see
``connecting_lazily``).
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Iterator
from typing import Any

import torch

from ._membership import shrink_begun
from ._rendezvous import Seat
from ._waits import HOSTS_LOST, alive, process_id

__all__ = ["FormingFailed", "WatchedStore", "connecting_lazily", "publish_pid"]

_c10d: Any = torch._C._distributed_c10d

LOOK_SECONDS = 0.2
"""How often a wait that has not ended looks at the members."""


class FormingFailed(Exception):
    """A wait of the group's formation ended because the membership broke: ``lost`` (job ranks) are
    gone, or (none lost) a shrink of the membership began elsewhere."""

    def __init__(self, lost: tuple[int, ...]) -> None:
        super().__init__(f"job rank(s) {', '.join(map(str, lost))} gone while the group formed" if lost else
                         "a shrink of this membership began while its group formed")
        self.lost = lost


@contextlib.contextmanager
def connecting_lazily(lazily: bool) -> Iterator[None]:
    """Gloo groups made inside connect each pair of ranks on its first use rather than all at
    once (torch's ``TORCH_GLOO_LAZY_INIT``). Gloo retries a connection to a process that is gone
    for five times the group's timeout, in C++ where nothing can cut it short; a shrink's or an
    admit's group, where members die most, makes its connections inside its first calls
    instead, whose waits watch the peers and give up on a dead one at once."""
    if not lazily:
        yield
        return
    before = os.environ.get(_LAZY)
    os.environ[_LAZY] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ[_LAZY]
        else:
            os.environ[_LAZY] = before


_LAZY = "TORCH_GLOO_LAZY_INIT"


def publish_pid(seat: Seat) -> None:
    """Say where this process is, for members on the same machine to watch its pid."""
    seat.job.append(f"{seat.epoch}/pids/{_machine()}", f"{seat.job_rank}:{process_id()[2]},")


class WatchedStore(_c10d.Store):  # type: ignore[misc]
    """The store a membership's group forms in (and its later groups too): the membership's own
    keys, whose waits end as soon as the membership breaks. torch calls it from C++; every process
    keeps the ones it made for its life, since torch's groups call it as long as they live."""

    def __init__(self, seat: Seat, pids: dict[int, int]) -> None:
        super().__init__()
        self.seat = seat
        self._inner = seat.store
        self._pids = dict(pids)  # job rank -> pid, for members on this machine
        self.failure: FormingFailed | None = None
        _KEPT.append(self)

    # the store's calls, as the membership's own store answers them
    def set(self, key: str, value: bytes) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        return bytes(self._inner.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(key, amount))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(self._inner.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait for ``keys`` as the store would, looking at the membership between looks at them."""
        limit = (timeout or self._inner.timeout).total_seconds()
        start = time.monotonic()
        pause, next_look = 0.001, start + LOOK_SECONDS
        while not self._inner.check(keys):
            now = time.monotonic()
            if now - start > limit:
                raise TimeoutError(f"the group's formation waited {limit:g} s for {keys}")
            if now >= next_look:
                self._look()
                next_look = now + LOOK_SECONDS
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def lost(self) -> tuple[int, ...]:
        """The members found gone now (job ranks)."""
        job, epoch = self.seat.job, self.seat.epoch
        key = f"{epoch}/pids/{_machine()}"
        if job.check([key]):
            for entry in job.get(key).decode().split(","):
                if entry:
                    rank, _, pid = entry.partition(":")
                    self._pids[int(rank)] = int(pid)
        return tuple(r for r in self.seat.members
                     if r in HOSTS_LOST or (r in self._pids and not alive(self._pids[r])))

    def known_pids(self) -> dict[int, int]:
        """The members' pids found so far (job rank -> pid), for the agreement that follows a failure."""
        return dict(self._pids)

    def _look(self) -> None:
        lost = self.lost()
        if lost or shrink_begun(self.seat.job, self.seat.epoch):
            self.failure = FormingFailed(lost)
            raise self.failure


_KEPT: list[WatchedStore] = []


def _machine() -> str:
    """What tells this machine's processes (one pid namespace) from other machines'."""
    boot, namespace, _ = process_id()
    return f"{boot}-{namespace}"


