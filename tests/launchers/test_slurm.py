"""srun and sbatch on a real one-node Slurm cluster; Slurm's node-list grammar against scontrol."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from distcomm._launching.hostlist import expand_hostlist

from ._cluster import python_env, run
from ._output import ranks_said

pytestmark = pytest.mark.launchers


def _srun(slurm: dict[str, str], n: int, script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run(["srun", "-n", str(n), "--time=5", sys.executable, str(script), *args],
               python_env({"SLURM_CONF": slurm["SLURM_CONF"]}), script.parent)


def test_srun_from_env(slurm: dict[str, str], scripts: Path) -> None:
    said = ranks_said(_srun(slurm, 3, scripts / "who.py"), 3)
    for r, s in enumerate(said):
        assert s == {"rank": r, "world": 3, "local": [r, 3], "launcher": "slurm", "type": "GlooCommunicator",
                     "gathered": [0, 1, 2]}


def test_srun_runs_a_launch_script_in_its_tasks(slurm: dict[str, str], scripts: Path) -> None:
    """launch(main, 2) under srun -n 2: srun started this machine's processes; launch() starts none."""
    said = ranks_said(_srun(slurm, 2, scripts / "d2.py", "2"), 2)
    assert [(s["rank"], s["world"], s["launcher"], s["gathered"]) for s in said] == [
        (0, 2, "slurm", [0, 1]), (1, 2, "slurm", [0, 1])]


def test_srun_launch_that_does_not_add_up_is_refused_on_every_rank(slurm: dict[str, str], scripts: Path) -> None:
    result = _srun(slurm, 2, scripts / "d2.py", "4")
    assert result.returncode != 0
    assert result.stdout.count("launch() was asked for 4 processes per machine, but slurm started") == 2, \
        result.stdout[-3000:]


def test_srun_helpers_without_a_communicator_are_refused(slurm: dict[str, str], scripts: Path) -> None:
    result = _srun(slurm, 2, scripts / "helpers_only.py")
    assert result.returncode != 0 and "GATHERED:[" not in result.stdout
    assert result.stdout.count("distcomm.from_env()") >= 2, result.stdout[-3000:]
    assert "slurm started this process as rank 1 of 2" in result.stdout


def test_sbatch(slurm: dict[str, str], scripts: Path) -> None:
    batch = scripts / "job.sbatch"
    batch.write_text(textwrap.dedent(f"""\
        #!/bin/bash
        #SBATCH --ntasks=2
        #SBATCH --time=5
        #SBATCH --output={scripts}/job.out
        srun {sys.executable} {scripts / "who.py"}
    """))
    submitted = run(["sbatch", "--wait", str(batch)], python_env({"SLURM_CONF": slurm["SLURM_CONF"]}), scripts)
    out = (scripts / "job.out").read_text() if (scripts / "job.out").exists() else ""
    said = ranks_said(subprocess.CompletedProcess([], submitted.returncode, out + submitted.stdout, ""), 2)
    assert [(s["launcher"], s["gathered"]) for s in said] == [("slurm", [0, 1])] * 2


# Expressions scontrol expands, ours must expand alike; the second list: what Slurm 22.05 refuses and
# ours expands (a suffix after the last set, as newer Slurm releases take).
EXPRESSIONS = [
    "gpu[01-04,07]", "r[1-2]n[001-002]", "n[8-10]", "n[08-10]", "n[001-3]", "n[1-2]-[3-4]", "[1-2]", "x",
    "a,,b", "a b", "n1,n2,", "n[1,1]", "gpu[1-2],b[3]", "n[1-2]x[3]", "n[1-2,4-5]c[7]", "n[098-101]",
    "rack[1-2]-node[01-03],login1", "n[0-0]", "10.79.0.[1-2]", "n[1-2]-[01-02],m[9-10]",
    "a[1-2]b[1-2]c[1-2]", "r[1-2]c[3-4]n[5-6]x[7-8]",
]
SUFFIXES = ["a[1-2]-ib,b3", "a[1-2]b"]
REFUSED = ["n[1-3", "n[[1]]", "n[3-1]", "n[]", "n[1-2]]", "n[1-2;3]"]


def _scontrol(slurm: dict[str, str], text: str) -> list[str] | None:
    out = subprocess.run(["scontrol", "show", "hostnames", text], env=slurm, capture_output=True, text=True,
                         timeout=30, check=False)
    lines = out.stdout.split()
    return None if out.returncode != 0 or "Invalid" in out.stdout + out.stderr else lines


def test_node_lists_expand_as_scontrol_does(slurm: dict[str, str]) -> None:
    for text in EXPRESSIONS:
        assert expand_hostlist(text) == _scontrol(slurm, text), text
    for text in SUFFIXES:
        assert _scontrol(slurm, text) is None, f"this Slurm expands {text}: compare it above"
        assert expand_hostlist(text)[0] == text.split("[")[0] + "1" + text.split("]")[1].split(",")[0]
    for text in REFUSED:
        assert _scontrol(slurm, text) in (None, ["n]"]), text  # 'n[1-3' is garbage in, garbage out there
        with pytest.raises(ValueError, match="node list"):
            expand_hostlist(text)
