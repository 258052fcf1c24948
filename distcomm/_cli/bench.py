"""``python -m distcomm bench``: object and tensor collectives over message sizes at the launcher's
world size, beside torch's own API in the same run.

Each row times one collective at one size: distcomm's call and torch's (``all_gather_object``,
``broadcast_object_list``, ``all_reduce``) on the same process group, interleaved, so a noisy
machine slows both alike; the ratio is torch's time over distcomm's (above 1: distcomm is faster).
The payload of the object collectives is a NumPy array of that many bytes (what evaluation results
are made of); the tensor collective reduces a float32 tensor of that many bytes.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .._communicator import Communicator
from .._context import current

__all__ = ["OPS", "bench_problem", "bench_rank", "parse_size", "plot", "table"]

OPS = ("all_gather", "broadcast", "all_reduce", "all_reduce check=False")
"""distcomm's all_reduce checks by default that every rank passed the same dtype, shape and op (a
mismatch raises on every rank instead of corrupting or hanging); check=False is torch's contract."""
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``"64K"``, ``"16M"``, ``"1G"`` or a number of bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1] if t and t[-1] in _UNITS else ""
    try:
        value = float(t[: len(t) - len(unit)])
    except ValueError:
        raise ValueError(f"a size is a number of bytes with an optional K, M or G (got {text!r})") from None
    if not math.isfinite(value) or int(value * _UNITS[unit]) < 1:
        raise ValueError(f"a size must be at least one byte (got {text!r})")
    return int(value * _UNITS[unit])


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}" if unit == "B" else f"{n:.4g} {unit}"
        n /= 1024
    return f"{n} B"


def bench_problem(sizes: list[int], world: int, local_ranks: int, png: str | None) -> str:
    """Why the bench can't run here ("" where it can), before anything is allocated: sizes this
    machine's free memory can't hold (an all_gather keeps every rank's copy on each rank, torch's
    beside distcomm's), or a plot without matplotlib."""
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    need = max(sizes) * (2 * world + 4) * local_ranks
    if need > free:
        return (f"a size of {human(max(sizes))} at {world} ranks needs about {human(need)} on this machine "
                f"({local_ranks} ranks here, each holding every rank's copy), and {human(free)} is free; "
                f"pass smaller --sizes")
    if png:
        try:
            import matplotlib  # noqa: F401 - only asked whether it is there
        except ImportError:
            return "--plot needs matplotlib (pip install matplotlib)"
    return ""


def _iterations(size: int) -> int:
    """Calls per timing: alike on every rank (no agreement needed), fewer as the size grows."""
    return max(3, min(50, (64 << 20) // max(size, 1)))


def _runners(comm: Communicator, op: str, size: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
    """(distcomm's call, torch's) for ``op`` at ``size`` bytes."""
    group = comm.group
    if op == "all_gather":
        obj = np.full(size, comm.rank % 251, dtype=np.uint8)
        out: list[Any] = [None] * comm.world_size
        return (lambda: comm.all_gather(obj)), (lambda: dist.all_gather_object(out, obj, group=group))
    if op == "broadcast":
        src_obj = np.zeros(size, dtype=np.uint8) if comm.rank == 0 else None
        box: list[Any] = [src_obj]
        return (lambda: comm.broadcast(src_obj, src=0)), (lambda: dist.broadcast_object_list(box, src=0, group=group))
    t = torch.ones(max(size // 4, 1), dtype=torch.float32, device=comm.device)
    checked = op == "all_reduce"
    return (lambda: comm.all_reduce(t, check=checked)), (lambda: dist.all_reduce(t, group=group))


def _timed(comm: Communicator, call: Callable[[], Any], n: int) -> float:
    comm.barrier()
    start = time.perf_counter()
    for _ in range(n):
        call()
    comm.synchronize()
    return (time.perf_counter() - start) / n


def bench_rank(sizes: list[int], repeats: int = 3) -> list[dict[str, Any]]:
    """Every rank runs every row; rank 0's rows are returned (the slowest rank sets the pace:
    each timing ends with a barrier). Rank 0 prints a progress line as it goes."""
    comm = current()
    rows = []
    steps = [(op, size) for op in OPS for size in sizes]
    for i, (op, size) in enumerate(steps, 1):
        if comm.rank == 0:
            _progress(f"bench: {op} {human(size)} [{i}/{len(steps)}]")
        ours, theirs = _runners(comm, op, size)
        n = _iterations(size)
        ours(), theirs()  # warm-up: buffers, groups, code paths
        times: dict[str, list[float]] = {"distcomm": [], "torch": []}
        for _ in range(repeats):  # interleaved: a noisy moment slows both
            times["distcomm"].append(_timed(comm, ours, n))
            times["torch"].append(_timed(comm, theirs, n))
        d, t = statistics.median(times["distcomm"]), statistics.median(times["torch"])
        rows.append({"op": op, "bytes": size, "world": comm.world_size, "distcomm_s": d, "torch_s": t})
    if comm.rank == 0:
        _progress("")
    return rows


def _progress(line: str) -> None:
    """One line on stderr, rewritten in place on a terminal (one line per step in a log)."""
    if sys.stderr.isatty():
        print(f"\r{line:<60}", end="" if line else "\r", file=sys.stderr, flush=True)
    elif line:
        print(line, file=sys.stderr, flush=True)


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown: time per call and payload bandwidth of each, and the ratio (torch / distcomm)."""
    world = rows[0]["world"] if rows else 0
    lines = [f"world size {world}; time per call (the slowest rank's pace); bandwidth = payload bytes / time",
             "", "| collective | size | distcomm | torch | ratio | distcomm MB/s | torch MB/s |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        d, t, b = r["distcomm_s"], r["torch_s"], r["bytes"]
        lines.append(f"| {r['op']} | {human(b)} | {d * 1e3:.3f} ms | {t * 1e3:.3f} ms | {t / d:.2f}x | "
                     f"{b / d / 1e6:.1f} | {b / t / 1e6:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Time against size, one panel per collective, distcomm beside torch (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [op for op in OPS if any(r["op"] == op for r in rows)]
    fig, axes = plt.subplots(1, len(ops), figsize=(5 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops, strict=True):
        mine = [r for r in rows if r["op"] == op]
        for key, label in (("distcomm_s", "distcomm"), ("torch_s", "torch")):
            ax.loglog([r["bytes"] for r in mine], [r[key] * 1e3 for r in mine], marker="o", label=label)
        ax.set_title(f"{op} ({rows[0]['world']} ranks)")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("ms per call")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
