"""The command line: python -m distcomm env / check / bench, run as users run it (subprocesses)."""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import redirect_stdout
from pathlib import Path

import pytest

import distcomm
from distcomm.testing import spawn

from . import _forked

ROOT = Path(__file__).resolve().parent.parent


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """``python -m distcomm *args`` in a process of its own (forked: see ``_forked``; the entry point
    in a fresh interpreter: ``test_bad_input_to_python_m_distcomm_gets_usage_and_exit_status_2``)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return _forked.run(["-m", "distcomm", *args], {**clean, **(env or {})}, ROOT, timeout)


def test_env_says_what_it_reads_and_from_where() -> None:
    out = cli("env", "--json", env={"RANK": "1", "WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                                    "MASTER_PORT": "29511", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["versions"]["distcomm"] == distcomm.__version__ and report["versions"]["gloo"] == "yes"
    launch = report["launch"]
    assert (launch["launcher"], launch["rank"], launch["world_size"], launch["local_size"]) == ("env", 1, 4, 4)
    assert launch["master_port"] == 29511 and launch["master_port_from"] == "MASTER_PORT"
    assert report["variables"]["WORLD_SIZE"] == "4"
    assert report["gloo_interface"]["address"] and "chosen_by" in report["gloo_interface"]
    plain = cli("env")
    assert plain.returncode == 0 and "launcher: python, rank 0 of 1" in plain.stdout
    assert "gloo interface:" in plain.stdout


def test_env_names_contradicting_variables_and_fails() -> None:
    out = cli("env", env={"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_JOB_ID": "7",
                          "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_NODES": "1",
                          "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_STEP_NODELIST": "n1", "WORLD_SIZE": "3"})
    assert out.returncode == 1 and "problem: WORLD_SIZE=3 contradicts slurm's 2" in out.stdout, out.stdout


def test_check_on_this_machine_prints_one_table_and_a_verdict() -> None:
    out = cli("check", "--nproc", "3")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert lines[0].split()[:3] == ["host", "rank", "local"] and len(lines) == 5, out.stdout
    assert [int(line.split()[1]) for line in lines[1:4]] == [0, 1, 2]
    assert lines[-1].startswith("OK: 3 ranks on 1 host") and "8 collectives gave exact results" in lines[-1]


def test_check_names_a_host_that_does_not_resolve() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29632"}
    out = cli("check", "--timeout", "10", env=env)
    assert out.returncode == 1
    assert "PROBLEM (rank 1)" in out.stderr and "'no-such-host.invalid' does not resolve" in out.stderr, out.stderr
    assert "frame #" not in out.stderr and "Traceback" not in out.stderr


def test_check_under_a_launcher_refuses_nproc() -> None:
    out = cli("check", "--nproc", "2", env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                            "MASTER_PORT": "29633"})
    assert out.returncode == 2 and "env started this process: it sets the ranks, so drop --nproc" in out.stderr


def _other_version_on_rank_1(comm: distcomm.Communicator) -> tuple[bool, str]:
    from distcomm._cli.check import check_rank

    if comm.rank == 1:
        distcomm.__version__ = "9.9.9"  # this process only
    printed = io.StringIO()
    with redirect_stdout(printed):
        ok = check_rank()
    return ok, printed.getvalue()


def test_check_names_ranks_with_other_versions() -> None:
    (ok, printed), (ok_1, printed_1) = spawn(_other_version_on_rank_1, 2, timeout=120, reuse=False)
    assert not ok and not ok_1 and printed_1 == ""  # every rank stops before any collective; rank 0 says why
    assert f"PROBLEM: versions differ: rank 0 runs distcomm {distcomm.__version__}" in printed
    assert "rank 1 distcomm 9.9.9" in printed and "install the same versions on every machine" in printed


def test_bench_prints_a_table_beside_torch_and_plots(tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    out = cli("bench", "--nproc", "2", "--sizes", "1K,64K", "--plot", str(png))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.startswith("| all_") or line.startswith("| broadcast")]
    assert len(rows) == 8, out.stdout
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2].endswith(" ms") and cells[3].endswith(" ms") and cells[4].endswith("x")
    assert png.stat().st_size > 1000
    assert "bench: all_gather 1 KiB [1/8]" in out.stderr  # progress, on stderr


@pytest.mark.parametrize("args, said", [
    (("bench", "--sizes", "12Q"), "a size is a number of bytes"),
    (("bench", "--sizes", "1T"), "a size is a number of bytes"),
    (("bench", "--nproc", "2", "--sizes", "400G"), "pass smaller --sizes"),
    (("bench", "--nproc", "1"), "bench compares collectives between ranks"),
    (("bench", "--sizes", "inf"), "a size must be at least one byte"),
    (("bench", "--sizes", "0.1"), "a size must be at least one byte"),
    (("bench", "--sizes", ","), "--sizes names no size"),
    (("check", "--timeout", "-1"), "--timeout must be a positive, finite number"),
    (("check", "--timeout", "nan"), "--timeout must be a positive, finite number"),
    (("bench", "--timeout", "inf"), "--timeout must be a positive, finite number"),
    (("check", "--backend", "nccl"), "--backend nccl needs CUDA"),
    (("frobnicate",), "invalid choice: 'frobnicate'"),
    (("check", "--bogus"), "unrecognized arguments: --bogus"),
])
def test_bad_input_gets_usage_before_anything_starts(args: tuple[str, ...], said: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(args, capsys)
    assert said in err and "usage:" in err, err


def usage_error(args: Sequence[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What the command line's own function says on stderr when it ends with status 2, in this
    process, having started nothing: the parsing is the point, and a fresh interpreter per case cost
    a second of torch's import (the entry point itself: the next test)."""
    from distcomm.__main__ import main

    before = threading.active_count(), set(multiprocessing.active_children())
    with pytest.raises(SystemExit) as ended:
        main(list(args))
    err = capsys.readouterr().err
    assert ended.value.code == 2, err
    assert (threading.active_count(), set(multiprocessing.active_children())) == before
    return err


def test_bad_input_to_python_m_distcomm_gets_usage_and_exit_status_2() -> None:
    out = subprocess.run([sys.executable, "-m", "distcomm", "bench", "--sizes", "12Q"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "a size is a number of bytes" in out.stderr and "usage:" in out.stderr, out.stderr


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(c) for c in text]
    return found


def test_ctrl_c_leaves_nothing_running() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "distcomm", "bench", "--nproc", "2", "--sizes", "1K,4M,16M"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        line = proc.stderr.readline()  # the first progress line: the ranks are running
        assert "bench:" in line, line
        ranks = _children(proc.pid)
        assert ranks
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in ranks), ranks
    finally:
        if proc.poll() is None:
            proc.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wrong_on_rank_1(comm: distcomm.Communicator) -> tuple[bool, str]:
    from distcomm._cli import check as _cli_check

    if comm.rank == 1:  # a check that finds a wrong value on one rank only
        _cli_check._CHECKS.append(("odd", lambda c: "got 41, wanted 42"))
    else:
        _cli_check._CHECKS.append(("odd", lambda c: ""))
    printed = io.StringIO()
    with redirect_stdout(printed):
        ok = _cli_check.check_rank()
    return ok, printed.getvalue()


def test_a_problem_on_one_rank_reaches_rank_0s_verdict_without_a_hang() -> None:
    (ok, printed), (ok_1, _) = spawn(_wrong_on_rank_1, 2, timeout=120, reuse=False)
    assert not ok and "PROBLEM: rank 1: odd: got 41, wanted 42" in printed and "OK:" not in printed
    assert not ok_1  # rank 1 knows its own problem

