"""``python script args`` or ``python -m module args``, run in a process forked from the forkserver
that ``distcomm.testing.spawn()`` uses: torch is imported once per test process, not once per
process (1.3 s of CPU each, most of what a job of real processes cost the suite).

The process is still a process of its own, as a job controller starts one: its own pid, the
environment and working directory it is given, ``sys.argv``, ``__main__``, stdout and stderr on
pipes, atexit handlers; it is killed by a signal and its exit status says so. It imports distcomm
itself. What differs from a fresh interpreter is what ``spawn()``'s docstring lists (string hash
seed, variables torch reads only at import). ``DISTCOMM_SPAWN_METHOD=spawn`` gives fresh
interpreters here too."""

from __future__ import annotations

import atexit
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

from distcomm.testing._spawn import _context, _Parent, _rank

_STARTED: weakref.WeakSet[ForkedScript] = weakref.WeakSet()


def _run(argv: list[str], cwd: str) -> None:
    """In the child: what the interpreter does for ``python *argv`` run in ``cwd``."""
    os.chdir(cwd)
    if argv[0] == "-m":
        sys.path.insert(0, cwd)
        sys.argv = argv[1:]  # (runpy puts the module's path first)
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        sys.argv = list(argv)
        runpy.run_path(argv[0], run_name="__main__")


class ForkedScript:
    """The part of ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)`` the tests use."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        ctx, _ = _context()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._process = ctx.Process(target=_rank, name=" ".join(argv[:2]),
                                    args=(_Parent(True, env, (out_w, err_w)), _run, argv, str(cwd)))
        try:
            self._process.start()  # (the descriptors went to the forkserver with the request)
        finally:
            os.close(out_w)
            os.close(err_w)
        self.stdout = open(out_r, encoding="utf-8", errors="replace")
        self.stderr = open(err_r, encoding="utf-8", errors="replace")
        self.pid = self._process.pid
        self.returncode: int | None = None
        _STARTED.add(self)

    def poll(self) -> int | None:
        self.returncode = self._process.exitcode
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything it writes to stdout and stderr until it ends; its exit status is then in ``returncode``."""
        got: dict[str, str] = {}
        readers = [threading.Thread(target=lambda n=name, f=f: got.__setitem__(n, f.read()), daemon=True)
                   for name, f in (("out", self.stdout), ("err", self.stderr))]
        for t in readers:
            t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in readers:
            t.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        if any(t.is_alive() for t in readers):
            raise subprocess.TimeoutExpired(self._process.name, timeout or 0.0)
        self.stdout.close()
        self.stderr.close()
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 1.0))
        return got["out"], got["err"]


def start(argv: list[str], env: dict[str, str], cwd: Path) -> Any:
    """``python *argv`` in a process of its own: forked (see the module's docstring) where spawn()
    forks, otherwise a fresh interpreter."""
    _, forked = _context()
    if forked:
        return ForkedScript(argv, env, cwd)
    return subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def run(argv: list[str], env: dict[str, str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    """``start()``, then everything it wrote and its exit status, as ``subprocess.run(...,
    capture_output=True, text=True, timeout=timeout)`` gives them (killed on a timeout)."""
    proc = start(argv, env, cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return subprocess.CompletedProcess([sys.executable, *argv], proc.returncode, out, err)


def _end_the_rest() -> None:
    """At exit, kill what a failed test left running: multiprocessing would wait for it."""
    for p in list(_STARTED):
        p.kill()


atexit.register(_end_the_rest)  # after multiprocessing's own exit handler, so before it at exit
