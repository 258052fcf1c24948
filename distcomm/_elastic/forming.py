"""Forming a membership's torch group with its members watched.

torch forms a group in the store: each rank writes its address and waits for every other rank's.
A member that dies before writing its own leaves the others waiting until the timeout, and then
failing with a raw store error; in a shrink or an admit, where members die most, that is a minute
lost and a job ended. Here the group forms over ``WatchedStore``, whose waits look at the members
between looks at the keys: a member found gone (by its pid on this machine, or by the keep-alive
across machines), or a shrink of the membership begun elsewhere, ends the wait, and
``start_seat`` then agrees on the survivors and forms again. A member that dies after writing
its address is met by the group's first calls instead (see ``connecting``). A gloo group that
connects lazily, whose own threads ask its store, holds the native store instead, its members
having waited for each other in ``WatchedStore`` (see ``init_gloo``).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from .._errors import CollectiveTimeoutError, PeerError
from .._launching.rendezvous import Seat, poll_cap, who_key
from .liveness import HOSTS_LOST, alive, machine, process_id
from .membership import shrink_begun

__all__ = ["FormingFailed", "WatchedStore", "connecting", "forming_watched", "init_gloo", "native_store",
           "publish_pid"]

_c10d: Any = torch._C._distributed_c10d

LOOK_SECONDS = 0.2
"""How often a wait that has not ended looks at the members."""


class FormingFailed(PeerError):
    """A membership broke while its group formed: ``ranks`` (job ranks) are gone, or (none) the
    other members already agree on its survivors."""

    def __init__(self, seat: Seat, lost: tuple[int, ...]) -> None:
        what = (f"job rank(s) {', '.join(map(str, lost))} ended while the group of {seat.epoch} formed" if lost
                else f"the other members began to agree on {seat.epoch}'s survivors while its group formed")
        super().__init__(what, op="rendezvous", ranks=lost)


def publish_pid(seat: Seat) -> None:
    """Say where this process is, for members on the same machine to watch its pid, and who it is
    (host and pid), for a refusal to name it (``_membership.waiting_newcomers``)."""
    seat.job.append_entry(f"{seat.epoch}/pids/{machine()}", f"{seat.job_rank}:{process_id()[2]}")
    seat.job.set(who_key(seat.epoch, seat.job_rank), seat.token)


class WatchedStore(_c10d.Store):  # type: ignore[misc]
    """The store a membership's group forms in (and its later groups too): the membership's own
    keys, whose waits end as soon as the membership breaks. torch calls it from C++, on the thread
    that makes a group (never on a gloo transport thread: see ``init_gloo``; NCCL's own threads
    still do, see docs/architecture.md); the ones made are kept for the life of the process
    (``_KEPT``), since torch's groups hold them as long as they live."""

    def __init__(self, seat: Seat, pids: dict[int, int]) -> None:
        super().__init__()
        self.seat = seat
        self.inner = seat.store
        self._pids = dict(pids)  # job rank -> pid, for members on this machine
        self.failure: FormingFailed | None = None
        _KEPT.append(self)

    # the store's calls, as the membership's own store answers them
    def set(self, key: str, value: bytes) -> None:
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])  # (a get waits for its key, as torch's own stores do)
        return bytes(self.inner.get(key))

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        return bytes(self.inner.compare_set(key, expected, desired))

    def check(self, keys: list[str]) -> bool:
        return bool(self.inner.check(keys))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def num_keys(self) -> int:
        return int(self.inner.num_keys())

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        """Wait for ``keys`` as the store would, looking at the membership between looks at them."""
        limit = (timeout or self.inner.timeout).total_seconds()
        start = time.monotonic()
        pause, next_look = 0.001, start + LOOK_SECONDS
        longest = min(0.05, poll_cap(len(self.seat.members)))  # (the members' stall: 10 ms apart in small jobs)
        while not self.inner.check(keys):
            now = time.monotonic()
            if now - start > limit:
                raise CollectiveTimeoutError(
                    f"{self.seat.where}: the group of {self.seat.epoch} did not form within {limit:g} s: a member "
                    f"never wrote its address ({', '.join(keys)})", op="rendezvous")
            if now >= next_look:
                self.look()
                next_look = now + LOOK_SECONDS
            time.sleep(pause)
            pause = min(pause * 2, longest)

    def wait_for_members(self) -> None:
        """Wait, watched, until every member has made its group (after ``init_process_group``: and
        so written its address there)."""
        if self.inner.add("formed", 1) == len(self.seat.members):
            self.inner.set("formed/all", b"1")
        self.wait(["formed/all"])

    def known_pids(self, *, refresh: bool = False) -> dict[int, int]:
        """The members' pids found so far (job rank -> pid); with ``refresh``, read again first."""
        if refresh:
            self._read_pids()
        return dict(self._pids)

    def lost(self) -> tuple[int, ...]:
        """The members found gone now (job ranks)."""
        self._read_pids()
        return tuple(r for r in self.seat.members
                     if r in HOSTS_LOST or (r in self._pids and not alive(self._pids[r])))

    def _read_pids(self) -> None:
        for entry in self.seat.job.entries(f"{self.seat.epoch}/pids/{machine()}"):
            rank, _, pid = entry.partition(":")
            self._pids[int(rank)] = int(pid)

    def look(self) -> None:
        """Raise FormingFailed where a member is found gone, or the others began a shrink."""
        lost = self.lost()
        if lost or shrink_begun(self.seat.job, self.seat.epoch):
            self.failure = FormingFailed(self.seat, lost)
            raise self.failure


_KEPT: list[WatchedStore] = []
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_KEPT))  # not even freed at exit: the groups outlive the interpreter


def native_store(store: Any) -> Any:
    """``store`` (the default group's, as torch hands it out) asked without Python: over a
    ``WatchedStore``, the same keys in the membership's own store. torch passes a Python store
    no ``list_keys``, and the store-host watch looks for the TCPStore beneath."""
    inner = getattr(store, "underlying_store", None)
    if not isinstance(inner, WatchedStore):
        return store
    return _c10d.PrefixStore(f"{dist.distributed_c10d._get_default_group().group_name}/", inner.inner)


_LAZY = "TORCH_GLOO_LAZY_INIT"
_LAZY_LOCK = threading.Lock()


def init_gloo(store: WatchedStore, rank: int, world: int, timeout: datetime.timedelta, *, lazily: bool) -> None:
    """torch's default group on gloo, formed in ``store``; ``lazily``: see ``connecting``.

    A group that connects lazily asks the store for a peer's address at the first call between the
    two, often on its transport threads. A thread of torch's own that enters Python while the
    interpreter ends aborts the process ("terminate called without an active exception"), after
    all its work: so such a group is handed the membership's own (native) store, and its members
    then wait, watched, until every address is written (no native wait is left waiting on a
    member that died first). Afterwards torch's record of the default store, where the groups made
    later form, is the native store too (a user's group may connect lazily), but for distcomm's
    own (see ``forming_watched``)."""
    with connecting(lazily=lazily):
        dist.init_process_group("gloo", store=store.inner if lazily else store, rank=rank, world_size=world,
                                timeout=timeout)
    if lazily:
        store.wait_for_members()
    c10d = dist.distributed_c10d
    group = c10d._get_default_group()
    backend, _ = c10d._world.pg_map[group]
    native = _c10d.PrefixStore(f"{group.group_name}/", store.inner)  # (the keys torch gives its groups)
    c10d._world.pg_map[group] = (backend, native)
    _WATCHED[:] = [(native, _c10d.PrefixStore(f"{group.group_name}/", store))]


_WATCHED: list[tuple[Any, Any]] = []
"""The record ``init_gloo`` gave torch for the default group it made, and its watched twin."""


@contextlib.contextmanager
def forming_watched() -> Iterator[None]:
    """Groups made inside form in the watched store where distcomm made the default group (they
    connect at once, on the caller's thread: see ``connecting``); elsewhere, as torch would."""
    c10d: Any = dist.distributed_c10d
    group = c10d._get_default_group() if c10d.is_initialized() else None
    record = c10d._world.pg_map[group] if group is not None else (None, None)
    watched = next((w for native, w in _WATCHED if native is record[1]), None)  # (only the record it set)
    if watched is None:
        yield
        return
    c10d._world.pg_map[group] = (record[0], watched)
    try:
        yield
    finally:
        c10d._world.pg_map[group] = record


@contextlib.contextmanager
def connecting(*, lazily: bool) -> Iterator[None]:
    """Gloo groups made inside connect each pair of ranks on its first use (``lazily``) or all at
    once (torch's ``TORCH_GLOO_LAZY_INIT``, read when a group is made; set to "0" where a user set
    it, so that none of distcomm's groups in a watched store connects lazily). Gloo retries a
    connection to a process that is gone for five times the group's timeout, in C++ where nothing
    can cut it short; a shrink's or an admit's default group, where members die most, makes its
    connections inside its first calls instead, whose waits watch the peers and give up on a dead
    one at once. The variable is the process's: another thread making a gloo group meanwhile
    connects the same way."""
    value = "1" if lazily else "0"
    if not lazily and os.environ.get(_LAZY, "0") in ("", "0"):  # (torch's default: nothing to set)
        yield
        return
    with _LAZY_LOCK:
        before = os.environ.get(_LAZY)
        os.environ[_LAZY] = value
        try:
            yield
        finally:
            if os.environ.get(_LAZY) == value:  # (unless changed meanwhile)
                if before is None:
                    del os.environ[_LAZY]
                else:
                    os.environ[_LAZY] = before
