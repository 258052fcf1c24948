"""How launch() watches the processes it started.

By default a job ends with its first failure: the others get a moment to report what they saw,
then are ended. An elastic job (``launch(..., elastic=True)``) outlives a lost rank: a process
that dies without raising (killed, its machine's memory gone) is lost, not failed; the survivors
go on (they ``shrink()``), and a lost rank is started again, up to ``replacements`` times in all,
to wait until the members ``admit()`` it. A process that raises still fails the job.
"""

from __future__ import annotations

import datetime
import multiprocessing.connection
import re
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._elastic.liveness import machine
from .._trust.key import JobKey
from .._trust.records import Records
from .rank_output import write_or_drop
from .rendezvous import moving

__all__ = ["JobStore", "how_it_ended", "saying", "wait_elastic", "wait_until_failure"]


def wait_until_failure(processes: Sequence[Any], grace: float) -> dict[int, tuple[int, float]]:
    """Wait until every process exited, or until ``grace`` seconds after the first failed (the others
    then have time to report what they saw). Returns the failed ones: index -> (exit code, when)."""
    failed: dict[int, tuple[int, float]] = {}
    stop_at = None
    while True:
        codes = [p.exitcode for p in processes]  # read once: a process that exits between two reads
        for i, code in enumerate(codes):          # would be neither failed nor running (the job "passed")
            if i not in failed and code is not None and code != 0:
                failed[i] = (code, time.time())
        running = [p for p, code in zip(processes, codes, strict=True) if code is None]
        now = time.monotonic()
        if failed and stop_at is None:
            stop_at = now + grace
        if not running or (stop_at is not None and now >= stop_at):
            return failed
        _sleep_on(running, 1.0 if stop_at is None else min(1.0, max(stop_at - now, 0.01)))


class JobStore:
    """A launcher's look at the job's store, served by this process (``served``) or asked as a
    client at ``url``: which of this machine's processes the members let in, whether members still
    beat anywhere, whether the workers use distcomm's membership at all. Each answer is False or
    empty where the store can't be read. Records count only where signed with ``key``, the job's
    (as the workers were given it)."""

    def __init__(self, served: Any, url: str, key: JobKey | None) -> None:
        self._store, self._url, self._key = served, url, key

    def admitted(self) -> set[int]:
        """The pids of this machine's processes that the members let in (``admit``)."""
        found = set()
        records = self._records()
        for key in self._keys():
            head, sep, rest = key.rpartition("/pid/")
            said = records.read(key) if sep and records.check([f"{head}/admitted/{rest}"]) else None
            if said:
                where, _, pid = said.decode().rpartition(":")
                if where == machine():
                    found.add(int(pid))
        return found

    def waiting(self) -> set[int]:
        """The pids of this machine's processes that a shrink left out, while they wait to be let
        in again (``rendezvous.rejoin``: a rank whose replica lost another)."""
        records = self._records()
        found = set()
        for key in self._keys():
            said = records.read(key) if re.search(r"/rejoining/\d+$", key) else None
            if said:
                where, _, pid = said.decode().rpartition(":")
                if where == machine() and pid.isdigit():
                    found.add(int(pid))
        return found

    def beating(self) -> bool:
        """Whether some member's keep-alive beat moves (the job goes on, here or on other machines)."""
        keys = [k for k in self._keys() if re.search(r"/alive/\d+$", k)]
        return bool(keys) and moving(self._records(), keys)

    def _records(self) -> Records:
        return Records(self._store, self._key, "")

    def uses_membership(self) -> bool:
        """Whether the workers met in distcomm's rendezvous (they can shrink past a lost one)."""
        return any(k.startswith("distcomm/") for k in self._keys())

    def anyone_met(self) -> bool:
        """Whether any worker wrote to the store yet (distcomm's rendezvous or torch's): before that,
        a worker started again simply takes its place in the job's first meeting. The agents' own
        keys (``distcomm-run/``) don't count."""
        return any(not k.startswith("distcomm-run/") for k in self._keys())

    def _keys(self) -> list[str]:
        if self._store is None:
            host, _, port = self._url.removeprefix("tcp://").rpartition(":")
            try:
                self._store = torch._C._distributed_c10d.TCPStore(host, int(port), is_master=False,
                                                                  timeout=datetime.timedelta(seconds=5))
            except Exception:  # not reachable now: asked again next time
                return []
        try:
            return list(self._store.list_keys())
        except Exception:
            return []


def wait_elastic(processes: list[Any], grace: float, raised: Callable[[int, int], bool], first: int,
                 replacements: int, start: Callable[[int], Any], job: JobStore,
                 say: Callable[[str], None]) -> dict[int, tuple[int, float]]:
    """Wait until every process exited, starting a lost one again (``start(index)``) while
    ``replacements`` last; end the job as ``wait_until_failure`` does once a process raised
    (``raised(index, exit code)``). A process started again that the members let in is one of
    them; one still waiting is ended once no member beats in the job's store (``job``). Returns
    the failed ones, as ``wait_until_failure`` does."""
    left = replacements
    started_again: set[int] = set()
    look_again = 0.0
    while True:
        seen = list(processes)
        codes = [p.exitcode for p in seen]  # read once per look (see wait_until_failure)
        for i, (p, code) in enumerate(zip(seen, codes, strict=True)):
            if code is None or code == 0:
                continue
            if raised(i, code):  # the job fails
                return wait_until_failure(processes, grace)
            if left > 0:
                left -= 1
                # Before anyone met, the others wait for it in the first meeting (it can't complete
                # without it): it takes its place there, a member, not a newcomer to be let in.
                first_meeting = not job.anyone_met()
                processes[i] = start(i)
                if not first_meeting:
                    started_again.add(i)
                say(f"rank {first + i} (pid {p.pid}) was lost ({how_it_ended(code)}); started again as pid "
                    f"{processes[i].pid}" + ("" if first_meeting else ", to be admitted"))
            else:
                processes[i] = _Ended(p.pid)
                say(f"rank {first + i} (pid {p.pid}) was lost ({how_it_ended(code)}); the others go on")
        # running: as read at the top, and those started again just now
        running = [i for i, p in enumerate(processes) if codes[i] is None or (p is not seen[i] and p.exitcode is None)]
        if not running:
            return {}
        if time.monotonic() >= look_again:  # (a look lists the store's keys: not every second)
            look_again = time.monotonic() + WAITING_LOOK_SECONDS
            idle = started_again | _waiting(processes, running, started_again, job)
        else:
            idle = set(started_again)
        if all(i in idle for i in running):
            let_in = job.admitted()  # (one that the members let in is one of them: its end is waited for)
            started_again -= {i for i in running if processes[i].pid in let_in}
            idle -= {i for i in running if processes[i].pid in let_in}
            if all(i in idle for i in running) and not job.beating():
                _end_unadmitted(processes, idle, started_again, first, grace, say)  # the job ended before they came in
                return {}
        _sleep_on([processes[i] for i in running], 1.0)


WAITING_LOOK_SECONDS = 5.0
"""How often the agent looks for first processes that wait to be let in again."""


def _waiting(processes: Sequence[Any], running: list[int], started_again: set[int], job: JobStore) -> set[int]:
    """The running first processes that wait to be let in again (a rank whose replica lost another:
    it waits in ``shrink()`` until the replica is whole), looked for only once every other running
    process is such a one or started again."""
    if all(i in started_again for i in running):
        return set()
    waiting = job.waiting()
    return {i for i in running if processes[i].pid in waiting}


def _end_unadmitted(processes: Sequence[Any], idle: set[int], started_again: set[int], first: int, grace: float,
                    say: Callable[[str], None]) -> None:
    """Processes that wait to be let into a job that is over (started again after the members
    ended, or a rank whose replica was never whole again). Given ``grace`` seconds to end of their
    own, then ended."""
    waiting = [(i, processes[i]) for i in sorted(idle) if processes[i].exitcode is None]
    _sleep_on([p for _, p in waiting], grace)
    for i, p in waiting:
        if p.exitcode is None:
            p.terminate()
            p.join(5.0)
            how = ("started again, was never admitted" if i in started_again
                   else "waited for its replica to be whole again, and was ended")
            say(f"rank {first + i} (pid {p.pid}), {how}: the others had ended")


class _Ended:
    """A lost process, once it has been said so: counts as ended, and is not reported again."""

    exitcode = 0

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        return False


def _sleep_on(running: Sequence[Any], seconds: float) -> None:
    """In one-second slices at most, so that Ctrl-C (or SIGINT sent to this process alone) is seen at once."""
    multiprocessing.connection.wait([p.sentinel for p in running], timeout=seconds)


def how_it_ended(code: int) -> str:
    """A process's exit code in words: ``killed by SIGKILL``, ``exited with code 1``."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def saying(who: str) -> Callable[[str], None]:
    """Lines from the launcher ``who`` about its processes, on its standard error (dropped once
    its reader left: the job runs on)."""
    return lambda line: write_or_drop(sys.stderr, f"{who}: {line}\n")
