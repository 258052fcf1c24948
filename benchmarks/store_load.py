"""The job's store under the load of a large world: what the keep-alive and a shrink's agreement ask
of it, and how long one call then takes.

    python benchmarks/store_load.py [--world 64 256 1024] [--seconds 8]

The store is served by a process of its own (``python -m distcomm store``, as a job that outlives
its ranks runs it). Each simulated rank is a thread with a connection of its own, spread over four
processes, asking what a rank of a job's communicator asks:
- beating: the keep-alive's three calls every 0.5 s (its own count, its successor's, the "silent"
  flag), phases spread at random;
- agreeing: on top of the beat, a member's look for the decision of an agreement, every 50 ms
  (left out: its look at the leader's beat, two calls a second; and the leader's own looks, one
  per member every 0.2 s, from one client).
Meanwhile this process times one call (a ``check``) at a time: the latency any rank's call meets.
Before that, "connecting" is how long the slowest process's ranks took to connect, all at once, as
a job's ranks do at start-up.
Prints a markdown table (and writes benchmarks/out/store_load.md). On a machine with few cores the
simulated ranks' own Python competes with the store for CPU: the figures are an upper bound on the
latency of a store on a machine of its own, and "served" below "asked" means the clients, not
necessarily the store, ran out of CPU.
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from _report import publish  # (run as a script: benchmarks/ is on the path)

import distcomm

BEAT, LOOK = 0.5, 0.05
PROCESSES = 4

RANKS = textwrap.dedent("""
    import datetime, random, sys, threading, time
    import torch.distributed as dist

    port, first, count, world, seconds = map(int, sys.argv[1:6])
    agreeing = sys.argv[6] == "1"
    BEAT, LOOK = 0.5, 0.05
    calls = [0] * count
    connected, go = threading.Barrier(count + 1), threading.Event()

    def rank(i):
        me = first + i
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60),
                              wait_for_workers=False)
        connected.wait()
        go.wait()
        end = time.monotonic() + seconds
        next_beat = time.monotonic() + random.uniform(0, BEAT)
        n = 0
        while True:
            now = time.monotonic()
            if now >= end:
                break
            if now >= next_beat:
                store.add(f"alive/{me}", 1)
                store.add(f"alive/{(me + 1) % world}", 0)
                store.check(["epoch/silent"])
                n += 3
                next_beat += BEAT
            if agreeing:
                store.check(["epoch/shrink/decision"])
                n += 1
                time.sleep(LOOK)
            else:
                time.sleep(max(next_beat - time.monotonic(), 0))
        calls[i] = n

    threads = [threading.Thread(target=rank, args=(i,), daemon=True) for i in range(count)]
    start = time.monotonic()
    for t in threads:
        t.start()
    connected.wait()
    print("ready", time.monotonic() - start, flush=True)
    sys.stdin.readline()  # every process's ranks connected (connecting slows the store down): go
    go.set()
    for t in threads:
        t.join()
    print(sum(calls), flush=True)
""")


def run(port: int, world: int, seconds: float, agreeing: bool, tmp: Path) -> dict[str, float]:
    script = tmp / "ranks.py"
    script.write_text(RANKS)
    per = [world // PROCESSES + (1 if p < world % PROCESSES else 0) for p in range(PROCESSES)]
    firsts = [sum(per[:p]) for p in range(PROCESSES)]
    procs = [subprocess.Popen([sys.executable, str(script), str(port), str(f), str(n), str(world), str(int(seconds)),
                               "1" if agreeing else "0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for f, n in zip(firsts, per, strict=True) if n]  # (their errors go to this process's stderr)
    probe = distcomm._launching.rendezvous._c10d().TCPStore("127.0.0.1", port, is_master=False,
                                                 timeout=datetime.timedelta(seconds=60), wait_for_workers=False)
    connecting = 0.0
    for p in procs:  # every rank connected: they start together
        assert p.stdout is not None
        said, took = p.stdout.readline().split()
        assert said == "ready", said
        connecting = max(connecting, float(took))
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    latencies = []
    end = time.monotonic() + seconds * 0.8
    while time.monotonic() < end:
        t = time.perf_counter()
        probe.check(["probe"])
        latencies.append(time.perf_counter() - t)
        time.sleep(random.uniform(0.002, 0.008))
    outs = [p.stdout.read().strip() if p.stdout else "" for p in procs]  # (the wrapper: "ready" was read through it)
    for p in procs:
        p.wait(60)
    if not all(o.isdigit() for o in outs):
        raise RuntimeError(f"a process of simulated ranks failed: exit codes {[p.returncode for p in procs]}, "
                           f"said {outs}")
    served = sum(map(int, outs))
    asked = world * (3 / BEAT + (1 / LOOK if agreeing else 0))
    latencies.sort()
    return {"asked": asked, "served": served / seconds, "p50": statistics.median(latencies) * 1e3,
            "p99": latencies[int(len(latencies) * 0.99)] * 1e3, "connecting": connecting}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    port = distcomm.free_port()
    server = subprocess.Popen([sys.executable, "-m", "distcomm", "store", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        time.sleep(2.0)
        with tempfile.TemporaryDirectory() as d:
            for world in args.world:
                for agreeing in (False, True):
                    r = run(port, world, args.seconds, agreeing, Path(d))
                    rows.append(f"| {world} | {r['connecting']:.1f} | {'agreeing' if agreeing else 'beating'} | "
                                f"{r['asked']:,.0f} | {r['served']:,.0f} | {r['p50']:.2f} | {r['p99']:.2f} |")
                    print(rows[-1], flush=True)
    finally:
        server.terminate()
        server.wait(10)
    table = "\n".join(["| world | connecting (s) | ranks are | calls/s asked | calls/s served | one call, p50 (ms) "
                       "| p99 (ms) |", "|---|---|---|---|---|---|---|", *rows])
    publish(table, "store_load")


if __name__ == "__main__":
    main()
