"""Bytes on the wire per rank per call, counted by the kernel: one "host" per rank.

    sudo python benchmarks/wire.py --world 8          (or: make bench-wire)

Each rank runs in its own network namespace, joined to the others by a veth pair on one bridge,
so each rank's interface counters (``/sys/class/net/eth0/statistics/{tx,rx}_bytes``) count exactly
what that rank put on and took off the wire: payload, gloo's framing, TCP/IP headers and ACKs.
Every case runs a warm-up, then ``--calls`` calls between two counter reads (the ranks meet in
the store before and after, outside the counted window). Prints, per case, the mean and the
largest bytes sent and received per rank per call, what rank 0 (every case's root) sent, and the
CPU time per call of each rank's process, every thread included (gloo's own): the work a rank
does per call, which on a machine with fewer cores than ranks includes the cost of sharing them.
Needs root (``ip netns``); cleans up on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PREFIX = "dcw"
SUBNET = "10.77.0"

CASES = [
    "torch barrier", "distcomm synchronize",
    "torch all_reduce (8 floats)", "distcomm reduce_dict (8 floats)", "distcomm all_reduce_dict (8 floats)",
    "torch all_gather_object (dict of 8 floats)", "distcomm all_gather (dict of 8 floats)",
    "torch gather_object (dict of 8 floats)", "distcomm gather (dict of 8 floats)",
    "torch broadcast_object_list (8 MiB array)", "distcomm broadcast (8 MiB array)",
    "torch broadcast_object_list (dict of 8 floats)", "distcomm broadcast (dict of 8 floats)",
    "distcomm scatter (dict of 8 floats)",
]


def _sh(*args: str, check: bool = True) -> None:
    subprocess.run(args, check=check, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@contextlib.contextmanager
def hosts(n: int) -> Iterator[list[str]]:
    """n network namespaces on one bridge; yields their names; removes everything on exit."""
    bridge = f"{PREFIX}br"
    names = [f"{PREFIX}{i}" for i in range(n)]
    try:
        _sh("ip", "link", "add", bridge, "type", "bridge")
        _sh("ip", "link", "set", bridge, "up")
        for i, ns in enumerate(names):
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", f"{ns}h", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _sh("ip", "link", "set", f"{ns}h", "master", bridge)
            _sh("ip", "link", "set", f"{ns}h", "up")
            _sh("ip", "-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _sh("ip", "-n", ns, "link", "set", "eth0", "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for ns in names:
            _sh("ip", "link", "del", f"{ns}h", check=False)
            _sh("ip", "netns", "del", ns, check=False)
        _sh("ip", "link", "del", bridge, check=False)


def _counters() -> tuple[int, int]:
    base = Path("/sys/class/net/eth0/statistics")
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def _case(name: str, comm: Any) -> Callable[[], Any]:
    import numpy as np
    import torch
    import torch.distributed as dist

    r = comm.rank
    small = {f"metric_{i}": float(r + i / 7) for i in range(8)}
    losses = {f"loss_{i}": torch.tensor(float(r + i)) for i in range(8)}
    big = np.full((8 << 20) // 8, 1.0) if r == 0 else None
    stacked = torch.stack(list(losses.values()))
    table: dict[str, Callable[[], Any]] = {
        "torch barrier": lambda: dist.barrier(),
        "distcomm synchronize": comm.synchronize,
        "torch all_reduce (8 floats)": lambda: dist.all_reduce(stacked.clone()),
        "distcomm reduce_dict (8 floats)": lambda: comm.reduce_dict(losses),
        "distcomm all_reduce_dict (8 floats)": lambda: comm.all_reduce_dict(losses),
        "torch all_gather_object (dict of 8 floats)":
            lambda: dist.all_gather_object([None] * comm.world_size, small),
        "distcomm all_gather (dict of 8 floats)": lambda: comm.all_gather(small),
        "torch gather_object (dict of 8 floats)":
            lambda: dist.gather_object(small, [None] * comm.world_size if r == 0 else None, dst=0),
        "distcomm gather (dict of 8 floats)": lambda: comm.gather(small),
        "torch broadcast_object_list (8 MiB array)": lambda: dist.broadcast_object_list([big], src=0),
        "distcomm broadcast (8 MiB array)": lambda: comm.broadcast(big, src=0),
        "torch broadcast_object_list (dict of 8 floats)": lambda: dist.broadcast_object_list([small], src=0),
        "distcomm broadcast (dict of 8 floats)": lambda: comm.broadcast(small, src=0),
        "distcomm scatter (dict of 8 floats)": lambda: comm.scatter([small] * comm.world_size if r == 0 else None),
    }
    return table[name]


def worker(rank: int, world: int, port: int, cases: list[str], calls: int) -> None:
    import datetime

    import torch.distributed as dist

    import distcomm

    os.environ["GLOO_SOCKET_IFNAME"] = "eth0"
    store = dist.TCPStore(f"{SUBNET}.1", port, world, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    comm = distcomm.GlooCommunicator(machine=rank)  # one host per rank (the namespaces share a host name)
    out = {}
    for i, name in enumerate(cases):
        fn = _case(name, comm)
        n = max(1, calls // 8) if "8 MiB" in name else calls
        for _ in range(3):
            fn()
        store.set(f"ready/{i}/{rank}", "1")
        store.wait([f"ready/{i}/{q}" for q in range(world)])
        time.sleep(0.3)
        tx0, rx0 = _counters()
        cpu0 = time.process_time()  # this process's CPU, every thread's (the transport's own included)
        wall0 = time.perf_counter()
        for _ in range(n):
            fn()
        wall1 = time.perf_counter()
        cpu1 = time.process_time()
        time.sleep(0.3)
        tx1, rx1 = _counters()
        out[name] = ((tx1 - tx0) / n, (rx1 - rx0) / n, (cpu1 - cpu0) / n, (wall1 - wall0) / n)
        store.set(f"done/{i}/{rank}", "1")
        store.wait([f"done/{i}/{q}" for q in range(world)])
    comm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps({"rank": rank, "bytes": out}), flush=True)


def measure(world: int, cases: list[str], calls: int) -> dict[str, list[tuple[float, ...]]]:
    with socket.socket() as s:  # a port number; the store binds it inside the first namespace
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with hosts(world) as names:
        procs = [subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, __file__, "--worker", str(r), "--world", str(world),
             "--port", str(port), "--calls", str(calls), "--cases", json.dumps(cases)],
            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
            for r, ns in enumerate(names)]
        try:
            outs = [p.communicate(timeout=900)[0] for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    per_rank = [json.loads(o.strip().splitlines()[-1])["bytes"] for o in outs]
    return {c: [tuple(pr[c]) for pr in per_rank] for c in cases}


def cpu_ms(x: float) -> str:
    return f"{x * 1e3:.2f} ms"


def kib(x: float) -> str:
    return f"{x / 1024:.1f} KiB"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--case", action="append", choices=CASES, help="only these cases (repeatable)")
    ap.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cases", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker, args.world[0], args.port, json.loads(args.cases), args.calls)
        return
    cases = args.case or CASES
    print("| world | call | time per call (slowest rank) | sent/rank (mean) | received/rank (mean) | sent (max rank) "
          "| received (max rank) | sent by rank 0 (every root) | CPU per call (mean rank) | CPU per call (max rank) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world in args.world:
        for case, rows in measure(world, cases, args.calls).items():
            tx, rx, cpu, wall = ([row[i] for row in rows] for i in range(4))
            print(f"| {world} | {case} | {cpu_ms(max(wall))} | {kib(sum(tx) / world)} | {kib(sum(rx) / world)} | "
                  f"{kib(max(tx))} | {kib(max(rx))} | {kib(tx[0])} | {cpu_ms(sum(cpu) / world)} | {cpu_ms(max(cpu))} |",
                  flush=True)

if __name__ == "__main__":
    main()
