"""Jobs whose ranks are real processes started as a job controller starts them (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT: a launcher whose survivors live on), each printing JSON lines. The
processes fork from a server that imported torch (see ``_forked``)."""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path
from typing import Any

import distcomm

from . import _forked

WAIT = 120.0  # the bound on any one job here: a bug fails the test instead of hanging CI

# DDP with Adam over the job's communicator, the docs' loop; the job rank argv[1] names is killed at step 3
# (its first process), and a replacement is let in by the members' admit().
ELASTIC_DDP = """
    import os, signal, sys, time, torch
    from torch.nn.parallel import DistributedDataParallel
    import distcomm

    victim = int(sys.argv[1])
    comm = distcomm.from_env()
    print(f"started as rank {comm.rank}, admitted {list(comm.membership.admitted)}", flush=True)
    model, progress, share = torch.nn.Linear(4, 1), {"step": 0}, True
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    newcomer, world = bool(comm.membership.admitted), comm.world_size
    while True:
        try:
            if share:
                comm.sync_state(model, opt, progress)
                ddp, share = DistributedDataParallel(model, process_group=comm.group), False
            # 15 steps, then on until the replacement is in (on a loaded machine it may take longer to
            # start than the steps left): decided once the state went round, so every member alike
            if progress["step"] >= 400 or (progress["step"] >= 15 and comm.world_size == world):
                break
            if comm.membership.job_ranks[comm.rank] == victim and progress["step"] == 3 and not newcomer:
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            ddp(x[comm.rank::comm.world_size]).pow(2).mean().backward()
            opt.step()
            progress["step"] += 1
            time.sleep(0.2)  # the rest of a step: the replacement starts meanwhile
            new = comm.admit()
            if new is not comm:
                comm, share = new, True
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            comm, share = comm.shrink(), True
    comm.check_identical(model, opt, progress)
    print(f"done: members {list(comm.membership.job_ranks)}, admitted {list(comm.membership.admitted)}", flush=True)
    comm.close()
"""


def job(tmp_path: Path, source: str, world: int, *args: str, ranks: list[int] | None = None,
         port: int | None = None, store_apart: bool = False, keyed: bool = True) -> tuple[int, dict[int, Any]]:
    """Start ``source`` as ranks ``ranks`` (default: all) of a job of ``world``, as a job controller does;
    with ``store_apart``, the job's store is served elsewhere (on ``port``: see ``_store_apart``). Each
    process gets the job's key (one per port, so that later calls for the same job give the same) as a
    user gives it under such a launcher, unless not ``keyed``."""
    script, written = tmp_path / "job.py", tmp_path / "job.py.new"
    written.write_text(textwrap.dedent(source))
    os.replace(written, script)  # whole: a rank of an earlier call may be reading it only now
    port = port or distcomm.free_port()
    procs = {}
    for r in range(world) if ranks is None else ranks:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RANK": str(r), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), **({"DISTCOMM_STORE": "external"} if store_apart else {})}
        env.pop("DISTCOMM_JOB_KEY", None)
        if keyed:
            env["DISTCOMM_JOB_KEY"] = job_key_for(port)
        procs[r] = _forked.start([str(script), *args], env, tmp_path)
    return port, procs


def job_key_for(port: int) -> str:
    """The key ``job`` gives the processes of the job on ``port``."""
    return f"the key of the test job on port {port}"


def ended(procs: dict[int, Any]) -> dict[int, tuple[int, list[Any], str]]:
    """Each rank's exit code, the JSON lines it printed, and its stderr; every process ended."""
    out = {}
    try:
        for r, p in procs.items():
            stdout, stderr = p.communicate(timeout=WAIT)
            lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
            out[r] = (p.returncode, lines, stderr[-3000:])
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(10)
    return out
