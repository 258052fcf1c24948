"""``python -m distcomm check``: every rank meets, every collective gives exact results, and rank 0
prints one table (host, rank, local rank, device, interface, seconds from the process's start to
its communicator) and a verdict.

Run under the job's launcher (``srun -N 2 python -m distcomm check``, ``torchrun ...``,
``mpirun ...``) or alone with ``--nproc N`` (processes on this machine). A problem is named with
its cause and fix: the rendezvous' own errors say which (a name that doesn't resolve, nothing
listening, a firewall, a port in use, a loopback interface); versions that differ across ranks are
compared through the job's store before any collective, whose wire they might not share.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._agreement import spans
from .._communicator import Communicator
from .._context import current
from .._errors import DistCommError, clipped
from .env import gloo_interface, versions

__all__ = ["check_rank", "exact_results", "verdict"]

_MAX_ROWS = 64  # rows of the table; a larger job's are summarized


def check_rank() -> bool:
    """One rank's part (its communicator is made): compare versions, run the collectives; rank 0
    prints. True if all is well. Every rank takes the same path: the versions' verdict is read by
    all, and each rank's problems travel with its row (a rank that found a wrong value still
    gathers), unless a collective failed, which every rank hears of."""
    comm = current()
    mine = _about_me(comm, _since_process_start())
    mismatch = _versions_differ(comm, mine["versions"])
    if mismatch:
        if comm.rank == 0:
            print(verdict(comm, None, mismatch, []), flush=True)
        return False
    problems, broken = exact_results(comm)
    rows = None if broken else comm.gather((mine, problems), dst=0)
    if comm.rank == 0:
        if rows:
            problems = [f"rank {row['rank']}: {p}" if row["rank"] else p for row, theirs in rows for p in theirs]
        print(verdict(comm, [row for row, _ in rows] if rows else None, "", problems), flush=True)
    return not problems


def _about_me(comm: Communicator, meet_s: float) -> dict[str, Any]:
    name, address, loopback, _ = gloo_interface()
    device = str(comm.device) if comm.device.type != "cpu" else "cpu"
    return {"host": socket.gethostname(), "rank": comm.rank, "local_rank": comm.local_rank, "device": device,
            "interface": f"{name or '?'} {address}" + (" (loopback)" if loopback else ""),
            "meet_s": meet_s, "versions": versions()}


def _versions_differ(comm: Communicator, mine: dict[str, str]) -> str:
    """Which ranks run other versions than rank 0 ("" where all agree), on every rank. Compared
    through the job's store, before any collective: ranks of different distcomm or torch versions
    may not share a wire. Rank 0 reads each rank's versions and writes the verdict every rank reads
    (a few store calls per rank at any world size)."""
    if comm.world_size == 1 or not dist.is_initialized():
        return ""
    store = dist.distributed_c10d._get_default_store()
    seat = getattr(comm, "_seat", None)
    key = f"distcomm-check/{seat.epoch if seat is not None else ''}"  # this run's keys alone
    store.set(f"{key}/versions/{comm.rank}", json.dumps(mine))
    if comm.rank != 0:
        return str(store.get(f"{key}/verdict").decode())
    odd: dict[str, list[int]] = {}
    for r in range(1, comm.world_size):
        theirs = json.loads(store.get(f"{key}/versions/{r}"))
        for k in ("distcomm", "torch", "python", "nccl"):
            if theirs.get(k) != mine.get(k):
                odd.setdefault(f"{k} {theirs.get(k)}", []).append(r)
    said = "" if not odd else (
        "versions differ: rank 0 runs " + ", ".join(f"{k} {mine[k]}" for k in ("distcomm", "torch", "python"))
        + "; " + "; ".join(f"{spans(ranks)} {what}" for what, ranks in odd.items()))
    store.set(f"{key}/verdict", said)
    return said


def exact_results(comm: Communicator) -> tuple[list[str], bool]:
    """Run each collective with values whose results are known: the problems this rank found, and
    whether a collective failed (it leaves the communicator broken, so the run ends there)."""
    problems: list[str] = []
    for name, run in _CHECKS:
        try:
            wrong = run(comm)
        except DistCommError as e:
            return [f"{name}: {type(e).__name__}: {clipped(str(e).splitlines()[0], 400)}"], True
        if wrong:
            problems.append(f"{name}: {wrong}")
    return problems, False


def _all_reduce(comm: Communicator) -> str:
    n = comm.world_size
    t = torch.tensor([comm.rank + 1], dtype=torch.int64, device=comm.device)
    comm.all_reduce(t)
    return "" if int(t) == n * (n + 1) // 2 else f"sum of 1..{n} gave {int(t)}"


def _all_gather(comm: Communicator) -> str:
    got = comm.all_gather({"rank": comm.rank, "host": socket.gethostname()})
    return "" if [g["rank"] for g in got] == list(range(comm.world_size)) else f"ranks came back as {got}"


def _broadcast(comm: Communicator) -> str:
    last = comm.world_size - 1
    got = comm.broadcast(("from", comm.rank) if comm.rank == last else None, src=last)
    return "" if got == ("from", last) else f"got {got!r} from rank {last}"


def _reduce_dict(comm: Communicator) -> str:
    n = comm.world_size
    got = comm.all_reduce_dict({"x": torch.tensor(float(comm.rank))})
    return "" if float(got["x"]) == sum(range(n)) / n else f"mean of 0..{n - 1} gave {float(got['x'])}"


def _gather_tensor(comm: Communicator) -> str:
    rows = comm.all_gather_tensor(torch.full((comm.rank + 1, 2), comm.rank, dtype=torch.int32, device=comm.device))
    want = torch.cat([torch.full((r + 1, 2), r, dtype=torch.int32) for r in range(comm.world_size)])
    return "" if torch.equal(rows.cpu(), want) else "uneven rows came back wrong"


def _ring(comm: Communicator) -> str:
    n, r = comm.world_size, comm.rank
    if n == 1:
        return ""
    handle = comm.isend(r, (r + 1) % n)
    got = comm.recv((r - 1) % n)
    handle.wait()
    return "" if got == (r - 1) % n else f"rank {r} got {got} from rank {(r - 1) % n}"


def _seed(comm: Communicator) -> str:
    seeds = comm.all_gather(comm.shared_random_seed())
    return "" if len(set(seeds)) == 1 else f"the ranks' seeds differ: {seeds}"


_CHECKS: list[tuple[str, Callable[[Communicator], str]]] = [
    ("barrier", lambda c: (c.barrier(), "")[1]), ("all_reduce", _all_reduce), ("all_gather", _all_gather),
    ("broadcast", _broadcast), ("all_reduce_dict", _reduce_dict), ("all_gather_tensor", _gather_tensor),
    ("send/recv ring", _ring), ("shared_random_seed", _seed)]


def verdict(comm: Communicator, rows: list[dict[str, Any]] | None, mismatch: str, problems: list[str]) -> str:
    """Rank 0's report: the table of ranks, then one line that says whether the job can run."""
    lines = []
    if rows:
        lines.append(f"{'host':<20} {'rank':>5} {'local':>5}  {'device':<8} {'interface':<28} {'ready':>7}")
        for row in rows[:_MAX_ROWS]:
            lines.append(f"{row['host'][:20]:<20} {row['rank']:>5} {row['local_rank']:>5}  {row['device']:<8} "
                         f"{row['interface'][:28]:<28} {row['meet_s']:>6.2f}s")
        if len(rows) > _MAX_ROWS:
            lines.append(f"... and {len(rows) - _MAX_ROWS} more ranks")
    hosts = len({row["host"] for row in rows}) if rows else 0
    if mismatch:
        lines.append(f"PROBLEM: {mismatch}; install the same versions on every machine")
    for problem in problems:
        lines.append(f"PROBLEM: {problem}")
    if not (mismatch or problems):
        slowest = max(row["meet_s"] for row in rows) if rows else 0.0
        lines.append(f"OK: {comm.world_size} ranks on {hosts} host{'s' if hosts != 1 else ''} were ready within "
                     f"{slowest:.2f} s of starting; {len(_CHECKS)} collectives gave exact results "
                     f"({type(comm).__name__})")
    return "\n".join(lines)


def _since_process_start() -> float:
    """Seconds since this process started (Python's and torch's start-up, then the rendezvous)."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(uptime - ticks / os.sysconf("SC_CLK_TCK"), 0.0)
    except (OSError, ValueError, IndexError):
        return 0.0
