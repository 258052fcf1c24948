"""A small trainer that takes its communicator in the constructor.

Run it on 2 CPU processes:  python examples/train.py --nproc 2
Its unit tests (examples/test_train.py) use distcomm.testing: no cluster needed.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import distcomm


class Trainer:
    """Fits y = 3x + 1 with one linear layer; each rank sees its own shard of the data.

    Every step the ranks average their gradients with the tensor all-reduce (or, with ``ddp=True``,
    let DistributedDataParallel do it over the communicator's process group), then average the
    loss dict with reduce_dict; only the main process logs.
    """

    def __init__(self, comm: distcomm.Communicator, *, steps: int = 20, lr: float = 0.5,
                 log: Callable[[str], None] = print, ddp: bool = False) -> None:
        self.comm = comm
        self.steps = steps
        self.lr = lr
        self.log = log
        self.ddp = ddp

    def fit(self) -> list[dict[str, float]]:
        comm = self.comm
        model: torch.nn.Module = torch.nn.Linear(1, 1)
        # the same initial weights on every rank, from a generator of this rank's own: torch's global
        # one is shared by every thread of a process (the threaded test world runs ranks as threads)
        init = torch.Generator().manual_seed(comm.shared_random_seed())
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.rand(p.shape, generator=init) * 2 - 1)
        if self.ddp:  # the communicator owns the process group; DDP averages the gradients over it
            model = torch.nn.parallel.DistributedDataParallel(model, process_group=comm.group)
        self.model = model
        opt = torch.optim.SGD(model.parameters(), lr=self.lr)
        gen = torch.Generator().manual_seed(1000 + comm.rank)  # this rank's shard
        x = torch.rand(64, 1, generator=gen) * 2 - 1
        y = 3 * x + 1
        history: list[dict[str, float]] = []
        for step in range(self.steps):
            opt.zero_grad()
            pred = model(x)
            loss = torch.nn.functional.mse_loss(pred, y)
            loss.backward()
            if not self.ddp:
                for p in model.parameters():
                    assert p.grad is not None
                    comm.all_reduce(p.grad, "mean")  # in place, the same on every rank
            opt.step()
            logged = comm.reduce_dict({"loss": loss.detach(), "mae": (pred - y).abs().mean().detach()})
            if comm.is_main_process:
                row = {k: round(float(v), 4) for k, v in logged.items()}
                history.append(row)
                if step % 5 == 0 or step == self.steps - 1:
                    self.log(f"step {step:2d}  " + "  ".join(f"{k}={v:.4f}" for k, v in row.items()))
        if comm.is_main_process:
            layer = model.module if self.ddp else model
            w, b = float(layer.weight.detach()), float(layer.bias.detach())
            self.log(f"trained on {comm.world_size} process(es): y = {w:.3f} x + {b:.3f} (target: 3x + 1)")
        return history


def _run(steps: int, ddp: bool) -> None:
    Trainer(distcomm.current(), steps=steps, ddp=ddp).fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2, help="processes on this machine")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--ddp", action="store_true", help="wrap the model in DistributedDataParallel")
    args = parser.parse_args()
    print(f"distcomm demo: training a toy model on {args.nproc} CPU processes (gloo over 127.0.0.1)")
    distcomm.launch(_run, args.nproc, args=(args.steps, args.ddp), timeout=120, backend="gloo")


if __name__ == "__main__":
    main()
