"""How much of an object collective a non-blocking call hides behind compute.

    python benchmarks/overlap.py [--dicts N] [--reps R]

At 2 gloo ranks on 127.0.0.1: a gather of N small dicts per rank (an evaluation loop's predictions)
beside a training step, timed four ways: (a) the step alone, (b) the gather alone, (c) both, one
after the other, (d) the gather started with ``async_op=True``, then the step, then ``wait()``.
Two kinds of step: one that waits for a device (a GPU step's host thread, which launches kernels
and then waits without using the CPU: a sleep as long as the gather), and one that computes on the
CPU (torch matmuls, one thread per rank). Each figure is the median over R repetitions of the
slowest rank's time. With (d) near max(a, b) the gather ran behind the step; near a + b it didn't
(on a machine with one core per rank the CPU step and the gather's serialization compete for the
same core). Prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

import distcomm
from distcomm.testing import spawn


def _dicts(rank: int, n: int) -> list[dict[str, Any]]:
    return [{"image_id": rank * n + i, "category": i % 80, "score": 0.5 + i / (4 * n),
             "bbox": [1.0 * i, 2.0, 30.0, 40.0]} for i in range(n)]


def _compute(a: torch.Tensor, steps: int) -> float:
    x = a
    for _ in range(steps):
        x = torch.tanh(x @ a)
    return float(x[0, 0])


def _run(comm: distcomm.Communicator, n: int, reps: int, steps: int, kind: str) -> dict[str, list[float]]:
    torch.set_num_threads(1)  # a rank per core
    preds = _dicts(comm.rank, n)
    a = torch.randn(256, 256) / 16
    times: dict[str, list[float]] = {k: [] for k in ("compute", "gather", "sequential", "overlapped")}
    if kind == "device":  # as long as the gather alone, measured first
        for _ in range(3):
            comm.gather(preds, 0)
        t0 = time.perf_counter()
        for _ in range(5):
            comm.gather(preds, 0)
        wait_s = max(comm.all_gather((time.perf_counter() - t0) / 5))

        def step() -> Any:
            time.sleep(wait_s)
    else:
        def step() -> Any:
            return _compute(a, steps)

    def timed(key: str, fn: Any) -> None:
        comm.synchronize()
        t0 = time.perf_counter()
        fn()
        mine = time.perf_counter() - t0
        times[key].append(max(comm.all_gather(mine)))  # the slowest rank's

    for _ in range(reps):  # interleaved, so that the machine's drift touches every column alike
        timed("compute", step)
        timed("gather", lambda: comm.gather(preds, 0))
        timed("sequential", lambda: (comm.gather(preds, 0), step()))

        def overlapped() -> None:
            h = comm.start(comm.gather, preds, 0)
            step()
            h.wait()

        timed("overlapped", overlapped)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dicts", type=int, default=2000, help="dicts each rank gathers (default 2000)")
    parser.add_argument("--reps", type=int, default=15, help="repetitions (default 15)")
    parser.add_argument("--steps", type=int, default=5,
                        help="matmuls of 256x256 in the compute loop (default 5: about as long as the gather)")
    args = parser.parse_args()
    print(f"gather of {args.dicts} dicts per rank beside a training step, 2 gloo ranks, median of {args.reps}\n")
    print("| step | (a) step alone | (b) gather alone | (c) gather, then step | (d) async gather, step, wait "
          "| gather time hidden |\n|---|---:|---:|---:|---:|---:|")
    for kind, label in (("device", "waits for a device"), ("cpu", f"{args.steps} matmuls on the CPU")):
        times = spawn(lambda comm, kind=kind: _run(comm, args.dicts, args.reps, args.steps, kind), 2, timeout=600)[0]
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        hidden = (med["sequential"] - med["overlapped"]) / med["gather"] if med["gather"] else 0.0
        print(f"| {label} | {med['compute']:.1f} ms | {med['gather']:.1f} ms | {med['sequential']:.1f} ms "
              f"| {med['overlapped']:.1f} ms | {100 * hidden:.0f}% |", flush=True)

if __name__ == "__main__":
    main()
