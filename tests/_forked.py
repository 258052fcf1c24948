"""``python script args`` or ``python -m module args``, run in a process forked from the forkserver
that ``distcomm.testing.spawn()`` uses: torch is imported once per test process, not once per
process (1.3 s of CPU each, most of what a job of real processes cost the suite).

The process is a job's process, as a job controller starts one: its own pid, the environment and
working directory it is given, ``sys.argv``, ``__main__``, stdout and stderr on pipes, no
multiprocessing parent (distcomm takes it for a rank, not a helper of one), Python's default start
method, and Python's own way out: an uncaught exception's traceback through ``sys.excepthook``,
the non-daemon threads joined, then the atexit handlers, exit status 1, or death by SIGINT after a
KeyboardInterrupt. ``tests/test_forked.py`` compares each with a fresh interpreter's.

What still differs: what ``spawn()``'s docstring lists (the string hash seed; variables torch reads
only at import), modules the server imported before the environment was set (torch, numpy,
cloudpickle), stdin (``/dev/null``), interpreter options given as variables (``PYTHONUNBUFFERED``,
``-X``), a daemon thread that ends the process with the test process, and a dead process reaped at
once by the server (no zombie for a while). ``DISTCOMM_SPAWN_METHOD=spawn`` gives fresh
interpreters here too."""

from __future__ import annotations

import atexit
import itertools
import multiprocessing
import multiprocessing.process
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from distcomm.testing._spawn import _context, _Parent, _rank

_RUNNING: set[ForkedScript] = set()  # (kept until they end: multiprocessing waits for them at exit)


def _run(argv: list[str], cwd: str) -> None:
    """In the child: what the interpreter does for ``python *argv`` run in ``cwd``, to its exit
    (``os._exit``: ``_rank``'s own way out, which runs atexit before threads end, is not taken)."""
    os.chdir(cwd)
    _as_a_main_process()
    code, interrupted = 0, False
    try:
        if argv[0] == "-m":
            sys.path.insert(0, cwd)
            sys.argv = argv[1:]  # (runpy puts the module's path first)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_status(e)
    except BaseException as e:
        mine = _the_scripts_frames(e.__traceback__)
        sys.excepthook(type(e), e.with_traceback(mine), mine)
        code, interrupted = 1, isinstance(e, KeyboardInterrupt)
    threading._shutdown()  # type: ignore[attr-defined]  # (as the interpreter does: threads, then atexit)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # (a closed stream has nothing to flush)
            pass
    if interrupted:  # Python ends by the signal after an uncaught KeyboardInterrupt
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


def _as_a_main_process() -> None:
    """multiprocessing forgets the forkserver: no parent process (the test process's watch on it is
    already running), a main process of its own, Python's default start method."""
    me: Any = multiprocessing.current_process()
    me._identity, me._name, me._parent_pid = (), "MainProcess", None
    multiprocessing.process._parent_process = None  # type: ignore[attr-defined]
    multiprocessing.process._process_counter = itertools.count(1)  # type: ignore[attr-defined]
    multiprocessing.set_start_method(None, force=True)


def _exit_status(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)
    return 1


def _the_scripts_frames(tb: TracebackType | None) -> TracebackType | None:
    """A traceback from the script's own frame on, as the interpreter prints it (not from ``_run``'s
    and runpy's); the whole of it where the script never ran."""
    frame = tb
    while frame is not None:
        if frame.tb_frame.f_code.co_name == "<module>" and frame.tb_frame.f_globals.get("__name__") == "__main__":
            return frame
        frame = frame.tb_next
    return tb


class ForkedScript:
    """The part of ``subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)`` the tests use."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path) -> None:
        ctx, _ = _context()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self.args = [sys.executable, *argv]
        self._process = ctx.Process(target=_rank, name=" ".join(argv[:2]),
                                    args=(_Parent(True, env, (out_w, err_w)), _run, argv, str(cwd)))
        try:
            self._process.start()  # (the descriptors went to the forkserver with the request)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        self.stdout = open(out_r, encoding="utf-8", errors="replace")
        self.stderr = open(err_r, encoding="utf-8", errors="replace")
        self.pid = self._process.pid
        self.returncode: int | None = None
        self._read: dict[str, list[str]] | None = None  # what communicate() has read so far
        self._readers: list[threading.Thread] = []
        _RUNNING.add(self)

    def poll(self) -> int | None:
        self.returncode = self._process.exitcode
        if self.returncode is not None:
            _RUNNING.discard(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Everything it writes to stdout and stderr until it ends; its exit status is then in
        ``returncode``. On a timeout, what it wrote so far is on the ``TimeoutExpired``, and a later
        call goes on reading."""
        if self._read is None:
            self._read = {"out": [], "err": []}
            self._readers = [threading.Thread(target=self._read[name].extend, args=(f,), daemon=True)
                             for name, f in (("out", self.stdout), ("err", self.stderr))]
            for t in self._readers:
                t.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for t in self._readers:
            t.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        out, err = "".join(self._read["out"]), "".join(self._read["err"])
        if any(t.is_alive() for t in self._readers):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0, output=out, stderr=err)
        self.stdout.close()
        self.stderr.close()
        self.wait(None if deadline is None else max(deadline - time.monotonic(), 1.0))
        return out, err


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
    capture_output=True, text=True, timeout=timeout)`` gives them (killed on a timeout, what it
    wrote until then on the ``TimeoutExpired``)."""
    proc = start(argv, env, cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        proc.kill()
        try:
            e.output, e.stderr = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:  # (something it started holds its output open)
            pass
        raise
    return subprocess.CompletedProcess([sys.executable, *argv], proc.returncode, out, err)


def _end_the_rest() -> None:
    """At exit, kill what a failed test left running: multiprocessing would wait for it."""
    for p in list(_RUNNING):
        p.kill()


atexit.register(_end_the_rest)  # after multiprocessing's own exit handler, so before it at exit
