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

    Every step the ranks average their gradients (all_gather of tensors), then average the loss
    dict with reduce_dict; only the main process logs.
    """

    def __init__(self, comm: distcomm.Communicator, *, steps: int = 20, lr: float = 0.5,
                 log: Callable[[str], None] = print) -> None:
        self.comm = comm
        self.steps = steps
        self.lr = lr
        self.log = log

    def fit(self) -> list[dict[str, float]]:
        comm = self.comm
        torch.manual_seed(comm.shared_random_seed())  # the same initial weights on every rank
        model = torch.nn.Linear(1, 1)
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
            grads = comm.all_gather([p.grad for p in model.parameters()])
            for i, p in enumerate(model.parameters()):
                p.grad = torch.stack([g[i] for g in grads]).mean(0)
            opt.step()
            logged = comm.reduce_dict({"loss": loss.detach(), "mae": (pred - y).abs().mean().detach()})
            if comm.is_main_process:
                row = {k: round(float(v), 4) for k, v in logged.items()}
                history.append(row)
                if step % 5 == 0 or step == self.steps - 1:
                    self.log(f"step {step:2d}  " + "  ".join(f"{k}={v:.4f}" for k, v in row.items()))
        if comm.is_main_process:
            w, b = float(model.weight.detach()), float(model.bias.detach())
            self.log(f"trained on {comm.world_size} process(es): y = {w:.3f} x + {b:.3f} (target: 3x + 1)")
        return history


def _run(steps: int) -> None:
    Trainer(distcomm.current(), steps=steps).fit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2, help="processes on this machine")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    print(f"distcomm demo: training a toy model on {args.nproc} CPU processes (gloo over 127.0.0.1)")
    distcomm.launch(_run, args.nproc, args=(args.steps,), timeout=120)


if __name__ == "__main__":
    main()
