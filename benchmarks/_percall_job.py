"""One job of benchmarks/against.py: small calls of whichever distcomm is on PYTHONPATH, and torch's own.

    python benchmarks/_percall_job.py WORLD CALLS REPEATS

Prints one line, ``RESULT {json}``: for each call, the median over REPEATS of a batch of CALLS calls'
time per call in µs, each batch's time the slowest rank's (every rank's time, maxed over the group
with torch's own all_reduce): wall time, and the calling thread's CPU time (``time.thread_time``:
the Python and C++ a rank runs per call, free of the transport's noise). Uses only API that every
distcomm version since launch() has, so that an earlier commit runs it unchanged.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

import distcomm


def calls(comm: distcomm.Communicator, t: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The calls to time, each beside torch's nearest one (named 'torch: ...'); ``t``: the tensor the
    all_reduces sum into (reset before each batch, so that it stays finite)."""
    metrics = {f"metric_{i}": float(i) for i in range(8)}
    losses = {"loss": torch.tensor(1.0), "aux": torch.tensor(2.0)}
    g = comm.group
    into = [None] * comm.world_size
    return {
        "synchronize": comm.synchronize,
        "torch: barrier": lambda: dist.barrier(group=g),
        "all_gather(int)": lambda: comm.all_gather(comm.rank),
        "torch: all_gather_object(int)": lambda: dist.all_gather_object(into, comm.rank, group=g),
        "gather(8-float dict)": lambda: comm.gather(metrics),
        "reduce_dict": lambda: comm.reduce_dict(losses),
        "all_reduce_dict": lambda: comm.all_reduce_dict(losses),
        "all_reduce(4 floats)": lambda: comm.all_reduce(t),
        "all_reduce(4 floats, check=False)": lambda: comm.all_reduce(t, check=False),
        "torch: all_reduce(4 floats)": lambda: dist.all_reduce(t, group=g),
    }


def main(n: int, repeats: int) -> None:
    comm = distcomm.current()
    t = torch.ones(4)
    ops = calls(comm, t)
    for f in ops.values():  # warm: first-call costs (groups, caches) out of the figures
        t.fill_(1.0)
        for _ in range(20):
            f()
    wall: dict[str, list[float]] = {k: [] for k in ops}
    cpu: dict[str, list[float]] = {k: [] for k in ops}
    for _ in range(repeats):
        for name, f in ops.items():  # interleaved: drift in the machine's load spreads over every call
            t.fill_(1.0)
            dist.barrier(group=comm.group)
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(n):
                f()
            took = torch.tensor([time.perf_counter() - t0, time.thread_time() - c0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=comm.group)
            wall[name].append(took[0].item() / n * 1e6)
            cpu[name].append(took[1].item() / n * 1e6)
    if comm.rank == 0:
        print("RESULT " + json.dumps({"wall": {k: statistics.median(v) for k, v in wall.items()},
                                      "cpu": {k: statistics.median(v) for k, v in cpu.items()}}), flush=True)


if __name__ == "__main__":
    world, n, repeats = (int(a) for a in sys.argv[1:4])
    distcomm.launch(main, world, args=(n, repeats), timeout=300)
