"""spawn(..., reuse=True): a kept world is one a fresh spawn would make, and it doesn't hold up exit."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from distcomm.testing import spawn


def _pid_and_serializer(comm: object) -> tuple[int, str]:
    return os.getpid(), type(comm.serializer).__name__  # type: ignore[attr-defined]


@pytest.mark.timeout(240)
def test_a_changed_environment_makes_a_fresh_world(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DISTCOMM_SERIALIZER", raising=False)
    first = spawn(_pid_and_serializer, 2, timeout=60, reuse=True)
    assert {name for _, name in first} == {"PickleSerializer"}
    monkeypatch.setenv("DISTCOMM_SERIALIZER", "safe")
    safe = spawn(_pid_and_serializer, 2, timeout=60, reuse=True)
    assert {name for _, name in safe} == {"SafeSerializer"}, "a kept world must not outlive its environment"
    assert not {p for p, _ in safe} & {p for p, _ in first}  # new processes, started in the new environment
    monkeypatch.delenv("DISTCOMM_SERIALIZER")
    again = spawn(_pid_and_serializer, 2, timeout=60, reuse=True)
    assert again == first  # the first world, still kept for its own environment


SCRIPT = textwrap.dedent("""
    import os, threading, time
    from distcomm.testing import spawn

    def lingering(comm):
        # a thread that would hold the process's exit for a minute (a busy teardown, say)
        threading.Thread(target=time.sleep, args=(60,)).start()
        return os.getpid()

    if __name__ == "__main__":
        pids = spawn(lingering, 2, timeout=60, reuse=True) + spawn(lingering, 3, timeout=60, reuse=True)
        print("PIDS", *pids, flush=True)
""")


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_script(tmp_path: Path, text: str) -> subprocess.Popen[str]:
    script = tmp_path / "job.py"
    script.write_text(text)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


class _Output:
    """A job's output lines, read by a thread (a line the pipe's reader holds doesn't wake a select)."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=lambda: [self.lines.put(line) for line in proc.stdout or ()], daemon=True).start()

    def pids(self, prefix: str, count: int, seconds: float = 60) -> list[int]:
        """The pids printed on lines that start with ``prefix``, once ``count`` of them are."""
        pids: list[int] = []
        deadline = time.monotonic() + seconds
        while len(pids) < count and time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                continue
            self.seen.append(line)
            if line.startswith(prefix):
                pids += [int(p) for p in line.split()[1:]]
        assert len(pids) == count, self.text()
        return pids

    def text(self) -> str:
        while not self.lines.empty():
            self.seen.append(self.lines.get())
        return "".join(self.seen)[-3000:]


def _end(proc: subprocess.Popen[str], pids: list[int]) -> None:
    proc.kill()
    proc.wait(10)
    for pid in pids:
        if _running(pid):
            os.kill(pid, 9)


def _still_running(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _running(p)]


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_kept_worlds_end_promptly_at_exit_and_leave_no_process(tmp_path: Path) -> None:
    proc = _start_script(tmp_path, SCRIPT)
    pids: list[int] = []
    try:
        output = _Output(proc)
        pids = output.pids("PIDS", 5, seconds=200)
        done = time.monotonic()
        proc.wait(timeout=120)
        took = time.monotonic() - done
        assert proc.returncode == 0, output.text()
        # the bound catches 5 s per kept world (and more); the exit itself takes a second or two
        assert took < 8, f"exit took {took:.1f}s after the last spawn returned"
        assert not _still_running(pids, 3), "a worker outlived the script"
    finally:
        _end(proc, pids)


def _environment_output_and_randomness(comm: object) -> tuple[str | None, float, float, str | None]:
    import numpy as np
    import torch

    print(f"rank {comm.rank} says hello", flush=True)  # type: ignore[attr-defined]
    print(f"rank {comm.rank} warns", file=sys.stderr, flush=True)  # type: ignore[attr-defined]
    mark = os.environ.get("DISTCOMM_TEST_MARK")
    return mark, float(np.random.random()), float(torch.rand(1)), os.environ.get("DISTCOMM_TEST_GONE")


# spawn: fresh interpreters, 7 s of CPU, in the slow tier
@pytest.mark.timeout(180)
@pytest.mark.parametrize("method", ["forkserver", pytest.param("spawn", marks=pytest.mark.slow)])
def test_ranks_take_this_processs_environment_output_and_fresh_randomness(
        method: str, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks fork from a server started earlier (by this test's first spawn, if no other): what
    a spawned process would inherit still comes from this process, as it is now."""
    monkeypatch.setenv("DISTCOMM_SPAWN_METHOD", method)
    monkeypatch.setenv("DISTCOMM_TEST_GONE", "set when the server started")
    spawn(_pid_and_serializer, 2, timeout=60, reuse=False)
    monkeypatch.setenv("DISTCOMM_TEST_MARK", "set after the server started")
    monkeypatch.delenv("DISTCOMM_TEST_GONE")
    got = spawn(_environment_output_and_randomness, 3, timeout=60, reuse=False)
    assert [(mark, gone) for mark, _, _, gone in got] == [("set after the server started", None)] * 3
    assert len({draw for _, draw, _, _ in got}) == 3, "numpy's random state must be each rank's own"
    assert len({draw for _, _, draw, _ in got}) == 3, "torch's random state must be each rank's own"
    out, err = capfd.readouterr()
    for r in range(3):
        assert f"rank {r} says hello" in out, out
        assert f"rank {r} warns" in err, err


ORPHAN_SCRIPT = textwrap.dedent("""
    import os, time
    from distcomm.testing import spawn

    def report_and_wait(comm):
        os.write(1, f"PID {os.getpid()}\\n".encode())  # one write: the ranks' lines don't interleave
        time.sleep(600)

    if __name__ == "__main__":
        spawn(report_and_wait, 2, timeout=900, reuse=False)
""")


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ranks_end_soon_after_the_process_that_spawned_them_is_killed(tmp_path: Path) -> None:
    """Killed and not yet reaped (a zombie, whose pid still answers), the caller is gone to its ranks."""
    proc = _start_script(tmp_path, ORPHAN_SCRIPT)
    pids: list[int] = []
    try:
        pids = _Output(proc).pids("PID", 2)
        proc.kill()  # not waited for until the ranks are checked: a zombie until then
        assert not _still_running(pids, 10), "a rank outlived the process that spawned it"
    finally:
        _end(proc, pids)


def test_an_unknown_start_method_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCOMM_SPAWN_METHOD", "fork")
    with pytest.raises(ValueError, match="DISTCOMM_SPAWN_METHOD must be 'forkserver' or 'spawn', got 'fork'"):
        spawn(_pid_and_serializer, 2, timeout=60, reuse=False)
