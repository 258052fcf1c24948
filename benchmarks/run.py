"""distcomm's object collectives against torch.distributed's, a naive pad-to-largest pipeline, and the floor.

    python benchmarks/run.py            (or: make bench)

Implementations, each on the same gloo process group over 127.0.0.1:
- distcomm: GlooCommunicator.all_gather / gather.
- torch: torch.distributed.all_gather_object / gather_object.
- compat: distcomm.compat.torch's functions of the same names (torch's signatures, in-place lists)
  over the same communicator.
- naive: pickle to bytes, exchange sizes, pad every rank to the largest, exchange, unpickle (the
  reference module's pipeline, written here).
- floor: a raw tensor collective of the same bytes into a freshly allocated buffer, no
  serialization (all_gather_into_tensor / gather; each rank padded to the largest when sizes differ).

Times are medians over interleaved repetitions (each repetition runs every implementation in
turn, after a barrier), each the slowest rank's time; small payloads time a batch of calls back to
back and divide, so that the skew with which ranks leave the barrier doesn't swamp them. Ratios
are taken within one run. Peak memory is the rise
of each process's peak RSS during one collective of a 256 MiB array per rank, each implementation
in fresh processes. Writes results.md, results.json and time_vs_size.png into benchmarks/out/ (not
tracked by git), or into benchmarks/results/ (the figures the README quotes) with --save.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pickle
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distcomm
import distcomm.compat.torch as compat
from distcomm._defaults import set_default

HERE = Path(__file__).resolve().parent
PAYLOADS = ["dict of 8 floats", "2,000 small dicts", "32 MiB array", "32 MiB tensor", "skewed 32 MiB", "8 MiB array"]
MiB = 1 << 20
INTERLEAVED = "gather, then all_gather"
"""Two different collectives back to back, timed as one: a row where one call's leftovers show."""


# ---------------------------------------------------------------- payloads
def payload(name: str, rank: int, size: int = 32 * MiB) -> Any:
    if name == "dict of 8 floats":
        return {f"metric_{i}": float(rank + i / 7) for i in range(8)}
    if name == "2,000 small dicts":
        rng = np.random.default_rng(rank)
        return [{"image_id": int(i), "category_id": int(rng.integers(90)), "bbox": rng.random(4).tolist(),
                 "score": float(rng.random())} for i in range(2000)]
    if name == "32 MiB array":
        return np.full(size // 8, rank, dtype=np.float64)
    if name == "32 MiB tensor":
        return torch.full((size // 4,), float(rank))
    if name == "skewed 32 MiB":
        return np.full(size // 8, 1.0) if rank == 0 else {"rank": rank}
    if name == "8 MiB array":
        return np.full(MiB, rank, dtype=np.float64)
    if name == "array":
        return np.full(max(size // 8, 1), rank, dtype=np.float64)
    raise ValueError(name)


def payload_bytes(obj: Any) -> int:
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    return len(pickle.dumps(obj))


# ---------------------------------------------------------------- implementations
def naive_all_gather(obj: Any, gather_to: int | None = None) -> list[Any]:
    """The reference module's pipeline: pickle, pad to the largest, exchange, slice, unpickle."""
    buf = pickle.dumps(obj)
    tensor = torch.ByteTensor(torch.ByteStorage.from_buffer(buf))  # type: ignore[attr-defined]
    world = dist.get_world_size()
    local = torch.tensor([tensor.numel()], dtype=torch.int64)
    sizes_t = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes_t, local)
    sizes = [int(s.item()) for s in sizes_t]
    biggest = max(sizes)
    if tensor.numel() != biggest:
        tensor = torch.cat((tensor, torch.zeros(biggest - tensor.numel(), dtype=torch.uint8)))
    if gather_to is None:
        outs = [torch.empty(biggest, dtype=torch.uint8) for _ in sizes]
        dist.all_gather(outs, tensor)
    elif dist.get_rank() == gather_to:
        outs = [torch.empty(biggest, dtype=torch.uint8) for _ in sizes]
        dist.gather(tensor, outs, dst=gather_to)
    else:
        dist.gather(tensor, [], dst=gather_to)
        return []
    return [pickle.loads(o.numpy().tobytes()[:n]) for n, o in zip(sizes, outs, strict=True)]


def floor_sizes(obj: Any) -> tuple[torch.Tensor, int]:
    """The object's raw bytes as a tensor (no serialization), and the largest size over ranks."""
    if isinstance(obj, np.ndarray):
        raw = torch.from_numpy(obj.reshape(-1).view(np.uint8))
    elif isinstance(obj, torch.Tensor):
        raw = obj.reshape(-1).view(torch.uint8)
    else:
        raw = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(sizes, torch.tensor([raw.numel()]))
    return raw, max(int(s) for s in sizes)


def make_impls(comm: distcomm.Communicator, op: str, obj: Any) -> dict[str, Callable[[], Any]]:
    world, rank = comm.world_size, comm.rank
    if op in ("broadcast", "scatter"):
        return root_impls(comm, op, obj)
    if op == INTERLEAVED:  # what one call leaves behind (the collector's deferred work) lands on the next
        first, second = make_impls(comm, "gather", obj), make_impls(comm, "all_gather", obj)
        return {k: (lambda a=first[k], b=second[k]: (a(), b())) for k in first}
    raw, biggest = floor_sizes(obj)
    if raw.numel() < biggest:
        raw = torch.cat((raw, torch.zeros(biggest - raw.numel(), dtype=torch.uint8)))
    if op == "all_gather":
        def torch_impl() -> Any:
            out: list[Any] = [None] * world
            dist.all_gather_object(out, obj)
            return out

        def floor() -> Any:
            out = torch.empty(world * biggest, dtype=torch.uint8)
            dist.all_gather_into_tensor(out, raw)
            return out

        def compat_impl() -> Any:
            out: list[Any] = [None] * world
            compat.all_gather_object(out, obj)
            return out

        return {"distcomm": lambda: comm.all_gather(obj), "torch": torch_impl, "compat": compat_impl,
                "naive": lambda: naive_all_gather(obj), "floor": floor}

    def torch_gather() -> Any:
        out: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def floor_gather() -> Any:
        outs = [torch.empty(biggest, dtype=torch.uint8) for _ in range(world)] if rank == 0 else None
        dist.gather(raw, outs, dst=0)
        return outs

    def compat_gather() -> Any:
        out: list[Any] | None = [None] * world if rank == 0 else None
        compat.gather_object(obj, out, dst=0)
        return out

    return {"distcomm": lambda: comm.gather(obj, dst=0), "torch": torch_gather, "compat": compat_gather,
            "naive": lambda: naive_all_gather(obj, gather_to=0), "floor": floor_gather}


def root_impls(comm: distcomm.Communicator, op: str, obj: Any) -> dict[str, Callable[[], Any]]:
    """broadcast from rank 0 (rank 0's object), and scatter from rank 0 (one object per rank, each
    what that rank would contribute). The floor moves the same raw bytes with the same collective,
    into buffers allocated per call; the reference module has no such ops: no naive column."""
    world, rank = comm.world_size, comm.rank
    if op == "broadcast":
        raw, _ = floor_sizes(obj)
        n = int(comm.broadcast(raw.numel()))

        def torch_bcast() -> Any:
            box = [obj if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            return box[0]

        def compat_bcast() -> Any:
            box = [obj if rank == 0 else None]
            compat.broadcast_object_list(box, src=0)
            return box[0]

        def floor_bcast() -> Any:
            buf = raw if rank == 0 else torch.empty(n, dtype=torch.uint8)
            dist.broadcast(buf, src=0)
            return buf

        return {"distcomm": lambda: comm.broadcast(obj if rank == 0 else None, src=0), "torch": torch_bcast,
                "compat": compat_bcast, "floor": floor_bcast}
    parts = comm.gather(obj, dst=0) or None  # the root holds every rank's part
    raw, biggest = floor_sizes(obj)
    chunks = [torch.zeros(biggest, dtype=torch.uint8) for _ in range(world)] if rank == 0 else None

    def torch_scatter() -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, parts, src=0)
        return out[0]

    def compat_scatter() -> Any:
        out: list[Any] = [None]
        compat.scatter_object_list(out, parts, src=0)
        return out[0]

    def floor_scatter() -> Any:
        out = torch.empty(biggest, dtype=torch.uint8)
        dist.scatter(out, chunks, src=0)
        return out

    return {"distcomm": lambda: comm.scatter(parts, src=0), "torch": torch_scatter, "compat": compat_scatter,
            "floor": floor_scatter}


# ---------------------------------------------------------------- timing worker
def _init(rank: int, world: int, port: int) -> distcomm.GlooCommunicator:
    import warnings

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=300))
    comm = distcomm.GlooCommunicator(timeout=300, _owns_default=True)
    set_default(comm)  # the current communicator, which distcomm.compat's functions use
    return comm


def _batch(name: str, size: int) -> int:
    """Calls timed back to back per sample: amortizes the skew with which ranks leave the barrier."""
    if name == "dict of 8 floats" or (name == "array" and size < 64 * 1024):
        return 10
    return 3 if name == "2,000 small dicts" else 1


def _reps(name: str, size: int, quick: bool, world: int) -> int:
    """The same on every rank (a rank-dependent count would desynchronize the ranks); quick runs
    from 16 ranks take half, to keep ``make bench`` within minutes on 2 cores."""
    if quick and world >= 16:
        return max(_reps(name, size, quick, 8) // 2, 3)
    nbytes = size if name in ("array", "32 MiB array", "32 MiB tensor", "skewed 32 MiB") else 0
    nbytes = nbytes or (8 * MiB if name == "8 MiB array" else 0)
    if nbytes < 64 * 1024:
        return 60 if quick else 300
    if nbytes < 4 * MiB:
        return 20 if quick else 60
    return 5 if quick else 15


def time_worker(rank: int, world: int, port: int, cases: list[tuple[str, str, int]], quick: bool, out: str) -> None:
    comm = _init(rank, world, port)
    rows = []
    start = time.monotonic()
    for i, (name, op, size) in enumerate(cases):
        if rank == 0:
            print(f"  [{i + 1}/{len(cases)}] world {world}: {op} of {name}"
                  + (f" ({size} B)" if name == "array" else "") + f"  ({time.monotonic() - start:.0f} s so far)",
                  flush=True)
        obj = payload(name, rank, size)
        impls = make_impls(comm, op, obj)
        nbytes = payload_bytes(obj)
        for fn in impls.values():  # warm up
            fn()
        times: dict[str, list[float]] = {k: [] for k in impls}
        batch = _batch(name, size)
        for _ in range(_reps(name, size, quick, world)):
            for key, fn in impls.items():  # interleaved
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(batch):
                    fn()
                times[key].append((time.perf_counter() - t0) / batch)
        comm.reset_stats()  # what one call moves, as distcomm's counters see it (payload bytes, no framing)
        impls["distcomm"]()
        label = "all_gather" if op == INTERLEAVED else op
        st = comm.stats[label]
        moved = (st.bytes_sent, st.bytes_received)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (nbytes, times, moved))
        if rank == 0:
            slowest = {k: [max(t[1][k][i] for t in everyone) for i in range(len(times[k]))] for k in times}
            rows.append({"payload": name, "op": op, "world": world, "size": size,
                         "bytes_per_rank": [t[0] for t in everyone],
                         "moved": [t[2] for t in everyone],
                         "median_s": {k: statistics.median(v) for k, v in slowest.items()}})
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    comm.close()


# ---------------------------------------------------------------- memory worker
def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def memory_worker(rank: int, world: int, port: int, impl: str, op: str, size: int, out: str) -> None:
    comm = _init(rank, world, port)
    obj = np.full(size // 8, rank + 1.0)  # pages touched: counted in the baseline
    fns = make_impls(comm, op, obj)
    small = make_impls(comm, op, np.ones(16))  # warm up the code paths without the big payload
    small[impl]()
    dist.barrier()
    before = _peak_mib()
    result = fns[impl]()
    after = _peak_mib()
    del result
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, after - before)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    comm.close()


def run_world(target: Callable[..., None], world: int, *args: Any) -> None:
    port = distcomm.free_port()
    mp.start_processes(target, args=(world, port, *args), nprocs=world, join=True,  # type: ignore[attr-defined]
                       start_method="spawn")


# ---------------------------------------------------------------- the threaded test world
def threaded_small(world: int, reps: int) -> dict[str, float]:
    """Median time of one all_gather of a small dict in distcomm.testing's threaded world."""
    from distcomm.testing import run_threaded

    def fn(comm: distcomm.Communicator) -> list[float]:
        obj = payload("dict of 8 floats", comm.rank)
        for _ in range(20):
            comm.all_gather(obj)
        times = []
        for _ in range(reps):
            comm.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                comm.all_gather(obj)
            times.append((time.perf_counter() - t0) / 10)
        return times

    per_rank = run_threaded(fn, world, timeout=300)
    slowest = [max(t[i] for t in per_rank) for i in range(reps)]
    return {"world": world, "median_s": statistics.median(slowest)}


# ---------------------------------------------------------------- report
def fmt_time(s: float) -> str:
    return f"{s * 1e6:.0f} µs" if s < 1e-3 else f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def fmt_bytes(n: float) -> str:
    return f"{n:.0f} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < MiB else f"{n / MiB:.2f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--payload", action="append", choices=PAYLOADS, metavar="NAME",
                        help="time only this payload (repeatable), one of: " + "; ".join(repr(p) for p in PAYLOADS)
                        + ". Prints the table and writes nothing, like --world")
    parser.add_argument("--world", action="append", type=int, help="time only this world size (repeatable; "
                        "default 2, 4, 8, 16)")
    parser.add_argument("--op", action="append", choices=("all_gather", "gather", "broadcast", "scatter"),
                        help="time only this collective (repeatable); prints the table, writes nothing")
    parser.add_argument("--save", action="store_true", help="write into benchmarks/results/ (the README's "
                        "figures) instead of benchmarks/out/")
    args = parser.parse_args()
    results = HERE / ("results" if args.save else "out")
    results.mkdir(parents=True, exist_ok=True)
    tmp = results / "_tmp.json"
    names = list(PAYLOADS)
    rooted = ["dict of 8 floats", "8 MiB array"]  # broadcast and scatter, and every op from 8 ranks
    partial = bool(args.payload or args.world or args.op)
    if args.payload:
        names = args.payload
    if partial:
        args.no_plot = args.no_memory = True
    rows: list[dict[str, Any]] = []
    worlds = args.world or (2, 4, 8, 16)
    ops = tuple(args.op or ("all_gather", "gather", "broadcast", "scatter"))

    def cases_at(world: int) -> list[tuple[str, str, int]]:
        return [(n, op, 32 * MiB) for n in names for op in ops
                if n in rooted or (world <= 4 and op in ("all_gather", "gather"))] + \
            [(n, INTERLEAVED, 32 * MiB) for n in names if n == "2,000 small dicts" and world <= 4 and not args.op]

    # a rough guess from runs on 2 cores: seconds per case times the ranks sharing them
    guess = sum(len(cases_at(w)) * (4 if args.quick else 12) * max(w / 2, 1) for w in worlds)
    print(f"benchmarks: {sum(len(cases_at(w)) for w in worlds)} timing cases at worlds {list(worlds)}"
          f"{'' if partial else ', a size sweep and peak memory'}; roughly {guess / 60:.0f} min or more on 2 cores",
          flush=True)
    for world in worlds:
        cases = cases_at(world)
        if cases:
            print(f"timing {len(cases)} cases at world {world} ...", flush=True)
            run_world(time_worker, world, cases, args.quick, str(tmp))
            rows += json.loads(tmp.read_text())
    sweep: list[dict[str, Any]] = []
    if not args.no_plot:
        print("timing the all_gather size sweep at world 2 ...", flush=True)
        sizes = [1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 23, 1 << 25]
        run_world(time_worker, 2, [("array", "all_gather", s) for s in sizes], args.quick, str(tmp))
        sweep = json.loads(tmp.read_text())
    threaded = [] if partial else [threaded_small(w, 50 if args.quick else 200) for w in (2, 4)]
    mem: list[dict[str, Any]] = []
    if not args.no_memory:
        print("measuring peak memory (256 MiB per rank) ...", flush=True)
        for op in ("all_gather", "gather"):
            for impl in ("distcomm", "torch", "naive", "floor"):
                run_world(memory_worker, 2, impl, op, 256 * MiB, str(tmp))
                mem.append({"impl": impl, "op": op, "rise_mib": json.loads(tmp.read_text())})
    tmp.unlink(missing_ok=True)

    lines = [
        f"distcomm benchmarks: gloo over 127.0.0.1 on this machine ({os.cpu_count()} CPU cores, "
        f"{platform.machine()}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"{'quick' if args.quick else 'full'} run)",
        "",
        "Median time of one collective (slowest rank; small payloads: batches of 10 or 3 calls back to back); "
        "ratio = distcomm / torch within the same run.",
        "",
        "Bytes: what distcomm's counters say one call moved per rank (largest sent / largest received "
        "over ranks; payload bytes, no TCP/IP or gloo framing: benchmarks/wire.py counts those).",
        "",
        "compat: distcomm.compat.torch's function of torch's name (torch's signature, in-place lists).",
        "",
        "| payload | op | world | distcomm | torch | compat | naive | floor | distcomm/torch | compat/torch "
        "| distcomm/floor | sent / received per rank |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        m = r["median_s"]
        naive = fmt_time(m["naive"]) if "naive" in m else "n/a"
        sent = max(x[0] for x in r["moved"])
        received = max(x[1] for x in r["moved"])
        lines.append(f"| {r['payload']} | {r['op']} | {r['world']} | {fmt_time(m['distcomm'])} | {fmt_time(m['torch'])}"
                     f" | {fmt_time(m['compat'])} | {naive} | {fmt_time(m['floor'])} | {m['distcomm'] / m['torch']:.2f}"
                     f" | {m['compat'] / m['torch']:.2f}"
                     f" | {m['distcomm'] / m['floor']:.2f} | {fmt_bytes(sent)} / {fmt_bytes(received)} |")
    lines += ["", "distcomm.testing's threaded world (ranks as threads in one process, same pipeline): "
              "all_gather of a dict of 8 floats, median per call (slowest rank).", "",
              "| world | time |", "|---|---|"]
    lines += [f"| {t['world']} threads | {fmt_time(t['median_s'])} |" for t in threaded]
    if mem:
        lines += ["", "Peak RSS rise during one collective of 256 MiB per rank, world 2, as a multiple of the "
                  "payload (rank 0 is gather's dst).", "",
                  "| op | impl | rank 0 | rank 1 |", "|---|---|---|---|"]
        for m in mem:
            a, b = m["rise_mib"]
            lines.append(f"| {m['op']} | {m['impl']} | {a / 256:.2f}x | {b / 256:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    if partial:
        return
    (results / "results.md").write_text(text)
    (results / "results.json").write_text(json.dumps({"time": rows, "sweep": sweep, "memory": mem,
                                                    "threaded": threaded}, indent=1))
    if sweep:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.5))
        for impl in ("distcomm", "torch", "naive", "floor"):
            ax.plot([r["size"] for r in sweep], [r["median_s"][impl] * 1e3 for r in sweep], marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("numpy array per rank (bytes)")
        ax.set_ylabel("median all_gather time (ms)")
        ax.set_title("all_gather, 2 gloo ranks over 127.0.0.1")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(results / "time_vs_size.png", dpi=110)
        print(f"wrote {results / 'results.md'} and {results / 'time_vs_size.png'}")


if __name__ == "__main__":
    sys.exit(main())
