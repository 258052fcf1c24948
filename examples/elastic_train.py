"""A trainer that outlives a lost rank: it shrinks, re-shards its data, goes on, and admits a
replacement, to which it hands the current state.

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

import distcomm

SAMPLES = 4096


class ElasticTrainer:
    """Fits y = 3x + 1 with one linear layer; rank r of n trains on samples r, r + n, r + 2n, ...

    After each step the members ask for newcomers (``admit``); after a failed step, admit or
    hand-over the survivors ``shrink``. Either way the first member then hands everyone the model
    and the step (``broadcast``), so that a failed step that some ranks applied and others didn't
    leaves no difference behind, and a newcomer starts where the others are. Every collective is
    inside the ``try``: a rank can be lost in any of them, the hand-over included."""

    def __init__(self, comm: distcomm.Communicator, *, steps: int = 30, lr: float = 0.5,
                 kill: tuple[int, int] | None = None, work: float = 0.0,
                 log: Callable[[str], None] = print) -> None:
        self.comm = comm
        self.steps = steps
        self.kill = kill  # (job rank, step): that rank's first process dies there
        self.work = work
        self.log = log
        self.model = torch.nn.Linear(1, 1)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=lr)
        data = torch.Generator().manual_seed(0)
        self.x = torch.rand(SAMPLES, 1, generator=data) * 2 - 1
        self.y = 3 * self.x + 1
        self.step = 0
        self.checked = 0  # steps after which every member's parameters were found the same

    def fit(self) -> torch.nn.Module:
        share = True  # the state goes round before the next step: at the start, after a shrink or an admit
        while self.step < self.steps:
            try:  # every collective inside: a rank may be lost in any of them
                if share:
                    self._share_state()
                    share = False
                self._train_step()
                self.step += 1
                admitted = self.comm.admit()
                if admitted is not self.comm:
                    self.comm, share = admitted, True
                    self.log(f"step {self.step}: admitted job rank(s) {list(admitted.membership.admitted)}: "
                             f"{admitted!r}")
            except distcomm.DistCommError as e:  # a rank was lost: go on without it
                self.comm, share = self.comm.shrink(), True
                self.log(f"step {self.step}: {type(e).__name__}; shrunk to {self.comm!r}")
        return self.model

    @property
    def _job_rank(self) -> int:
        return self.comm.membership.job_ranks[self.comm.rank]

    def _train_step(self) -> None:
        comm = self.comm
        if self.kill == (self._job_rank, self.step) and not comm.membership.admitted:
            os.kill(os.getpid(), signal.SIGKILL)  # as a machine failing would
        x, y = self.x[comm.rank::comm.world_size], self.y[comm.rank::comm.world_size]  # this rank's shard now
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        for p in self.model.parameters():
            assert p.grad is not None
            comm.all_reduce(p.grad, "mean")
        self.opt.step()
        logged = comm.reduce_dict({"loss": loss.detach()})
        if comm.is_main_process and self.step % 5 == 0:
            self.log(f"step {self.step}: loss {float(logged['loss']):.5f} on {comm.world_size} ranks")
        checksum = float(sum(p.detach().sum() for p in self.model.parameters()))
        if len(set(comm.all_gather(checksum))) != 1:  # (a check for this example: not needed in a trainer)
            raise AssertionError(f"step {self.step}: the members' parameters differ")
        self.checked += 1
        time.sleep(self.work)  # the rest of a real step: a replacement has time to start

    def _share_state(self) -> None:
        """The first member's model and step on every rank (a newcomer receives them)."""
        comm = self.comm
        newcomers = set(comm.membership.admitted)
        src = next(r for r, job_rank in enumerate(comm.membership.job_ranks) if job_rank not in newcomers)
        state = {"model": self.model.state_dict(), "step": self.step} if comm.rank == src else None
        state = comm.broadcast(state, src=src)
        self.model.load_state_dict(state["model"])
        self.step = state["step"]


def main(steps: int, kill: tuple[int, int] | None) -> None:
    trainer = ElasticTrainer(distcomm.current(), steps=steps, kill=kill, work=0.1)
    model = trainer.fit()
    comm = trainer.comm
    weights = comm.all_gather([round(float(p.item()), 6) for p in model.parameters()])
    checked = comm.gather(trainer.checked)
    if comm.is_main_process:
        print(f"done: {comm!r}; weights {weights[0]}, the same on every rank: {all(w == weights[0] for w in weights)}"
              f"; steps after which every member's parameters were checked the same, per rank: {checked}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--kill-rank", type=int, default=2)
    parser.add_argument("--kill-step", type=int, default=5)
    a = parser.parse_args()
    distcomm.launch(main, a.nproc, args=(a.steps, (a.kill_rank, a.kill_step)), elastic=True, replacements=1,
                    timeout=60)
