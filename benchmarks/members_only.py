"""What the job's key costs: small calls, a checked all_reduce, an admit with no one waiting and a
shrink that lost no one (its agreement, its signed records, its new group and the members' proof),
each in a job with a key and in the same job without one, one after the other in one run; with the
key, an admit that lets a replacement in (a job without one refuses it) and the members' proof; and
what ``AuthenticatedSerializer`` adds to a payload of 1 KiB and of 1 MiB.

    python benchmarks/members_only.py [--world 2 4] [--rounds 2]

Each job's ranks are processes started as a job controller starts them (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT; DISTCOMM_JOB_KEY for the keyed one); rank 0 times its calls. Best of
``--rounds`` jobs of each kind. Prints markdown tables (benchmarks/out/members_only.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
from _report import publish  # (run as a script: benchmarks/ is on the path)

import distcomm

JOB = """
    import json, os, signal, statistics, sys, time, torch
    import distcomm
    from distcomm._trust.handshake import prove_members

    def per_call(fn, n):
        times = []
        for _ in range(n):
            t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
        return statistics.median(times)

    def proof(comm):  # the members' proof alone, on the job's group (a collective: every member times it)
        return per_call(lambda: prove_members(comm._key, "bench", tuple(comm._ranks), None, comm.group), 20)

    comm = distcomm.from_env()
    if comm.membership.admitted:  # the replacement (keyed jobs): let in, it takes part in the proof's timing
        proof(comm)
        sys.exit(comm.close())
    t = torch.ones(4)
    for _ in range(50):
        comm.all_gather(1); comm.all_reduce(t)
    out = {"all_gather": per_call(lambda: comm.all_gather(1), 400),
           "all_reduce": per_call(lambda: comm.all_reduce(t), 400),
           "admit": per_call(comm.admit, 40)}
    shrinks = []
    for _ in range(5):
        comm.barrier()
        start = time.perf_counter(); comm = comm.shrink(); shrinks.append(time.perf_counter() - start)
    out["shrink"] = statistics.median(shrinks)
    if comm._key is not None:  # the last rank is lost and started again: the admit that lets it in
        if comm.rank == comm.world_size - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.barrier()
        except Exception:
            comm = comm.shrink()
        while True:
            start = time.perf_counter(); new = comm.admit(); took = time.perf_counter() - start
            if new is not comm:
                comm, out["admission"] = new, took
                break
            time.sleep(0.05)
        out["proof"] = proof(comm)
    if comm.rank == 0:
        print(json.dumps(out), flush=True)
    comm.close()
"""


def _job(script: Path, world: int, keyed: bool) -> dict[str, float]:
    port = distcomm.free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("DISTCOMM_JOB_KEY")}
    procs = []
    for r in range(world):
        env = {**base, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", **({"DISTCOMM_JOB_KEY": "the benchmark's job key"} if keyed else {})}
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True))
    if keyed:  # the last rank kills itself once measured: started again, as a replacement
        procs[-1].wait(600)
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=600)[0] for p in procs]
    codes = [p.returncode for p in procs]
    if any(codes[:world - 1]) or codes[-1] or (codes[world - 1] and not keyed):
        raise SystemExit(f"a rank failed: exit codes {codes}")
    return json.loads(outs[0].strip().splitlines()[-1])  # type: ignore[no-any-return]


def _round_trip(serializer: distcomm.Serializer, obj: object, n: int) -> float:
    """Seconds to make a payload of ``obj`` and load it (best of 5 runs of ``n``)."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(n):
            serializer.loads([memoryview(s) for s in serializer.dumps(obj)])
        best = min(best, (time.perf_counter() - start) / n)
    return best


def _authentication_rows() -> list[str]:
    plain = distcomm.PickleSerializer()
    authenticated = distcomm.AuthenticatedSerializer(plain, key="the benchmark's job key")
    rows = ["| payload | PickleSerializer | AuthenticatedSerializer | added |", "|---|---|---|---|"]
    for name, obj, n in (("1 KiB (bytes, in the stream)", os.urandom(1024), 2000),
                         ("1 MiB (numpy array, out of band)", np.ones(1 << 18, dtype=np.float32), 40)):
        a, b = _round_trip(plain, obj, n) * 1e6, _round_trip(authenticated, obj, n) * 1e6
        rows.append(f"| {name} | {a:.1f} µs | {b:.1f} µs | {b - a:.1f} µs |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    rows = ["| world | call | no key | with the key | ratio |", "|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as d:
        script = Path(d) / "job.py"
        script.write_text(textwrap.dedent(JOB))
        for world in args.world:
            best: dict[bool, dict[str, float]] = {}
            for _ in range(args.rounds):
                for keyed in (False, True):  # (interleaved: the machine's drift touches both alike)
                    got = _job(script, world, keyed)
                    best[keyed] = {k: min(v, best.get(keyed, got)[k]) for k, v in got.items()}
            for call, unit, scale in (("all_gather", "µs", 1e6), ("all_reduce", "µs", 1e6), ("admit", "µs", 1e6),
                                      ("shrink", "ms", 1e3)):
                plain, keyed_ = best[False][call] * scale, best[True][call] * scale
                name = {"all_gather": "all_gather (one int)", "all_reduce": "checked all_reduce (4 floats)",
                        "admit": "admit(), no one waiting", "shrink": "shrink(), no one lost"}[call]
                rows.append(f"| {world} | {name} | {plain:.1f} {unit} | {keyed_:.1f} {unit} | {keyed_ / plain:.2f}x |")
            rows.append(f"| {world} | admit() that lets a replacement in | refused | "
                        f"{best[True]['admission'] * 1e3:.1f} ms | |")
            rows.append(f"| {world} | the members' proof alone (part of each new group) | | "
                        f"{best[True]['proof'] * 1e3:.2f} ms | |")
    said = "Every message authenticated: a payload made and loaded (one rank's work each way)"
    publish("\n".join(rows) + f"\n\n{said}\n\n" + "\n".join(_authentication_rows()), "members_only")


if __name__ == "__main__":
    main()
