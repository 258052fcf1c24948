"""distcomm's tensor collectives against torch.distributed called directly on the same group.

    python benchmarks/tensors.py [--quick] [--world N ...]     (or: make bench-tensors)

For all_reduce and all_gather_tensor, on a gloo group over 127.0.0.1: distcomm with its check (the
default: one small exchange comparing dtypes and shapes first), distcomm with check=False, and
torch.distributed.all_reduce / all_gather_into_tensor on the communicator's own group (into a fresh
output tensor per call, since all_gather_tensor returns a new tensor). Times are
medians over interleaved repetitions, each the slowest rank's time of a batch of calls back to back
divided by the batch. Prints a markdown table; writes nothing.

Beside wall time, each call's CPU time on the calling thread (``time.thread_time``): the Python and
C++ a rank runs to issue the collective and wait for it. gloo moves the bytes on its own threads and
a blocked wait costs no CPU, so the difference between distcomm and torch in this column is the
work distcomm adds to every call, free of the transport's noise that swamps wall-time differences
of a few microseconds on a loaded machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distcomm

SIZES = {"4 B": 1, "16 B": 4, "1 KiB": 256, "1 MiB": 1 << 18}  # float32 elements


def impls(comm: distcomm.Communicator, op: str, numel: int) -> dict[str, Callable[[], Any]]:
    x = torch.full((numel,), float(comm.rank + 1))
    group = comm.group
    if op == "all_reduce":
        return {"distcomm": lambda: comm.all_reduce(x), "distcomm check=False": lambda: comm.all_reduce(x, check=False),
                "torch": lambda: dist.all_reduce(x, group=group)}
    n = numel * comm.world_size

    def torch_all_gather() -> torch.Tensor:  # a fresh output per call, as all_gather_tensor returns
        out = torch.empty(n)
        dist.all_gather_into_tensor(out, x, group=group)
        return out

    return {"distcomm": lambda: comm.all_gather_tensor(x), "distcomm check=False":
            lambda: comm.all_gather_tensor(x, check=False), "torch": torch_all_gather}


def worker(rank: int, world: int, port: int, quick: bool, out: str) -> None:
    import warnings

    warnings.simplefilter("ignore")  # torch's deprecation notice for all_gather_into_tensor, once per rank
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    comm = distcomm.GlooCommunicator(timeout=300, _owns_default=True)
    rows = []
    for op in ("all_reduce", "all_gather_tensor"):
        for label, numel in SIZES.items():
            fns = impls(comm, op, numel)
            for fn in fns.values():
                fn()
            batch = 20 if numel < 1024 else 2
            reps = (40 if quick else 150) if numel < 1024 else (15 if quick else 50)
            times: dict[str, list[float]] = {k: [] for k in fns}
            cpu: dict[str, list[float]] = {k: [] for k in fns}
            for _ in range(reps):
                for key, fn in fns.items():
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.thread_time()
                    for _ in range(batch):
                        fn()
                    cpu[key].append((time.thread_time() - c0) / batch)
                    times[key].append((time.perf_counter() - t0) / batch)
            everyone: list[Any] = [None] * world
            dist.all_gather_object(everyone, (times, cpu))
            if rank == 0:
                slowest = {k: statistics.median(max(t[k][i] for t, _ in everyone) for i in range(reps)) for k in times}
                busiest = {k: max(statistics.median(c[k]) for _, c in everyone) for k in cpu}
                rows.append({"op": op, "size": label, "world": world, "median_s": slowest, "cpu_s": busiest})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    comm.close()


def fmt(s: float) -> str:
    return f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--world", action="append", type=int, help="world size (repeatable; default 2 and 4)")
    args = parser.parse_args()
    lines = [
        f"distcomm tensor collectives vs torch.distributed on the same gloo group, 127.0.0.1 "
        f"({os.cpu_count()} CPU cores, torch {torch.__version__}, {'quick' if args.quick else 'full'} run)", "",
        "| op | size per rank | world | distcomm | check=False | torch | overhead (check=False) | ratio (check=False) "
        "| overhead (checked) | CPU per call: check=False / torch | CPU added (check=False) | CPU added (checked) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.json")
        for world in args.world or [2, 4]:
            print(f"timing all_reduce and all_gather_tensor at world {world} ...", file=sys.stderr, flush=True)
            mp.start_processes(worker, args=(world, distcomm.free_port(), args.quick, out),  # type: ignore[attr-defined]
                               nprocs=world, join=True, start_method="spawn")
            for r in json.loads(Path(out).read_text()):
                m = r["median_s"]
                d, n, t = m["distcomm"], m["distcomm check=False"], m["torch"]
                c = r["cpu_s"]
                cd, cn, ct = c["distcomm"], c["distcomm check=False"], c["torch"]
                lines.append(f"| {r['op']} | {r['size']} | {r['world']} | {fmt(d)} | {fmt(n)} | {fmt(t)} "
                             f"| {(n - t) * 1e6:+.0f} µs | {n / t:.2f} | {(d - t) * 1e6:+.0f} µs "
                             f"| {fmt(cn)} / {fmt(ct)} "
                             f"| {(cn - ct) * 1e6:+.1f} µs ({(cn - ct) / t:.1%} of torch's time) "
                             f"| {(cd - ct) * 1e6:+.1f} µs |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
