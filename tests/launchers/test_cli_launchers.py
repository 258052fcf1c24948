"""python -m distcomm env and check under each launcher, as a first hour on a cluster runs them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import distcomm

from ._cluster import python_env, run

pytestmark = pytest.mark.launchers

CHECK = [sys.executable, "-m", "distcomm", "check", "--timeout", "60"]


def _verdict(out: str, world: int) -> None:
    lines = [line for line in out.splitlines() if line.startswith(("host ", "OK:", "PROBLEM"))]
    assert f"OK: {world} ranks on 1 host" in out, out[-3000:]
    assert lines[0].startswith("host") and out.count("OK:") == 1, out[-3000:]  # rank 0 alone prints


def test_check_under_srun(slurm: dict[str, str], tmp_path: Path) -> None:
    env = python_env({"SLURM_CONF": slurm["SLURM_CONF"]})
    result = run(["srun", "-n", "3", "--time=5", *CHECK], env, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    _verdict(result.stdout, 3)
    said = run(["srun", "-n", "1", "--time=5", sys.executable, "-m", "distcomm", "env"], env, tmp_path)
    assert "launcher: slurm, rank 0 of 1" in said.stdout and "SLURM_STEP_ID=" in said.stdout, said.stdout


def test_check_under_mpirun(tmp_path: Path) -> None:
    mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "3"]
    result = run([*mpirun, *CHECK], python_env(), tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    _verdict(result.stdout, 3)
    said = run([*mpirun[:-1], "1", sys.executable, "-m", "distcomm", "env"], python_env(), tmp_path)
    assert "launcher: openmpi, rank 0 of 1" in said.stdout, said.stdout


def test_check_under_torchrun(tmp_path: Path) -> None:
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                "127.0.0.1", "--master-port", str(distcomm.free_port()), "-m", "distcomm"]
    result = run([*torchrun, "check", "--timeout", "60"], python_env(), tmp_path)
    assert result.returncode == 0, result.stdout[-3000:]
    _verdict(result.stdout, 2)
    said = run([*torchrun, "env"], python_env(), tmp_path)
    assert said.stdout.count("launcher: torchrun, rank ") == 2 and "TORCHELASTIC_RUN_ID=" in said.stdout, said.stdout
