"""launch() over two simulated machines, and a from_env() script under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import distcomm

LAUNCHED = textwrap.dedent("""
    import json, sys
    import distcomm

    def main(out_dir):
        comm = distcomm.current()
        info = {
            "rank": comm.rank, "world": comm.world_size, "local_rank": comm.local_rank,
            "local_size": comm.local_size, "helper_local_rank": distcomm.get_local_rank(),
            "helper_local_size": distcomm.get_local_size(), "type": type(comm).__name__,
            "machines": distcomm.all_gather(int(sys.argv[1])),
        }
        with open(f"{out_dir}/rank{comm.rank}.json", "w") as f:
            json.dump(info, f)

    if __name__ == "__main__":
        machine, url, out_dir = int(sys.argv[1]), sys.argv[2], sys.argv[3]
        distcomm.launch(main, 2, num_machines=2, machine_rank=machine, dist_url=url, args=(out_dir,), timeout=60)
""")


def _run_all(cmds: list[list[str]], cwd: Path, timeout: float = 150) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]


@pytest.mark.slow
def test_launch_two_simulated_machines(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(LAUNCHED)
    url = f"tcp://127.0.0.1:{distcomm.free_port()}"
    _run_all([[sys.executable, str(script), str(m), url, str(tmp_path)] for m in (0, 1)], tmp_path)
    infos = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, info in enumerate(infos):
        assert info["rank"] == r and info["world"] == 4 and info["type"] == "GlooCommunicator"
        assert (info["local_rank"], info["local_size"]) == (r % 2, 2)
        assert (info["helper_local_rank"], info["helper_local_size"]) == (r % 2, 2)
        assert info["machines"] == [0, 0, 1, 1]


@pytest.mark.slow
def test_launch_one_machine_with_a_closure(tmp_path: Path) -> None:
    script = tmp_path / "one.py"
    script.write_text(textwrap.dedent(f"""
        import distcomm
        out = {str(tmp_path)!r}
        if __name__ == "__main__":
            tag = "closure"
            distcomm.launch(lambda: open(f"{{out}}/r{{distcomm.get_rank()}}", "w").write(
                tag + str(distcomm.all_gather(distcomm.get_local_rank()))), 2)
    """))
    _run_all([[sys.executable, str(script)]], tmp_path)
    assert [(tmp_path / f"r{r}").read_text() for r in range(2)] == ["closure[0, 1]", "closure[0, 1]"]


def test_launch_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_processes_per_machine"):
        distcomm.launch(print, 0)
    with pytest.raises(ValueError, match="machine_rank=2 is out of range"):
        distcomm.launch(print, 1, num_machines=2, machine_rank=2, dist_url="tcp://127.0.0.1:1")
    with pytest.raises(ValueError, match="dist_url='auto' only works with num_machines=1"):
        distcomm.launch(print, 1, num_machines=2)
    with pytest.raises(ValueError, match="backend"):
        distcomm.launch(print, 1, backend="mpi")
    with pytest.raises(TypeError, match="callable"):
        distcomm.launch("main", 1)  # type: ignore[arg-type]


TORCHRUN = textwrap.dedent("""
    import json, sys
    import distcomm

    with distcomm.GlooCommunicator.from_env(timeout=60) as comm, distcomm.use(comm):
        info = {"rank": comm.rank, "local": [comm.local_rank, comm.local_size],
                "all": distcomm.all_gather(comm.rank), "red": float(comm.all_reduce_dict(
                    {"x": __import__("torch").tensor(float(comm.rank))})["x"])}
        with open(f"{sys.argv[1]}/tr{comm.rank}.json", "w") as f:
            json.dump(info, f)
""")


@pytest.mark.slow
def test_from_env_under_torchrun(tmp_path: Path) -> None:
    script = tmp_path / "tr.py"
    script.write_text(TORCHRUN)
    port = distcomm.free_port()
    _run_all([[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
               "127.0.0.1", "--master-port", str(port), str(script), str(tmp_path)]], tmp_path)
    for r in range(2):
        info = json.loads((tmp_path / f"tr{r}.json").read_text())
        assert info == {"rank": r, "local": [r, 2], "all": [0, 1], "red": 0.5}


def _gloo_threads_after_close(comm: distcomm.Communicator) -> tuple[int, int]:
    def gloo_threads() -> int:
        names = []
        for task in os.listdir("/proc/self/task"):
            try:
                names.append(Path(f"/proc/self/task/{task}/comm").read_text())
            except OSError:
                pass
        return sum("gloo" in n for n in names)

    comm.all_gather([torch.ones(3) * comm.rank])
    comm.reduce_dict({"loss": torch.tensor(1.0)})
    before = gloo_threads()
    comm.close()  # this communicator owns the job's default group
    return before, gloo_threads()


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux /proc to count threads")
# 6: the header exchange's groups (and its calls, made once) too
@pytest.mark.parametrize("world", [2, pytest.param(6, marks=pytest.mark.slow)])
def test_close_tears_the_owned_groups_down_at_once(world: int) -> None:
    """The gloo threads are gone when close() returns, not left running into interpreter exit."""
    for before, after in distcomm.testing.spawn(_gloo_threads_after_close, world, timeout=90, reuse=False):
        assert before > 0
        assert after == 0


HANGING = textwrap.dedent("""
    import os, sys, time
    import distcomm

    def main(out_dir):
        open(f"{out_dir}/pid{distcomm.get_rank()}", "w").write(str(os.getpid()))
        if distcomm.get_rank() == 1:
            time.sleep(600)  # rank 0 waits for it in synchronize
        distcomm.synchronize()

    if __name__ == "__main__":
        import signal
        if sys.argv[2] == "ignore-sigint":
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        else:  # Ctrl-C as a terminal delivers it, even when pytest runs as a shell's background job
            signal.signal(signal.SIGINT, signal.default_int_handler)
        distcomm.launch(main, 2, args=(sys.argv[1],), timeout=600)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def _start_hanging(tmp_path: Path, mode: str) -> tuple[subprocess.Popen[str], list[int]]:
    import time

    script = tmp_path / "hang.py"
    script.write_text(HANGING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path), mode], cwd=tmp_path, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not all((tmp_path / f"pid{r}").exists() and (tmp_path / f"pid{r}").read_text() for r in (0, 1)):
        if parent.poll() is not None or time.monotonic() > deadline:
            parent.kill()  # before reading its output, which would otherwise wait for a launcher that hangs
            pytest.fail("the launched processes didn't start:\n" + parent.communicate()[0][-3000:])
        time.sleep(0.2)
    time.sleep(1.0)  # both ranks are inside main (rank 0 in synchronize)
    return parent, [int((tmp_path / f"pid{r}").read_text()) for r in (0, 1)]


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    import time

    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


@pytest.mark.slow
def test_sigint_to_the_launcher_alone_ends_it_and_its_processes(tmp_path: Path) -> None:
    """SIGINT sent to launch()'s PID only (not its process group): the launcher raises
    KeyboardInterrupt within a few seconds and ends its processes; it used to hang with them."""
    import signal

    parent, children = _start_hanging(tmp_path, "default")
    try:
        os.kill(parent.pid, signal.SIGINT)
        out = parent.communicate(timeout=30)[0]
        assert parent.returncode != 0 and "KeyboardInterrupt" in out, out[-3000:]
        assert _wait_gone(children, 15) == []
    finally:
        parent.kill()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
def test_a_launcher_killed_outright_leaves_no_orphan(tmp_path: Path) -> None:
    """SIGKILL to a launcher that ignores SIGINT: its processes die with it (the kernel's parent-death
    signal), where one used to stay behind as an orphan."""
    import signal

    parent, children = _start_hanging(tmp_path, "ignore-sigint")
    try:
        os.kill(parent.pid, signal.SIGINT)  # ignored
        parent.kill()
        parent.communicate(timeout=30)
        assert _wait_gone(children, 15) == []
    finally:
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


_PRINTS = """
import sys
import distcomm

def main():
    print(f"hello from {distcomm.get_rank()}", flush=True)
    print("on stderr", file=sys.stderr, flush=True)

if __name__ == "__main__":
    prefix = {"yes": True, "no": False, "default": None}[sys.argv[1]]
    distcomm.launch(main, 2, timeout=60, prefix_output=prefix, log_dir=sys.argv[2] if len(sys.argv) > 2 else None)
"""


@pytest.mark.slow
def test_launch_prefixes_each_ranks_lines_and_keeps_a_log_per_rank(tmp_path: Path) -> None:
    (tmp_path / "job.py").write_text(_PRINTS)

    def job(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "job.py", *args], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120)

    out = job("yes", str(tmp_path / "logs"))
    assert out.returncode == 0, out.stderr
    assert sorted(out.stdout.splitlines()) == ["[rank0]: hello from 0", "[rank1]: hello from 1"]
    assert sorted(line for line in out.stderr.splitlines() if "on stderr" in line) == [
        "[rank0]: on stderr", "[rank1]: on stderr"]
    for r in (0, 1):
        assert (tmp_path / "logs" / f"rank{r}.log").read_text() == f"hello from {r}\non stderr\n"
    plain = job("default")  # a pipe, not a terminal: left as it is (two processes' prints may interleave)
    assert plain.returncode == 0 and "[rank" not in plain.stdout + plain.stderr
    assert "hello from 0" in plain.stdout and "hello from 1" in plain.stdout


def _replaced_then_slow(out: str) -> None:
    """Job rank 1 dies at step 2; its replacement, once let in, finishes last (the members are done)."""
    import signal
    import time

    comm = distcomm.current()
    newcomer = bool(comm.membership.admitted)
    print(f"job rank {comm.membership.job_ranks[comm.rank]} started", flush=True)
    progress, share = {"step": 0}, True
    while progress["step"] < 12:
        try:
            if share:
                comm.sync_state(progress)
                share = False
            if comm.membership.job_ranks[comm.rank] == 1 and progress["step"] == 2 and not newcomer:
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_gather(0)
            progress["step"] += 1
            time.sleep(0.3)
            new = comm.admit()
            if new is not comm:
                comm, share = new, True
        except distcomm.DistCommError:
            comm, share = comm.shrink(), True
    if newcomer:
        time.sleep(4.0)  # still working when every member has ended
        Path(out, "replacement-finished").write_text("yes")


@pytest.mark.slow  # (a few seconds of real processes: the slow tier)
def test_an_admitted_replacement_still_working_is_waited_for_and_logs_apart(tmp_path: Path) -> None:
    """launch(elastic=True) ended an admitted replacement that outlived the members, saying it "was never
    admitted"; and a replacement's log took the place of the lost process's."""
    logs = tmp_path / "logs"
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).resolve().parent.parent)!r})
        import distcomm
        from tests.test_launch import _replaced_then_slow
        if __name__ == "__main__":
            distcomm.launch(_replaced_then_slow, 3, args=({str(tmp_path)!r},), elastic=True, replacements=1,
                            timeout=60, log_dir={str(logs)!r})
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "never admitted" not in out.stderr, out.stderr
    assert (tmp_path / "replacement-finished").exists(), out.stderr[-3000:]
    assert (logs / "rank1.log").read_text() == (logs / "rank1.1.log").read_text() == "job rank 1 started\n"
