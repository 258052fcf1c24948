"""A trainer that outlives a lost rank: torch's DistributedDataParallel and Adam over the job's
communicator; when a rank is lost it shrinks, re-shards its data and goes on, then admits a
replacement, to which it hands the whole state (model, optimizer, step).

Run it on 4 CPU processes, one of which is killed (SIGKILL) at step 5 and started again:
    python examples/elastic_train.py --nproc 4 --kill-rank 2 --kill-step 5

``launch(..., elastic=True)`` serves the job's store from the launching process (so that it
outlives every rank) and lets the others go on when one dies; ``replacements=1`` starts the lost
rank again, and it waits until the members ``admit()`` it. Under a job controller that restarts a
lost pod or task, the same trainer runs with ``distcomm.from_env()``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from collections.abc import Callable

import torch
from torch.nn.parallel import DistributedDataParallel

import distcomm

SAMPLES = 4096
CHECK_EVERY = 5  # steps between checks that every member holds the same state


class ElasticTrainer:
    """Fits y = 3x + 1 with one linear layer; rank r of n trains on samples r, r + n, r + 2n, ...

    After each step the members ask for newcomers (``admit``); after a failed step the survivors
    ``shrink``. Either way the state then goes round (``sync_state``): the first member that is no
    newcomer's model, Adam's moments and the step, to every member whose state differs (a newcomer,
    or a rank that applied half of the failed step), and DDP is built again on the new group.
    Every collective is inside the ``try``: a rank can be lost in any of them, DDP's own included."""

    def __init__(self, comm: distcomm.Communicator, *, steps: int = 30, lr: float = 0.05,
                 kill: tuple[int, int] | None = None, work: float = 0.0,
                 log: Callable[[str], None] = print) -> None:
        self.comm = comm
        self.steps = steps
        self.kill = kill  # (job rank, step): that rank's first process dies there
        self.work = work
        self.log = log
        self.model = torch.nn.Linear(1, 1)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.progress = {"step": 0}
        data = torch.Generator().manual_seed(0)
        self.x = torch.rand(SAMPLES, 1, generator=data) * 2 - 1
        self.y = 3 * self.x + 1
        self.checked = 0  # checks that found every member's state the same

    def fit(self) -> torch.nn.Module:
        share = True  # the state goes round before the next step: at the start, after a shrink or an admit
        while True:
            try:  # every collective inside: a rank may be lost in any of them
                if share:
                    self.comm.sync_state(self.model, self.opt, self.progress)
                    self.ddp = DistributedDataParallel(self.model, process_group=self.comm.group)
                    share = False
                if self.step >= self.steps:  # decided after the state went round: a newcomer let in at
                    break  # the last step stops with the members instead of waiting for them in sync_state
                self._train_step()
                admitted = self.comm.admit()
                if admitted is not self.comm:
                    self.comm, share = admitted, True
                    self.log(f"step {self.step}: admitted job rank(s) {list(admitted.membership.admitted)}: "
                             f"{admitted!r}")
            except Exception as e:  # distcomm's errors, and what DDP raises when a rank is lost
                if not distcomm.is_rank_loss(e):
                    raise
                self.comm, share = self.comm.shrink(), True
                self.log(f"step {self.step}: {type(e).__name__}; shrunk to {self.comm!r}")
        return self.model

    @property
    def step(self) -> int:
        return self.progress["step"]

    def _train_step(self) -> None:
        comm = self.comm
        if self.kill == (comm.membership.job_ranks[comm.rank], self.step) and not comm.membership.admitted:
            os.kill(os.getpid(), signal.SIGKILL)  # as a machine failing would
        x, y = self.x[comm.rank::comm.world_size], self.y[comm.rank::comm.world_size]  # this rank's shard now
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.ddp(x), y)
        loss.backward()  # DDP averages the gradients over comm.group
        self.opt.step()
        self.progress["step"] += 1
        logged = comm.reduce_dict({"loss": loss.detach()})
        if comm.is_main_process and self.step % 5 == 0:
            self.log(f"step {self.step}: loss {float(logged['loss']):.5f} on {comm.world_size} ranks")
        if self.step % CHECK_EVERY == 0:
            comm.check_identical(self.model, self.opt, self.progress)  # raises on every rank if they differ
            self.checked += 1
        time.sleep(self.work)  # the rest of a real step: a replacement has time to start


def main(steps: int, kill: tuple[int, int] | None) -> None:
    trainer = ElasticTrainer(distcomm.current(), steps=steps, kill=kill, work=0.1)
    model = trainer.fit()
    comm = trainer.comm
    weights = comm.all_gather([round(float(p.item()), 6) for p in model.parameters()])
    checked = comm.gather(trainer.checked)
    if comm.is_main_process:
        print(f"done: {comm!r}; weights {weights[0]}, the same on every rank: {all(w == weights[0] for w in weights)}"
              f"; checks that found every member's state the same, per rank: {checked}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-rank", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=5)
    a = parser.parse_args()
    distcomm.launch(main, a.nproc, args=(a.steps, (a.kill_rank, a.kill_step)), elastic=True, replacements=1,
                    timeout=60)
