"""The tests' forked scripts (``_forked``) run as ``python script`` runs them: what a job's tests read
from a rank's process (argv, working directory, environment, output, exit status, the order of its
way out, what distcomm and multiprocessing take it for) is the same as from a fresh interpreter's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from . import _forked

SCRIPT = """
    import atexit, json, multiprocessing, os, signal, sys, threading, time
    how = sys.argv[1]
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "var": os.environ.get("FORKED_TEST_VAR"),
                      "gone": "FORKED_TEST_GONE" in os.environ, "name": __name__, "path0": sys.path[0],
                      "start_method": multiprocessing.get_start_method(),
                      "parent": multiprocessing.parent_process() is not None}), flush=True)
    print("to stderr", file=sys.stderr)
    atexit.register(lambda: print("atexit", flush=True))
    if how == "thread":  # the interpreter joins it before the atexit handlers
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    if how == "exit":
        sys.exit(3)
    if how == "message":
        sys.exit("a message")
    if how == "raise":
        raise KeyError("bad batch")
    if how == "sigint":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
"""

STATUS = {"ok": 0, "thread": 0, "exit": 3, "message": 1, "raise": 1, "sigint": -signal.SIGINT, "kill": -signal.SIGKILL}


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), **extra}
    env.pop("FORKED_TEST_GONE", None)
    return env


def _both(script: Path, env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], ...]:
    """A fresh interpreter's and a forked script's run of ``script args``."""
    fresh = subprocess.run([sys.executable, str(script), *args], env=env, cwd=script.parent, capture_output=True,
                           text=True, timeout=120)
    return fresh, _forked.run([str(script), *args], env, script.parent, timeout=120)


@pytest.mark.parametrize("how", list(STATUS))
def test_a_forked_script_is_what_a_fresh_interpreter_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          how: str) -> None:
    monkeypatch.setenv("FORKED_TEST_GONE", "in this process, not in the script's environment")
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    fresh, forked = _both(script, _env(FORKED_TEST_VAR="set at the call"), how, "x y")
    got, wanted = json.loads(forked.stdout.splitlines()[0]), json.loads(fresh.stdout.splitlines()[0])
    assert got == wanted, (got, wanted)
    assert got["argv"] == [how, "x y"] and got["cwd"] == str(tmp_path) and got["var"] == "set at the call"
    assert not got["gone"] and got["name"] == "__main__" and got["path0"] == str(tmp_path) and not got["parent"]
    assert forked.returncode == fresh.returncode == STATUS[how], (forked.returncode, fresh.returncode)
    assert forked.stdout == fresh.stdout, (forked.stdout, fresh.stdout)  # atexit's line and the thread's, in order
    assert forked.stderr == fresh.stderr, (forked.stderr, fresh.stderr)  # the traceback, as the interpreter prints it


def test_distcomm_takes_a_forked_script_for_a_rank_not_a_helper(tmp_path: Path) -> None:
    """A rank that forgot ``from_env()`` is told so, forked or not (a helper process would get a world of one)."""
    script = tmp_path / "rank.py"
    script.write_text("import distcomm\ntry:\n    print(distcomm.current())\nexcept Exception as e:\n"
                      "    print(type(e).__name__)\n")
    env = _env(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999")
    fresh, forked = _both(script, env)
    assert forked.stdout == fresh.stdout == "CommunicatorStateError\n", (forked, fresh)


def test_python_m_runs_the_module_as_main(tmp_path: Path) -> None:
    out = _forked.run(["-m", "distcomm", "bench", "--sizes", "12Q"], _env(), tmp_path, timeout=60)
    assert out.returncode == 2 and "a size is a number of bytes" in out.stderr and "usage:" in out.stderr, out.stderr


def test_a_timeout_kills_it_and_keeps_what_it_wrote(tmp_path: Path) -> None:
    script = tmp_path / "slow.py"
    script.write_text("import time\nprint('started', flush=True)\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired) as timed_out:
        _forked.run([str(script)], _env(), tmp_path, timeout=3)
    assert timed_out.value.output == "started\n"
    assert not _forked._RUNNING
