"""HSDP that outlives a lost rank: FSDP2 over a 2 x 2 mesh (2 replicas, each sharded over 2 ranks)
with Adam. When a rank is lost, the other replica steps on alone; the lost rank's replica peer
waits in ``shrink()`` until the replacement makes the replica whole, and the members' ``admit()``
lets both in at a step boundary, where ``sync_state`` hands each its shards from the rank holding
the same shards in the healthy replica. FSDP is built once: the mesh follows the communicator.

Run it with rank 3 killed (SIGKILL) at step 5 and started again:
    python -m distcomm run --nproc-per-node 4 --replacements 1 examples/hsdp_train.py --kill-rank 3
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import time

import torch
from torch.distributed.fsdp import fully_shard

import distcomm

SAMPLES = 4096


def build(comm: distcomm.Communicator) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model, sharded over the job's mesh: every layer, then the whole (FSDP2's way). A
    replacement builds it before it joins the members (at its first call, ``sync_state``): they
    step on meanwhile."""
    mesh = comm.device_mesh((2, 2), ("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def shards_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """This rank's shards of the model and of Adam's moments, hashed."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to_local().numpy().tobytes())  # type: ignore[operator]
        for moment in opt.state.get(p, {}).values():
            local = moment.to_local() if hasattr(moment, "to_local") else moment
            h.update(local.detach().numpy().tobytes())
    return h.hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-rank", type=int, default=None, help="this job rank's first process dies ...")
    parser.add_argument("--kill-step", type=int, default=5, help="... as it starts this step")
    parser.add_argument("--step-time", type=float, default=0.1, help="seconds of other work per step")
    args = parser.parse_args()

    comm = distcomm.from_env()
    model, opt = build(comm)
    data = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 8, generator=data)
    y = x.sum(1, keepdim=True).sin()
    progress, share = {"step": 0}, True
    first_process = comm.membership.job_ranks[comm.rank] not in comm.membership.admitted  # (not a replacement)

    def log(text: str) -> None:
        print(f"step {progress['step']:>2}: job rank {comm.membership.job_ranks[comm.rank]}: {text}", flush=True)

    while True:
        try:
            if share:  # the state goes round: at the start, after a shrink or an admit
                comm.sync_state(model, opt, progress)
                share = False
            if progress["step"] >= args.steps:
                break
            me = comm.membership.job_ranks[comm.rank]
            if me == args.kill_rank and progress["step"] == args.kill_step and first_process:
                log("killed (SIGKILL)")
                os.kill(os.getpid(), signal.SIGKILL)
            n, r = comm.world_size, comm.rank  # this membership's data: rank r of n takes every n-th sample
            loss = torch.nn.functional.mse_loss(model(x[r::n]), y[r::n])
            loss.backward()
            opt.step()
            opt.zero_grad()
            time.sleep(args.step_time)
            progress["step"] += 1
            new = comm.admit()  # a replica made whole again comes in here
            if new is not comm:
                comm, share = new, True
                log(f"admitted job rank(s) {list(comm.membership.admitted)}; members {list(comm.membership.job_ranks)}")
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            started = time.monotonic()
            comm, share = comm.shrink(), True
            log(f"shrink took {time.monotonic() - started:.2f} s; members {list(comm.membership.job_ranks)}")
    comm.check_identical(model, opt)  # every rank's shards are those of its shard coordinate in the other replica
    log(f"done: loss {loss.item():.4f}; shards {shards_digest(model, opt)}; members {list(comm.membership.job_ranks)}")
    comm.close()


if __name__ == "__main__":
    main()
