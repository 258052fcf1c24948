"""``python -m distcomm run``: torchrun's flags and variables, a store that outlives any worker, lost
workers started again while the others go on, a log per rank and per attempt, an exit status that
names the failure. Run as users run it: the agent a process of its own (forked, see ``_forked``), its
workers fresh interpreters that it starts."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from . import _forked
from ._jobs import ELASTIC_DDP as ELASTIC
from .test_cli import ROOT, cli, usage_error

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


def _script(tmp_path: Path, source: str, name: str = "job.py") -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(source))
    return str(path)


def _agent(*args: str, env: dict[str, str] | None = None) -> Any:
    """``python -m distcomm run *args`` started, not waited for (``_ended`` waits)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return _forked.start(["-m", "distcomm", "run", *args], {**clean, **(env or {})}, ROOT)


def _ended(agent: Any, timeout: float = 120) -> tuple[int, str, str]:
    """The agent's exit status, stdout and stderr once it ended (killed after ``timeout`` seconds)."""
    try:
        out, err = agent.communicate(timeout=timeout)
    finally:
        if agent.poll() is None:
            agent.kill()
    return agent.returncode, out, err


def _wait_for(path: Path, agent: Any, seconds: float = 120) -> None:
    """Until ``path`` exists (a worker wrote it); the test fails if it never does or the agent ended."""
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline and agent.poll() is None, f"no {path.name}: {_ended(agent, 10)}"
        time.sleep(0.1)


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


SAVES_ON_SIGTERM = """
    import signal, sys, time
    from pathlib import Path
    here = Path(sys.argv[1])

    def save(signum, frame):
        time.sleep(6)  # a checkpoint that takes a while to write
        (here / "checkpoint").write_text("saved")
        sys.exit(0)

    signal.signal(signal.SIGTERM, save)
    (here / "ready").write_text("")
    while True:
        time.sleep(0.1)
"""


def test_sigterm_gives_the_workers_time_to_save_a_checkpoint(tmp_path: Path) -> None:
    """A preempted machine: SIGTERM to the agent is passed on, and the workers have 30 s (torchrun's
    grace) to end before SIGKILL."""
    agent = _agent(_script(tmp_path, SAVES_ON_SIGTERM), str(tmp_path))
    _wait_for(tmp_path / "ready", agent)
    agent.send_signal(signal.SIGTERM)
    code, _, err = _ended(agent)
    assert code == 143, err
    assert (tmp_path / "checkpoint").read_text() == "saved", err
    assert "SIGTERM: passed on to the workers, who have 30 s to end before SIGKILL" in err, err


def test_term_grace_must_be_a_number_of_seconds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = usage_error(["run", "--term-grace", "-1", _script(tmp_path, PLAIN_TORCH)], capsys)
    assert "--term-grace must be 0 or more seconds" in err, err


SURVIVES_RANK_0 = """
    import datetime, os, signal, sys, time, torch, distcomm
    comm = distcomm.from_env()
    step = 0
    while step < 8:
        try:
            if comm.membership.job_ranks[comm.rank] == 0 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_gather(step)
            step += 1
            time.sleep(0.1)
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            comm = comm.shrink()
    if sys.argv[1:] == ["forge"]:  # as an outsider who knows the store's port: "machine 1's agent ended"
        outsider = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                              is_master=False, timeout=datetime.timedelta(seconds=10))
        outsider.set("distcomm-run/agent/1/ended", "0")
        time.sleep(3)  # (the first agent looks every second)
        comm = comm.shrink()  # (needs the job's store)
    print(f"done: members {list(comm.membership.job_ranks)}, launcher {comm.launcher}", flush=True)
    comm.close()
"""


@pytest.mark.parametrize("outsider", [False, True])
def test_the_first_machines_agent_serves_the_store_until_the_others_end(tmp_path: Path, outsider: bool) -> None:
    """Two machines, one worker each: the first machine's worker is lost, and its agent keeps the
    job's store served until the other machine's worker is done (its shrink() needs it); an
    outsider's word that the other agent ended doesn't end it early."""
    import distcomm

    port = distcomm.free_port()
    env = {"DISTCOMM_JOB_KEY": f"the key of the two-machine job on port {port}"}
    script = _script(tmp_path, SURVIVES_RANK_0)
    agents = [_agent("--nnodes", "2", "--node-rank", str(k), "--master-port", str(port), script,
                     *(["forge"] if outsider else []), env=env) for k in (0, 1)]
    (code_0, _, err_0), (code_1, out_1, err_1) = [_ended(a) for a in agents]
    assert "done: members [1]" in out_1 and code_1 == 0, err_1[-3000:]
    assert code_0 == 0, err_0[-3000:]
    assert "serving the job's store until the other machines' agents end" in err_0, err_0


KILLED_BEFORE_FROM_ENV = """
    import os, signal, sys, time
    from pathlib import Path
    killed = Path(sys.argv[1]) / "killed"
    if os.environ["RANK"] == "1" and not killed.exists():
        killed.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)  # the OOM killer, while it builds its model
    time.sleep(2)  # (the others build theirs for longer)
    import distcomm
    comm = distcomm.from_env()
    print(f"done: {comm.all_gather(comm.rank)}", flush=True)
    comm.close()
"""


def test_a_worker_killed_before_it_met_the_others_is_started_again(tmp_path: Path) -> None:
    out = cli("run", "--nproc-per-node", "3", "--replacements", "1", _script(tmp_path, KILLED_BEFORE_FROM_ENV),
              str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 1 (pid " in out.stderr and "was lost (killed by SIGKILL); started again" in out.stderr, out.stderr
    assert out.stdout.count("done: [0, 1, 2]") == 3, out.stdout


MANY_LINES = """
    for i in range(20000):  # 2 MB: more than a pipe holds
        print(f"line {i:5d} " + "x" * 90)
"""


def test_output_to_a_reader_that_left_is_dropped_and_the_job_ends(tmp_path: Path) -> None:
    """``distcomm run train.py | head``: the workers' output is read and dropped once nobody reads it."""
    agent = _agent(_script(tmp_path, MANY_LINES))
    try:
        assert agent.stdout.readline().startswith("[rank0]: line     0")
        agent.stdout.close()
        assert agent.wait(120) == 0
        assert "the job finished" in agent.stderr.read()
    finally:
        if agent.poll() is None:
            agent.kill()


PROGRESS_BAR = """
    import sys, time
    from pathlib import Path
    sys.stdout.write("\\rtraining:  50%|#####     |")
    sys.stdout.flush()
    go, deadline = Path(sys.argv[1]) / "go", time.monotonic() + 100
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    print("\\rtraining: 100%|##########|")
"""


def test_a_progress_bar_shows_before_its_line_ends(tmp_path: Path) -> None:
    agent = _agent(_script(tmp_path, PROGRESS_BAR), str(tmp_path))
    try:
        seen, deadline = b"", time.monotonic() + 60
        while b"50%" not in seen and time.monotonic() < deadline and agent.poll() is None:
            if select.select([agent.stdout], [], [], 1.0)[0]:
                seen += os.read(agent.stdout.fileno(), 4096)
        assert seen == b"\r[rank0]: training:  50%|#####     |", seen
        (tmp_path / "go").write_text("")
        code, out, err = _ended(agent)
        assert code == 0, err
        assert out.strip() == "[rank0]: training: 100%|##########|", repr(out)  # (read with \r as a line end)
    finally:
        if agent.poll() is None:
            agent.kill()


RAISES_A_TABLE = """
    class BatchError(Exception):
        pass

    raise BatchError("the ranks disagree on the batch:\\nrank 0: 32 rows at job.py:6\\nrank 1: 31 rows at job.py:6")
"""

WARNED_THEN_KILLED = """
    import os, signal, warnings
    warnings.warn("this DataLoader will create 4 worker processes")
    print("loading", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize(("source", "summary"), [
    (RAISES_A_TABLE, "exited with code 1: BatchError: the ranks disagree on the batch:\n"),
    (WARNED_THEN_KILLED, "killed by SIGKILL\n"),
])
def test_a_failed_worker_is_summed_up_by_what_it_raised_or_by_its_signal(tmp_path: Path, source: str,
                                                                           summary: str) -> None:
    out = cli("run", _script(tmp_path, source), timeout=120)
    assert out.returncode == 1, out.stderr
    assert out.stderr.endswith(summary) and "the job failed: rank 0 (pid " in out.stderr, out.stderr


def test_a_port_another_process_holds_is_a_usage_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        err = usage_error(["run", "--master-port", str(port), _script(tmp_path, PLAIN_TORCH)], capsys)
    assert f"--master-port {port}: another process listens on it" in err, err
    assert "usage: python -m distcomm run" in err and "Traceback" not in err, err


@pytest.mark.parametrize("args", [("--log-dir", "{file}"), ("--standalone", "--nnodes", "2"), ("--bogus",)])
def test_bad_run_arguments_get_runs_own_usage(tmp_path: Path, args: tuple[str, ...],
                                              capsys: pytest.CaptureFixture[str]) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    err = usage_error(["run", *(a.format(file=file) for a in args), _script(tmp_path, PLAIN_TORCH)], capsys)
    assert err.startswith("usage: python -m distcomm run ") and "Traceback" not in err, err
    said = err.strip().splitlines()[-1]
    assert said.startswith("python -m distcomm run: error: ") and args[0] in said, err


def test_standalone_is_one_machine_on_a_free_port(tmp_path: Path) -> None:
    out = cli("run", "--standalone", "--nproc-per-node", "2", _script(tmp_path, PLAIN_TORCH), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "[rank1]: rank 1 of 2: [1.0, 1.0]" in out.stdout, out.stdout


def test_the_summary_counts_the_workers_that_finished_and_those_lost(tmp_path: Path) -> None:
    out = cli("run", "--nproc-per-node", "3", _script(tmp_path, SURVIVES_RANK_0), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("done: members [1, 2], launcher distcomm run") == 2, out.stdout
    assert "distcomm run: the job finished: 2 of 3 workers here finished, 1 lost: rank 0 (pid " in out.stderr, \
        out.stderr


IN_A_SESSION = """
    import os, subprocess, sys, time
    from pathlib import Path
    here, rank = Path(sys.argv[1]), os.environ["RANK"]
    child = subprocess.Popen(["sleep", "300"])  # (in its process group: ended with it)
    (here / f"{rank}.pids").write_text(f"{os.getpid()} {child.pid} {os.getsid(0)} {os.getpgid(0)}")
    try:
        while True:
            time.sleep(0.1)
    except KeyboardInterrupt:
        (here / f"{rank}.interrupted").write_text("")
        raise
"""


def test_each_worker_runs_in_a_session_of_its_own_and_ctrl_c_reaches_it(tmp_path: Path) -> None:
    """As torchrun starts them; a Ctrl-C at the terminal reaches the agent alone then, and the agent
    passes it on to each worker's process group (the worker and what it started)."""
    from .test_cli import _alive

    agent = _agent("--nproc-per-node", "2", _script(tmp_path, IN_A_SESSION), str(tmp_path))
    pids: list[list[int]] = []
    try:
        for r in (0, 1):
            _wait_for(tmp_path / f"{r}.pids", agent)
        pids = [[int(n) for n in (tmp_path / f"{r}.pids").read_text().split()] for r in (0, 1)]
        for pid, _, session, group in pids:
            assert session == pid == group != os.getsid(agent.pid), (pid, session, group)
        agent.send_signal(signal.SIGINT)
        code, _, err = _ended(agent)
        assert code == 130, err
        assert all((tmp_path / f"{r}.interrupted").exists() for r in (0, 1)), err
        deadline = time.monotonic() + 30
        while any(_alive(p) for pid in pids for p in pid[:2]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for pid in pids for p in pid[:2]), pids
    finally:
        if agent.poll() is None:
            agent.kill()
        for pid in pids:  # (what a failed test left: the workers' children outlive the agent)
            for p in pid[:2]:
                with contextlib.suppress(OSError):
                    if b"sleep" in Path(f"/proc/{p}/cmdline").read_bytes() or b"job.py" in \
                            Path(f"/proc/{p}/cmdline").read_bytes():
                        os.kill(p, signal.SIGKILL)


ALONE_KILLED_BEFORE_FROM_ENV = """
    import os, signal, sys, time
    from pathlib import Path
    killed = Path(sys.argv[1]) / "killed"
    if not killed.exists():
        killed.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(3)  # (past the agent's grace for processes that wait to be let in)
    import distcomm
    comm = distcomm.from_env()
    print(f"done: {comm.all_gather(comm.rank)}", flush=True)
    comm.close()
"""


def test_a_worker_started_again_before_the_first_meeting_is_a_member_not_a_newcomer(tmp_path: Path) -> None:
    """Every running process is one started again, and no member beats: the replacement of a worker
    lost before anyone met is the job's own worker, not one that waits for an admit (it was ended
    as 'never admitted', the job failed)."""
    out = cli("run", "--nproc-per-node", "1", "--replacements", "1", _script(tmp_path, ALONE_KILLED_BEFORE_FROM_ENV),
              str(tmp_path), timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "never admitted" not in out.stderr and "to be admitted" not in out.stderr, out.stderr
    assert out.stdout.count("done: [0]") == 1, out.stdout


LOSES_ONE_UNHEARD = """
    import os, signal, sys, time
    from pathlib import Path
    import distcomm
    print("started", flush=True)
    comm = distcomm.from_env()
    step = 0
    while step < 30:
        try:
            if comm.membership.job_ranks[comm.rank] == 1 and step == 10:
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_gather(step)
            step += 1
            time.sleep(0.1)
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            comm = comm.shrink()
    Path(sys.argv[1], f"finished-{os.environ['RANK']}").write_text("")
    comm.close()
"""


def test_the_agents_own_lines_to_a_reader_that_left_are_dropped_too(tmp_path: Path) -> None:
    """``distcomm run train.py 2>&1 | head``: the agent's own lines (a worker lost, the summary)
    are dropped as the workers' are; the job runs to its end and says it finished by its status."""
    agent = _agent("--nproc-per-node", "2", _script(tmp_path, LOSES_ONE_UNHEARD), str(tmp_path))
    try:
        assert agent.stdout.readline().endswith(": started\n")
        agent.stdout.close()
        agent.stderr.close()
        assert agent.wait(120) == 0
    finally:
        if agent.poll() is None:
            agent.kill()
    assert (tmp_path / "finished-0").exists()


def test_an_agent_under_nohup_outlives_a_hang_up(tmp_path: Path) -> None:
    """A signal the agent was started with ignored (nohup's SIGHUP) stays ignored: it was passed on
    to the workers, and logging out ended the job."""
    script = _script(tmp_path, """
        import time
        print("working", flush=True)
        time.sleep(3)
        print("done", flush=True)
    """)
    nohup = _script(tmp_path, f"""
        import runpy, signal, sys
        signal.signal(signal.SIGHUP, signal.SIG_IGN)  # as nohup starts it
        sys.argv = ["distcomm", "run", {script!r}]
        runpy.run_module("distcomm", run_name="__main__")
    """, name="nohup.py")
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    agent = _forked.start([nohup], clean, ROOT)
    try:
        assert agent.stdout.readline().endswith("working\n")
        agent.send_signal(signal.SIGHUP)
        code, out, err = _ended(agent)
    finally:
        if agent.poll() is None:
            agent.kill()
    assert code == 0 and "done" in out, err


def test_records_of_another_job_or_without_the_key_dont_end_the_stores_service() -> None:
    """The first agent serves the job's store until the other agents say they ended, in records
    signed with the job's key under the job's random name: one written without the key, or copied
    from an earlier job of the same key, doesn't end it."""
    import threading

    import torch

    from distcomm._launching import agent as run_agent
    from distcomm._trust.key import JobKey
    from distcomm._trust.records import Records

    key = "the key of a job that ran before"
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DISTCOMM_JOB_KEY", key)
        name = run_agent._named_job(store)
        signed = Records(store, JobKey(key.encode()), "")
        signed.set(run_agent._ended_key("0123456789abcdef", 1), "0")  # an earlier job's, replayed
        store.set(run_agent._ended_key(name, 1), "0")  # an outsider's, unsigned
        store.set(run_agent._beat_key(name, 1), b"\xff\xfe")  # (not even text)
        got: list[dict[int, int | None]] = []
        serving = threading.Thread(target=lambda: got.append(run_agent._serve_until_the_others_end(store, name, 2)))
        with pytest.warns(RuntimeWarning, match="not written with the job's key"):
            serving.start()
            serving.join(3.0)
            assert serving.is_alive() and not got  # still serving
        signed.set(run_agent._ended_key(name, 1), "0")  # the other agent's own
        serving.join(10.0)
        assert got == [{1: 0}]


def test_what_a_worker_started_is_ended_with_it(tmp_path: Path) -> None:
    """A worker that ends at once on SIGTERM, leaving a child that ignores it: once the grace is
    over the worker's process group is killed, not only the worker (the child lived on, its parent
    gone, in a session no hang-up reaches)."""
    script = _script(tmp_path, f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import signal, sys, time; "
                                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(120)"],
                                 stdout=subprocess.PIPE)
        child.stdout.readline()  # (it ignores SIGTERM from now on)
        open({str(tmp_path / "child")!r}, "w").write(str(child.pid))
        print("working", flush=True)
        time.sleep(120)
    """)
    agent = _agent("--term-grace", "2", script)
    try:
        assert agent.stdout.readline().endswith("working\n")
        agent.send_signal(signal.SIGTERM)
        code, _, err = _ended(agent)
    finally:
        if agent.poll() is None:
            agent.kill()
    child = int((tmp_path / "child").read_text())
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _running(child)
    if alive:
        os.kill(child, signal.SIGKILL)
    assert code == 143 and not alive, err


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (not a zombie waiting for init to reap it)."""
    try:
        return not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return False
