"""The DDP job of ``recovery_ddp.py`` the way torchft runs it: each replica group (one process here)
with a store of its own, torchft's ``DistributedDataParallel`` and optimizer wrapper over Adam, and a
lighthouse that forms the quorum of each step (its defaults: a replica is dead after 5 s without a
heartbeat). The killed replica is started again at once; it joins at its own next quorum and heals
from a peer. torchft is installed apart (``make bench-recovery``: benchmarks/.deps)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import distcomm

DEPS = Path(__file__).parent / ".deps"
VERSION = "torchft-nightly 2026.10.26"

JOB = textwrap.dedent("""
    import json, os, signal, sys, time
    from datetime import timedelta
    import torch
    from torch.distributed import TCPStore
    from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    out, victim, steps = sys.argv[1], int(sys.argv[2]), 60
    replica, newcomer = int(os.environ["REPLICA_GROUP_ID"]), bool(os.environ.get("NEWCOMER"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    inner = torch.optim.Adam(model.parameters(), lr=1e-3)
    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, rank=0, world_size=1, store_addr="127.0.0.1",
                      store_port=store.port, replica_id=f"r{replica}",
                      load_state_dict=lambda s: (model.load_state_dict(s["model"]), inner.load_state_dict(s["opt"])),
                      state_dict=lambda: {"model": model.state_dict(), "opt": inner.state_dict()})
    ddp, opt = DistributedDataParallel(manager, model), OptimizerWrapper(manager, inner)
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    log, members = {"done": [], "joined": []}, 0
    while manager.current_step() < steps:
        if replica == victim and manager.current_step() == 20 and not newcomer:
            with open(os.path.join(out, "killed"), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        started, before = time.time(), manager.current_step()
        opt.zero_grad()  # (torchft's quorum for this step)
        ddp(x).pow(2).mean().backward()
        opt.step()  # (applied only where the step commits)
        if manager.current_step() > before:
            log["done"].append(time.time())
            if members and manager.num_participants() > members:
                log["joined"].append(started)
            members = manager.num_participants()
        time.sleep(0.05)  # the rest of a step
    print("RESULT " + json.dumps({"newcomer": newcomer, **log}), flush=True)
    manager.shutdown(wait=False)
""")


LIGHTHOUSE = "import sys\nfrom torchft._torchft import lighthouse_main\nsys.exit(lighthouse_main())\n"


def available() -> bool:
    probe = subprocess.run([sys.executable, "-c", "import torchft"], env=torchft_env(), capture_output=True,
                           timeout=120)
    return probe.returncode == 0


def torchft_env(**extra: str) -> dict[str, str]:
    """The environment of a process that imports torchft (from benchmarks/.deps): no rank variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    path = os.pathsep.join([str(DEPS), *(p for p in sys.path if p)])
    return {**env, "PYTHONPATH": path, **extra}


def start_lighthouse(work: Path) -> tuple[subprocess.Popen[bytes], str]:
    """torchft's lighthouse with its defaults (any quorum of one replica or more), and its address."""
    port = distcomm.free_port()
    (work / "lighthouse.py").write_text(LIGHTHOUSE)  # (it reads the process's own arguments: no -c)
    lighthouse = subprocess.Popen([sys.executable, str(work / "lighthouse.py"), "--min_replicas", "1",
                                   "--bind", f"127.0.0.1:{port}"], env=torchft_env(), stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
    return lighthouse, f"http://127.0.0.1:{port}"


def run(work: Path, world: int) -> list[dict[str, Any]]:
    """One job of ``world`` replicas, replica ``world - 1`` killed at step 20 and started again; each
    process's RESULT."""
    (work / "torchft_job.py").write_text(JOB)
    lighthouse, url = start_lighthouse(work)
    env = torchft_env(TORCHFT_LIGHTHOUSE=url)

    def start(replica: int, *newcomer: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, str(work / "torchft_job.py"), str(work), str(world - 1)],
                                env={**env, "REPLICA_GROUP_ID": str(replica), **dict.fromkeys(newcomer, "1")},
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)

    procs = [start(r) for r in range(world)]
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            if len(procs) == world and procs[-1].poll() == -signal.SIGKILL:  # started again at once
                procs.append(start(world - 1, "NEWCOMER"))
            time.sleep(0.05)
        outs = [p.communicate(timeout=5)[0] if p.poll() is not None else "" for p in procs]
    finally:
        for p in [*procs, lighthouse]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    results = [json.loads(m) for o in outs for m in re.findall(r"RESULT (\{[^{}]*\})", o)]
    if len(results) != world:
        raise RuntimeError(f"the torchft job ended with {len(results)} of {world} replicas done")
    return results
