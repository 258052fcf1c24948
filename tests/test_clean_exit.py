"""A job that succeeded exits 0, every time: programs run many times over, their exit codes counted.

Aborts at interpreter exit ("terminate called without an active exception", status 134) came and
went with the threads' timing, so one run shows little; each test counts the exit codes of many."""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import distcomm

RUNS = 12


def _exit_codes(script: Path, source: str, ranks: int, runs: int = RUNS) -> collections.Counter[int]:
    """Every process's exit code over ``runs`` runs of ``source``, each run ``ranks`` processes (with
    argv: rank, world size, port)."""
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    codes: collections.Counter[int] = collections.Counter()
    for _ in range(runs):
        port = str(distcomm.free_port())
        procs = [subprocess.Popen([sys.executable, str(script), str(r), str(ranks), port], cwd=script.parent,
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for r in range(ranks)]
        for p in procs:
            try:
                codes[p.wait(timeout=60)] += 1
            except subprocess.TimeoutExpired:
                p.kill()
                codes[p.wait()] += 1
    return codes


ASYNC = textwrap.dedent("""
    import sys
    import torch
    from distcomm.testing import run_threaded

    sys.setswitchinterval(1e-5)  # the worker's last steps and the interpreter's exit, interleaved

    def fn(comm):
        w = torch.randn(1000, requires_grad=True)
        handles = [comm.all_gather_tensor(w * 2, async_op=True) for _ in range(4)]
        handles += [comm.all_gather({"x": torch.ones(10)}, async_op=True) for _ in range(2)]
        return [h.wait() is not None for h in handles]

    assert run_threaded(fn, 2)[0] == [True] * 6
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_program_whose_async_calls_were_waited_on_exits_0(tmp_path: Path) -> None:
    codes = _exit_codes(tmp_path / "job.py", ASYNC, ranks=1)
    assert codes == {0: RUNS}, codes



ADOPTED = textwrap.dedent("""
    import atexit, gc, os, sys, weakref
    import torch
    import torch.distributed as dist
    import distcomm

    rank, world, port = map(int, sys.argv[1:])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    group = weakref.ref(dist.distributed_c10d._get_default_group())

    def group_let_go():  # registered first, so it runs last of the exit handlers
        gc.collect()
        if group() is not None:  # torn down during finalisation, it can abort the process
            os._exit(3)

    atexit.register(group_let_go)
    out = distcomm.all_gather({"r": rank, "t": torch.ones(10)})  # adopts the default group
    distcomm.all_reduce(torch.ones(4))
    distcomm.reduce_dict({"a": torch.ones(3)})
    dist.destroy_process_group()  # without closing the communicator the helpers made
    assert len(out) == world
""")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_job_that_destroys_the_group_the_helpers_adopted_exits_0(tmp_path: Path) -> None:
    """Exit code 3: the group outlived the exit handlers (an abort, 134, in about 1 run in 7)."""
    codes = _exit_codes(tmp_path / "job.py", ADOPTED, ranks=3)
    assert codes == {0: 3 * RUNS}, codes


TORCHRUN_JOBS = {
    "from_env, never closed": """
        import distcomm
        comm = distcomm.from_env(timeout=60)
        assert comm.all_gather(comm.rank) == [0, 1]
    """,
    "compat.mmengine.init_dist, never closed": """
        import distcomm.compat.mmengine as dist
        dist.init_dist("pytorch", backend="gloo")
        assert dist.all_gather_object(dist.get_rank()) == [0, 1]
    """,
    "an adopted group, never destroyed": """
        import torch.distributed as torch_dist
        import distcomm
        torch_dist.init_process_group("gloo")
        assert distcomm.all_gather(distcomm.get_rank()) == [0, 1]
    """,
    "launch() under torchrun": """
        import distcomm
        def main():
            assert distcomm.all_gather(distcomm.get_rank()) == [0, 1]
        if __name__ == "__main__":
            distcomm.launch(main, 2)
    """,
}


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.parametrize("way", list(TORCHRUN_JOBS))
def test_a_torchrun_job_never_closed_exits_0_every_time(tmp_path: Path, way: str) -> None:
    """torchrun reports a job failed when a worker aborts at exit: 30 runs of each way a job starts."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(TORCHRUN_JOBS[way]))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    codes: collections.Counter[int] = collections.Counter()
    for _ in range(30):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(distcomm.free_port()), str(script)]
        codes[subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, timeout=120).returncode] += 1
    assert codes == {0: 30}, codes
