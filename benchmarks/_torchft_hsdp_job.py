"""The HSDP job of ``recovery_hsdp.py`` the way torchft runs it: two replica groups, each its own
``torchrun --nproc-per-node 2 --max-restarts 1`` (gloo), FSDP2 over the group's own 2-rank mesh, the
gradient shards averaged across the groups by torchft's Manager (FSDP's all-reduce hook calling
``manager.allreduce``: torchft's HSDP shape since its ``ft_init_device_mesh``/``ManagedDeviceMesh``
were dropped; this nightly has neither), ``OptimizerWrapper`` over Adam, and a lighthouse (its
defaults: a replica group is dead after 5 s without a heartbeat). A rank killed in group 1 makes its
torchrun end and restart the whole group; the restarted group heals (its shards and Adam's, per
group rank, over torchft's HTTP transport) from group 0 at its first quorum. torchft is installed
apart (``make bench-recovery``: benchmarks/.deps)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from _torchft_job import start_lighthouse, torchft_env

import distcomm

JOB = textwrap.dedent("""
    import json, os, signal, sys, time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from torch.distributed import PrefixStore, TCPStore
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchft import Manager, ProcessGroupGloo
    from torchft.optim import OptimizerWrapper

    out, kill_step, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    replica = int(os.environ["REPLICA_GROUP_ID"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    newcomer = attempt > 0  # (the group restarted)
    # (torchrun's static rendezvous keeps one store across restarts: without a prefix of the attempt's
    # own, a restarted rank may read its peer's gloo address of the attempt before)
    agent = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                     timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=PrefixStore(f"attempt_{attempt}", agent), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]), timeout=timedelta(seconds=60))
    group_rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    inner = torch.optim.Adam(params, lr=1e-3)

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def state_dict():  # this rank's shards: the model's and Adam's
        return {"model": [local(p).detach() for p in params],
                "opt": [{k: local(v) for k, v in inner.state.get(p, {}).items()} for p in params]}

    def load_state_dict(state):
        with torch.no_grad():
            for p, w, moments in zip(params, state["model"], state["opt"]):
                local(p).copy_(w)
                mine = inner.state[p]
                for k, v in moments.items():
                    if k == "step":
                        mine[k] = v.clone()
                    else:
                        mine.setdefault(k, torch.zeros_like(p))
                        local(mine[k]).copy_(v)

    # the Manager's store: one of this group's own, fresh in each attempt (the agent's outlives a restart)
    store = TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False) if group_rank == 0 else None
    port = [store.port if store else None]
    dist.broadcast_object_list(port, src=0)
    manager = Manager(pg=ProcessGroupGloo(), min_replica_size=1, load_state_dict=load_state_dict,
                      state_dict=state_dict, store_addr="127.0.0.1", store_port=port[0], replica_id=f"r{replica}")
    if not newcomer and group_rank == 0:  # both groups heartbeating before the first quorum: it takes both in
        open(os.path.join(out, f"ready{replica}"), "w").close()
        while not os.path.exists(os.path.join(out, f"ready{1 - replica}")):
            time.sleep(0.01)
    dist.barrier()

    def across_replicas(shard):  # FSDP's reduce-scatter output, averaged over the quorum's groups
        manager.allreduce(shard).wait()

    for m in model.modules():
        if hasattr(m, "set_all_reduce_hook"):
            m.set_all_reduce_hook(across_replicas)
    opt = OptimizerWrapper(manager, inner)
    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    me = 2 * replica + group_rank  # (the job rank: the same data as the distcomm job's 4 ranks)
    log, members, stop = {"done": [], "joined": []}, 0, 300
    while True:
        if stop == 300 and os.path.exists(os.path.join(out, "healed")):
            stop = int(open(os.path.join(out, "healed")).read()) + 10
        if manager.current_step() >= stop:
            break
        if replica == 1 and group_rank == 1 and manager.current_step() == kill_step and not newcomer:
            with open(os.path.join(out, "killed"), "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        started, before = time.time(), manager.current_step()
        opt.zero_grad()  # (torchft's quorum for this step)
        model(x[me::4]).pow(2).mean().backward()
        opt.step()  # (applied only where the step commits)
        if manager.current_step() > before:
            log["done"].append((manager.current_step(), time.time()))
            if members and manager.num_participants() > members:
                log["joined"].append(started)
            members = manager.num_participants()
            if replica == 1 and manager.current_step() > kill_step and not os.path.exists(os.path.join(out, "healed")):
                with open(os.path.join(out, f"healed.{group_rank}"), "w") as f:
                    f.write(str(manager.current_step()))
                os.replace(os.path.join(out, f"healed.{group_rank}"), os.path.join(out, "healed"))
        time.sleep(pause)  # the rest of a step
    print("RESULT " + json.dumps({"replica": replica, "newcomer": newcomer, **log}), flush=True)
    manager.shutdown(wait=False)
    dist.destroy_process_group()
""")

def available() -> str | None:
    """None where torchft imports; else why not (its last line)."""
    probe = subprocess.run([sys.executable, "-c", "import torchft"], env=torchft_env(), capture_output=True, text=True,
                           timeout=120)
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]




def run(work: Path, kill_step: int, pause: float) -> list[dict[str, Any]]:
    """One job of 2 replica groups of 2 ranks; group 1's rank 1 killed at ``kill_step``, its group
    restarted by its torchrun; each surviving or restarted process's RESULT."""
    (work / "torchft_job.py").write_text(JOB)
    lighthouse, url = start_lighthouse(work)
    env = torchft_env(TORCHFT_LIGHTHOUSE=url)
    groups = []
    for replica in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
               "--master-addr", "127.0.0.1", "--master-port", str(distcomm.free_port()), str(work / "torchft_job.py"),
               str(work), str(kill_step), str(pause)]
        log = open(work / f"group{replica}.err", "w")  # (closed below)
        groups.append((subprocess.Popen(cmd, env={**env, "REPLICA_GROUP_ID": str(replica)}, text=True,
                                        stdout=subprocess.PIPE, stderr=log), log))
    try:
        outs = [p.communicate(timeout=300)[0] for p, _ in groups]
    finally:
        for p in [*(p for p, _ in groups), lighthouse]:
            if p.poll() is None:
                p.kill()
                p.wait(10)
        for _, log in groups:
            log.close()
    results = [json.loads(m) for o in outs for m in re.findall(r"RESULT (\{[^{}]*\})", o)]
    if len(results) != 4 or any(p.returncode for p, _ in groups):
        tail = "".join((work / f"group{r}.err").read_text()[-3000:] for r in range(2))
        raise RuntimeError(f"the torchft HSDP job ended with {len(results)} of 4 ranks done:\n{tail}")
    return results
