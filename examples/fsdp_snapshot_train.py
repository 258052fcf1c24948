"""Plain FSDP that outlives a lost rank, with no checkpoint on disk: FSDP2 over a one-dimensional
mesh (every rank holds the only copy of its shards) with Adam. After each step, ``comm.snapshot``
keeps each rank's shards in host memory and on the next rank. When a rank is lost, the survivors
wait in ``shrink()`` for its replacement; ``sync_state`` then takes every rank back to the newest
step every rank's copy is held for (the replacement's from its neighbour), and the loop replays the
steps since. The data depends only on the step and the rank, so the job ends as it would have
without the loss: the final digests printed are the same with ``--kill-rank`` and without.

Run it with rank 1 killed (SIGKILL) at step 5 and started again:
    python -m distcomm run --nproc-per-node 2 --replacements 1 examples/fsdp_snapshot_train.py --kill-rank 1
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import tempfile
import time
from pathlib import Path

import torch
from torch.distributed.fsdp import fully_shard

import distcomm


def build(comm: distcomm.Communicator) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The model, sharded over every rank of the job: every layer, then the whole (FSDP2's way)."""
    mesh = comm.device_mesh((comm.world_size,), ("shard",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(),
                                torch.nn.Linear(64, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def batch(step: int, job_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch at ``step``: the same whenever the step is replayed."""
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1000 * step + job_rank))
    return x, x.sum(1, keepdim=True).sin()


def shards_digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    """This rank's shards of the model and of Adam's moments, hashed."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().to_local().numpy().tobytes())  # type: ignore[operator]
        for v in opt.state.get(p, {}).values():
            h.update((v.to_local() if hasattr(v, "to_local") else v).detach().numpy().tobytes())
    return h.hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--kill-rank", type=int, default=None, help="this job rank's first process dies ...")
    parser.add_argument("--kill-step", type=int, default=5, help="... as it starts this step")
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds of other work per step")
    args = parser.parse_args()

    comm = distcomm.from_env()
    model, opt = build(comm)
    killed = Path(tempfile.gettempdir()) / f"fsdp_snapshot_train.{os.getppid()}.killed"  # (its replacement lives)
    progress, share, lost = {"step": 0}, True, False

    def log(text: str) -> None:
        print(f"step {progress['step']:>2}: job rank {comm.membership.job_ranks[comm.rank]}: {text}", flush=True)

    while True:
        try:
            if share:  # the state goes round: at the start, and after a loss (back to the newest snapshot)
                comm.sync_state(model, opt, progress)
                if lost:
                    log("back to this step's snapshot: the steps since are replayed")
                share, lost = False, False
            if progress["step"] >= args.steps:
                break
            me = comm.membership.job_ranks[comm.rank]
            if me == args.kill_rank and progress["step"] == args.kill_step and not killed.exists():
                killed.touch()
                log("killed (SIGKILL)")
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = batch(progress["step"], me)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            time.sleep(args.step_time)
            progress["step"] += 1
            comm.snapshot(model, opt, progress)  # this rank's shards: here, and on the next rank
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            started = time.monotonic()
            comm, share, lost = comm.shrink(), True, True  # waits for the replacement: no replica is whole
            log(f"shrink took {time.monotonic() - started:.2f} s (the replacement came); members "
                f"{list(comm.membership.job_ranks)}")
    log(f"done: shards {shards_digest(model, opt)}")
    killed.unlink(missing_ok=True)
    comm.close()


if __name__ == "__main__":
    main()
