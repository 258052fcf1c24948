"""torchrun: from_env, a launch() script in its workers, elastic restarts, a rendezvous that can't complete."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import distcomm

from ._cluster import python_env, run
from ._output import ranks_said

pytestmark = pytest.mark.launchers


def _torchrun(script: Path, *args: str, restarts: int = 0, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
                str(restarts), "--master-addr", "127.0.0.1", "--master-port", str(distcomm.free_port()),
                str(script), *args], python_env(), script.parent, timeout=timeout)


def test_torchrun_from_env(scripts: Path) -> None:
    said = ranks_said(_torchrun(scripts / "who.py"), 2)
    assert [(s["local"], s["launcher"], s["gathered"]) for s in said] == [([0, 2], "torchrun", [0, 1]),
                                                                         ([1, 2], "torchrun", [0, 1])]


def test_torchrun_runs_a_launch_script_in_its_workers(scripts: Path) -> None:
    """It hung for the whole timeout: launch() started processes that waited on torchrun's store."""
    said = ranks_said(_torchrun(scripts / "d2.py", "2"), 2)
    assert [(s["launcher"], s["gathered"]) for s in said] == [("torchrun", [0, 1])] * 2
    refused = _torchrun(scripts / "d2.py", "4")
    assert refused.returncode != 0
    assert "asked for 4 processes per machine, but torchrun started" in refused.stdout


RESTARTING = textwrap.dedent("""
    import os
    import distcomm

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    with distcomm.from_env(timeout=30) as comm, distcomm.use(comm):
        got = distcomm.all_gather((attempt, comm.rank))
        print(f"UP attempt {attempt} rank {comm.rank}: {got}", flush=True)
        if attempt < 20 and comm.rank == attempt % 2:
            raise SystemExit(3)  # one rank fails each attempt; torchrun restarts them all
""")


def test_torchrun_restarts_come_up_every_time(tmp_path: Path) -> None:
    """20 restarts, each with a rank that fails after set-up: every attempt's workers come up (with
    torch's own initialisation about half of them failed, reading a dead attempt's addresses)."""
    script = tmp_path / "restarting.py"
    script.write_text(RESTARTING)
    result = _torchrun(script, restarts=20, timeout=400)
    assert result.returncode == 0, result.stdout[-4000:]
    for attempt in range(21):  # the ranks met in every attempt (each gathered the other's)
        up = [f"UP attempt {attempt} rank {r}: [({attempt}, 0), ({attempt}, 1)]" for r in (0, 1)]
        assert any(line in result.stdout for line in up), (attempt, result.stdout[-4000:])


NEVER_COMES = textwrap.dedent("""
    import os, time
    import distcomm

    if os.environ["RANK"] == "1":
        time.sleep(60)  # never reaches the rendezvous; torchrun ends it when rank 0 fails
    distcomm.from_env(timeout=5)
""")


def test_a_rendezvous_that_cannot_complete_names_who_it_waited_for(tmp_path: Path) -> None:
    script = tmp_path / "never.py"
    script.write_text(NEVER_COMES)
    result = _torchrun(script, timeout=90)
    assert result.returncode != 0
    assert "CollectiveTimeoutError: torchrun's rendezvous at 127.0.0.1" in result.stdout, result.stdout[-3000:]
    assert "did not complete within 5 s: rank 0 waited for rank(s) 1 of 2" in result.stdout


TWICE = textwrap.dedent("""
    import os, time
    import distcomm

    for round_ in range(2):
        if round_ == 1 and os.environ["RANK"] == "0":
            time.sleep(3)  # rank 1 reaches the second rendezvous first, where the first's keys still are
        with distcomm.from_env(timeout=30) as comm:
            print(f"ROUND {round_} rank {comm.rank}: {comm.all_gather((round_, comm.rank))}", flush=True)
""")


def test_two_rendezvous_in_one_attempt(tmp_path: Path) -> None:
    """close(), then from_env() again in the same torchrun attempt: the second meets afresh (it
    used to read the first one's addresses and fail after the timeout several times over)."""
    script = tmp_path / "twice.py"
    script.write_text(TWICE)
    result = _torchrun(script)
    assert result.returncode == 0, result.stdout[-4000:]
    for round_ in range(2):
        for r in range(2):
            assert f"ROUND {round_} rank {r}: [({round_}, 0), ({round_}, 1)]" in result.stdout


def test_a_rendezvous_whose_agent_does_not_share_its_store(scripts: Path) -> None:
    """torchrun's c10d rendezvous with the agent's store not shared (as with etcd, or custom
    handlers): rank 0 hosts the workers' store, as torch's own initialisation does."""
    result = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                  "--rdzv-endpoint", f"127.0.0.1:{distcomm.free_port()}", str(scripts / "who.py")],
                 python_env({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}), scripts)
    said = ranks_said(result, 2)
    assert [(s["launcher"], s["gathered"]) for s in said] == [("torchrun", [0, 1])] * 2


STORE_HOST = textwrap.dedent("""
    import distcomm
    from distcomm._elastic.failure_report import store_host

    with distcomm.from_env(timeout=30) as comm:
        print(f"HOST rank {comm.rank}: {store_host(comm)}", flush=True)
""")


def test_a_failure_report_does_not_blame_rank_0_for_the_agents_store(tmp_path: Path) -> None:
    """Under torchrun the agent serves the store: a rank that can't reach it mustn't name rank 0."""
    script = tmp_path / "host.py"
    script.write_text(STORE_HOST)
    result = _torchrun(script)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "HOST rank 0: None" in result.stdout and "HOST rank 1: None" in result.stdout
