"""``python -m distcomm run``: torchrun's flags and variables, a store that outlives any worker, lost
workers started again while the others go on, a log per rank and per attempt, an exit status that
names the failure. Run as users run it: the agent a process of its own (forked, see ``_forked``), its
workers fresh interpreters that it starts."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ._jobs import ELASTIC_DDP as ELASTIC
from .test_cli import cli, usage_error

PLAIN_TORCH = """
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")  # torch's env:// rendezvous, as under torchrun
    t = torch.ones(2) * dist.get_rank()
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: {t.tolist()}")
    dist.destroy_process_group()
"""

RAISES = """
    import distcomm
    comm = distcomm.from_env()
    comm.all_gather(1)
    if comm.rank == 1:
        raise KeyError("bad batch")
    comm.all_gather(2)
"""


def _script(tmp_path: Path, source: str) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(source))
    return str(path)


def test_a_plain_torch_script_runs_unchanged_with_its_output_prefixed_and_logged(tmp_path: Path) -> None:
    out = cli("run", "--nproc-per-node", "3", "--log-dir", str(tmp_path / "logs"), _script(tmp_path, PLAIN_TORCH),
              timeout=120)
    assert out.returncode == 0, out.stderr
    for r in range(3):
        assert f"[rank{r}]: rank {r} of 3: [3.0, 3.0]" in out.stdout, out.stdout
        assert (tmp_path / "logs" / f"rank{r}.log").read_text() == f"rank {r} of 3: [3.0, 3.0]\n"
    assert "distcomm run: the job finished" in out.stderr, out.stderr


@pytest.mark.parametrize("victim", [0, pytest.param(2, marks=pytest.mark.slow)])
def test_a_killed_worker_is_started_again_and_admitted_while_the_others_go_on(tmp_path: Path, victim: int) -> None:
    """Rank 0 too: the agent serves the job's store, so its loss is survivable without a process apart."""
    logs = tmp_path / "logs"
    out = cli("run", "--nproc-per-node", "3", "--replacements", "1", "--log-dir", str(logs),
              _script(tmp_path, ELASTIC), str(victim), timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"rank {victim} (pid " in out.stderr and "was lost (killed by SIGKILL); started again" in out.stderr
    assert out.stdout.count(f"done: members [0, 1, 2], admitted [{victim}]") == 3, out.stdout
    first, second = (logs / f"rank{victim}.log").read_text(), (logs / f"rank{victim}.1.log").read_text()
    assert first.startswith("started as rank") and "done" not in first, first  # the lost process's, kept
    assert f"admitted [{victim}]" in second and "done: members" in second, second


def test_a_worker_that_raises_fails_the_job_naming_it(tmp_path: Path) -> None:
    out = cli("run", "--nproc-per-node", "3", "--replacements", "1", _script(tmp_path, RAISES), timeout=120)
    assert out.returncode == 1, out.stderr
    assert "distcomm run: the job failed: rank 1 (pid " in out.stderr, out.stderr
    assert "exited with code 1: KeyError: 'bad batch'" in out.stderr, out.stderr


@pytest.mark.parametrize(("args", "said"), [
    (("--nnodes", "2", "--node-rank", "2"), "--node-rank 2 is out of range for --nnodes 2"),
    (("--nnodes", "2"), "a job of several machines needs --master-port"),
    (("--nproc-per-node", "0"), "--nproc-per-node must be 1 or more"),
    (("--replacements", "-1"), "--replacements must be 0 or more"),
])
def test_bad_input_gets_usage_before_any_worker_starts(tmp_path: Path, args: tuple[str, ...], said: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["run", *args, _script(tmp_path, PLAIN_TORCH)], capsys)
    assert said in err and "usage:" in err, err


def test_a_missing_script_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["run", str(tmp_path / "nope.py")], capsys)
    assert "no script" in err, err


PLAIN_TORCH_KILLED = """
    import os, signal, time, torch, torch.distributed as dist
    dist.init_process_group("gloo")
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)  # (the survivors could only wait for it: the job fails instead)
"""


def test_a_killed_worker_of_a_plain_torch_script_fails_the_job(tmp_path: Path) -> None:
    """Its survivors can't shrink: the agent ends them and names the killed one, as torchrun would,
    instead of waiting with them for torch's timeout."""
    out = cli("run", "--nproc-per-node", "3", "--replacements", "1", _script(tmp_path, PLAIN_TORCH_KILLED), timeout=120)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "distcomm run: the job failed: rank 1 (pid " in out.stderr and "killed by SIGKILL" in out.stderr, out.stderr


NO_ADMIT = """
    import os, signal, distcomm
    comm = distcomm.from_env()
    try:
        for step in range(5):
            if comm.rank == 2 and step == 3 and not comm.membership.admitted:
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_gather(step)
    except distcomm.PeerError:
        comm = comm.shrink()  # and the job ends: nobody admits the replacement
    comm.close()
"""


@pytest.mark.slow  # (a few seconds of real processes: the slow tier)
def test_a_replacement_nobody_lets_in_is_ended_once_the_members_stop_beating(tmp_path: Path) -> None:
    out = cli("run", "--nproc-per-node", "3", "--replacements", "1", _script(tmp_path, NO_ADMIT), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "started again, was never admitted: the others had ended" in out.stderr, out.stderr
