"""The tests' forked scripts (``_forked``) run as ``python script`` runs them: what a job's tests read
from a rank's process (argv, working directory, environment, output, exit status) is the same as
from a fresh interpreter's."""

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
    import json, os, signal, sys
    how = sys.argv[1]
    print(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "var": os.environ.get("FORKED_TEST_VAR"),
                      "gone": "FORKED_TEST_GONE" in os.environ, "name": __name__, "path0": sys.path[0]}))
    print("to stderr", file=sys.stderr)
    if how == "exit":
        sys.exit(3)
    if how == "raise":
        raise KeyError("bad batch")
    if how == "kill":
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)
"""


def _both(tmp_path: Path, how: str) -> list[tuple[int, dict[str, object], str]]:
    """What a fresh interpreter and a forked script give for ``SCRIPT how``: exit status, the JSON
    line, stderr."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "FORKED_TEST_VAR": "set at the call"}
    env.pop("FORKED_TEST_GONE", None)
    fresh = subprocess.run([sys.executable, str(script), how, "x y"], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    forked = _forked.run([str(script), how, "x y"], env, tmp_path, timeout=120)
    return [(p.returncode, json.loads(p.stdout.splitlines()[0]), p.stderr) for p in (fresh, forked)]


@pytest.mark.parametrize("how", ["ok", "exit", "raise", "kill"])
def test_a_forked_script_is_what_a_fresh_interpreter_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          how: str) -> None:
    monkeypatch.setenv("FORKED_TEST_GONE", "in this process, not in the script's environment")
    (fresh_code, fresh, fresh_err), (code, got, err) = _both(tmp_path, how)
    assert got == fresh, (got, fresh)
    assert got["argv"] == [how, "x y"] and got["cwd"] == str(tmp_path) and got["var"] == "set at the call"
    assert not got["gone"] and got["name"] == "__main__" and got["path0"] == str(tmp_path)
    assert code == fresh_code == {"ok": 0, "exit": 3, "raise": 1, "kill": -signal.SIGKILL}[how]
    assert "to stderr" in err and "to stderr" in fresh_err
    if how == "raise":
        assert "KeyError: 'bad batch'" in err and "KeyError: 'bad batch'" in fresh_err, err


def test_python_m_runs_the_module_as_main(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = _forked.run(["-m", "distcomm", "bench", "--sizes", "12Q"], env, tmp_path, timeout=60)
    assert out.returncode == 2 and "a size is a number of bytes" in out.stderr and "usage:" in out.stderr, out.stderr
