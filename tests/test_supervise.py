"""launch()'s watch over its processes: a process that exits while being looked at is never lost."""

from __future__ import annotations

import os
from pathlib import Path

from distcomm._launching.supervise import JobStore, wait_elastic, wait_until_failure


class _ExitsWhileLookedAt:
    """A process that is running at the first read of its exit code and has failed at every later one:
    it exited between two reads, as a rank that raises last does."""

    def __init__(self, pid: int) -> None:
        self.pid, self._reads = pid, 0
        read, write = os.pipe()
        os.write(write, b"x")  # its sentinel is ready: the watch's waits return at once
        self.sentinel = read

    @property
    def exitcode(self) -> int | None:
        self._reads += 1
        return None if self._reads == 1 else 1


class _Done:
    exitcode, pid, sentinel = 0, 1, -1


def test_a_failure_between_two_reads_is_a_failure() -> None:
    failed = wait_until_failure([_Done(), _ExitsWhileLookedAt(2)], grace=0.1)
    assert list(failed) == [1] and failed[1][0] == 1


def test_an_elastic_job_sees_the_failure_too(tmp_path: Path) -> None:
    (tmp_path / "1.report").write_bytes(b"")  # it raised: the job fails
    def raised(i: int, code: int) -> bool:
        return (tmp_path / f"{i}.report").exists()

    failed = wait_elastic([_Done(), _ExitsWhileLookedAt(2)], 0.1, raised, 0, 0, lambda i: None,
                          JobStore(None, "tcp://127.0.0.1:1", None), print)
    assert list(failed) == [1]
