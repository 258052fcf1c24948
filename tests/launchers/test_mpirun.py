"""Open MPI's mpirun starts the ranks; distcomm reads its variables (no MPI library involved)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ._cluster import python_env, run
from ._output import ranks_said

pytestmark = pytest.mark.launchers


def _mpirun(n: int, script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run(["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", str(n), sys.executable, str(script), *args],
               python_env(), script.parent)


def test_mpirun_from_env(scripts: Path) -> None:
    said = ranks_said(_mpirun(3, scripts / "who.py"), 3)
    for r, s in enumerate(said):
        assert s == {"rank": r, "world": 3, "local": [r, 3], "launcher": "openmpi", "type": "GlooCommunicator",
                     "gathered": [0, 1, 2]}


def test_mpirun_runs_a_launch_script_in_its_ranks(scripts: Path) -> None:
    said = ranks_said(_mpirun(2, scripts / "d2.py", "2"), 2)
    assert [(s["rank"], s["launcher"], s["gathered"]) for s in said] == [(0, "openmpi", [0, 1]), (1, "openmpi", [0, 1])]


def test_mpirun_helpers_without_a_communicator_are_refused(scripts: Path) -> None:
    result = _mpirun(2, scripts / "helpers_only.py")
    assert result.returncode != 0 and "GATHERED:[" not in result.stdout
    assert "openmpi started this process as rank" in result.stdout and "distcomm.from_env()" in result.stdout
