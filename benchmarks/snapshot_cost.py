"""What ``comm.snapshot`` costs a step of plain FSDP: step time with and without it, in one run.

    python benchmarks/snapshot_cost.py [--worlds 2 4] [--mib 64] [--batch 256] [--steps 8]

The model: Linear(1024, 1024) layers of about ``--mib`` MiB in all, each sharded with FSDP2 over
``comm.device_mesh((W,), ("shard",))``, and Adam (its moments: twice the model, so each rank's part
of the state is about 3 x mib / W MiB). A step: forward and backward of ``--batch`` samples, Adam's
step. Timed in the same processes, in alternating blocks of ``--steps`` steps (so a machine shared
with other work weighs on all alike): without snapshots, with ``comm.snapshot(model, opt, progress)``
after each step, and with ``every=4``. Each figure is the median over blocks of a block's mean step
(rank 0's clock; FSDP's collectives keep the ranks in step); "snapshot call" is the time the call
itself held the loop (its copy of what the loop changes, the wait for the previous exchange); the
rest of the host copy and the exchange run on its thread, and the optimizer's next step waits for
the copy. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from distcomm.testing import spawn

MiB = 1 << 20
MODES = (0, 1, 4)
"""Without snapshots; one after every step; one every 4 steps (``every=4``)."""


def _job(comm: Any, mib: int, batch: int, steps: int, blocks: int) -> dict[str, float]:
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    mesh = comm.device_mesh((comm.world_size,), ("shard",))
    layers = max(1, round(mib * MiB / (4 * (1024 * 1024 + 1024))))
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(layers)))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    progress = {"step": 0}
    x = torch.randn(batch, 1024)
    held: dict[int, float] = {}

    def step(every: int) -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        progress["step"] += 1
        if every:
            t = time.perf_counter()
            comm.snapshot(model, opt, progress, every=every)
            held[every] = held.get(every, 0.0) + time.perf_counter() - t

    for every in MODES:  # (warm-up: Adam's moments made, the snapshot's buffers and group made)
        for _ in range(2):
            step(every)
    times: dict[int, list[float]] = {every: [] for every in MODES}
    held.clear()
    for _ in range(blocks):
        for every in MODES:
            comm.barrier()
            t = time.perf_counter()
            for _ in range(steps):
                step(every)
            times[every].append((time.perf_counter() - t) / steps)
    comm.barrier()
    out = {f"step {every}": statistics.median(times[every]) for every in MODES}
    out.update({f"held {every}": held[every] / (blocks * steps) for every in MODES if every})
    return {**out, "state_mib": _state_mib(model, opt)}


def _state_mib(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
    """This rank's part of the state: its shards of the parameters and of Adam's moments."""
    total = 0
    for p in model.parameters():
        total += p.to_local().nbytes  # type: ignore[operator]
        for v in opt.state.get(p, {}).values():
            local = v.to_local() if hasattr(v, "to_local") else v
            total += local.nbytes
    return total / MiB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="steps per block")
    parser.add_argument("--blocks", type=int, default=3, help="blocks of each mode, alternating")
    args = parser.parse_args()
    rows = ["| ranks | state per rank | step, without | with, every step | ratio | with, every 4 | ratio "
            "| snapshot call (every step) |", "|---|---|---|---|---|---|---|---|"]
    for world in args.worlds:
        out = spawn(lambda comm: _job(comm, args.mib, args.batch, args.steps, args.blocks), world, timeout=600)
        r = out[0]
        base = r["step 0"]
        rows.append(f"| {world} | {r['state_mib']:.0f} MiB | {base * 1e3:.0f} ms | {r['step 1'] * 1e3:.0f} ms "
                    f"| {r['step 1'] / base:.3f} | {r['step 4'] * 1e3:.0f} ms | {r['step 4'] / base:.3f} "
                    f"| {r['held 1'] * 1e3:.1f} ms |")
    table = "\n".join(rows)
    table += (f"\n\n{args.mib} MiB model (Linear 1024x1024 layers), Adam, FSDP2 over gloo, batch {args.batch}; "
              f"{os.cpu_count()} CPU cores; median of {args.blocks} alternating blocks of {args.steps} steps.")
    print(table)


if __name__ == "__main__":
    main()
