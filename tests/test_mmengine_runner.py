"""mmengine's whole framework on distcomm (compat.mmengine.install()): a Runner job under torchrun
gives what the same job gives on mmengine's own dist functions: the same logged scalars, the same
validation metrics and the same checkpoints, bit for bit."""

from __future__ import annotations

import glob
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import distcomm

JOB = Path(__file__).resolve().parent / "mmengine_runner" / "job.py"
TIMINGS = ("time", "data_time", "eta", "memory")


def _run(mode: str, work_dir: Path) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(distcomm.free_port()), str(JOB), mode, str(work_dir)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]


def _scalars(work_dir: Path) -> list[dict[str, Any]]:
    (path,) = glob.glob(str(work_dir / "*" / "vis_data" / "scalars.json"))
    rows = [json.loads(line) for line in Path(path).read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in TIMINGS} for row in rows]


@pytest.mark.slow
def test_a_runner_job_on_distcomm_is_the_same_job(tmp_path: Path) -> None:
    ours, theirs = tmp_path / "distcomm", tmp_path / "mmengine"
    _run("distcomm", ours)
    _run("mmengine", theirs)
    assert _scalars(ours) == _scalars(theirs) and len(_scalars(ours)) >= 6  # train losses, lr, val metrics
    assert json.loads((ours / "result.json").read_text()) == json.loads((theirs / "result.json").read_text())
    for epoch in (1, 2):
        mine = torch.load(ours / f"epoch_{epoch}.pth", weights_only=False)
        other = torch.load(theirs / f"epoch_{epoch}.pth", weights_only=False)
        assert mine["state_dict"].keys() == other["state_dict"].keys()
        assert all(torch.equal(mine["state_dict"][k], other["state_dict"][k]) for k in mine["state_dict"])
        assert mine["meta"]["epoch"] == other["meta"]["epoch"] == epoch
