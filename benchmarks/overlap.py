"""How much of an object collective a non-blocking call hides behind compute.

    python benchmarks/overlap.py [--dicts N] [--reps R]

At 2 gloo ranks on 127.0.0.1: a gather of N small dicts per rank (an evaluation loop's predictions)
beside a compute loop of torch matmuls, timed four ways: (a) the compute alone, (b) the gather
alone, (c) both, one after the other, (d) the gather started with ``async_op=True``, then the
compute, then ``wait()``. Each figure is the median over R repetitions of the slowest rank's time.
With (d) near max(a, b) the gather ran behind the compute; near a + b it didn't (on 2 cores torch's
matmul and the gather's serialization compete for the same CPUs). Prints a markdown table.
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


def _run(comm: distcomm.Communicator, n: int, reps: int, steps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)  # a rank per core
    preds = _dicts(comm.rank, n)
    a = torch.randn(256, 256) / 16
    times: dict[str, list[float]] = {k: [] for k in ("compute", "gather", "sequential", "overlapped")}

    def timed(key: str, fn: Any) -> None:
        comm.synchronize()
        t0 = time.perf_counter()
        fn()
        mine = time.perf_counter() - t0
        times[key].append(max(comm.all_gather(mine)))  # the slowest rank's

    for _ in range(reps):  # interleaved, so that the machine's drift touches every column alike
        timed("compute", lambda: _compute(a, steps))
        timed("gather", lambda: comm.gather(preds, 0))
        timed("sequential", lambda: (comm.gather(preds, 0), _compute(a, steps)))

        def overlapped() -> None:
            h = comm.gather(preds, 0, async_op=True)
            _compute(a, steps)
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
    times = spawn(lambda comm: _run(comm, args.dicts, args.reps, args.steps), 2, timeout=600)[0]
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    print(f"gather of {args.dicts} dicts per rank beside {args.steps} matmuls (256x256), 2 gloo ranks, "
          f"median of {args.reps}\n")
    print("| what | ms |\n|---|---:|")
    print(f"| (a) compute alone | {med['compute']:.1f} |")
    print(f"| (b) gather alone | {med['gather']:.1f} |")
    print(f"| (c) gather, then compute | {med['sequential']:.1f} |")
    print(f"| (d) async gather, compute, wait | {med['overlapped']:.1f} |")
    hidden = (med["sequential"] - med["overlapped"]) / med["gather"] if med["gather"] else 0.0
    print(f"\n(d) hides {100 * hidden:.0f}% of the gather's time behind the compute.")


if __name__ == "__main__":
    main()
