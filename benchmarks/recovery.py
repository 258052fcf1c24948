"""Time from a killed rank to the survivors' first completed collective: shrink, beside a torchrun
restart of the same job from its checkpoint.

    python benchmarks/recovery.py [--world 4 8] [--reps 3]

The job: every rank loops ``all_gather`` over a small dict, one step every 20 ms; at step 50 one
rank kills itself (SIGKILL), writing the time just before. Two ways on:
- shrink: the ranks were started as a job controller starts them (RANK, WORLD_SIZE, ...; the store
  served by this process), the survivors catch the failure, ``comm.shrink()``, and do one more
  all_gather;
- restart: the same job under ``torchrun --max-restarts 1``: the agent ends every worker and starts
  them all again; each loads the checkpoint (a 1 MiB state) and does one all_gather.
The figure is the time from the kill to the last survivor's first completed collective after it,
median over the repetitions. Prints a markdown table (and writes benchmarks/out/recovery.md).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from _report import publish  # (run as a script: benchmarks/ is on the path)

import distcomm
from distcomm._launching.rendezvous import serve_store

JOB = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch
    import distcomm

    out, victim = sys.argv[1], int(sys.argv[2])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    comm = distcomm.from_env(timeout=120)
    ckpt = os.path.join(out, "ckpt.pt")
    if attempt:  # a torchrun restart: resume from the checkpoint
        state = torch.load(ckpt)
        comm.all_gather({"step": state["step"]})
        print(json.dumps({"after": time.time()}), flush=True)
        comm.close()
        sys.exit(0)
    if comm.rank == 0:
        torch.save({"step": 0, "w": torch.zeros(1 << 18)}, ckpt)
    comm.synchronize()
    try:
        for step in range(10_000):
            if step == 50 and comm.rank == victim:
                with open(os.path.join(out, "killed"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_gather({"step": step, "loss": 0.5})
            time.sleep(0.02)
    except distcomm.DistCommError:
        if os.environ.get("TORCHELASTIC_RUN_ID"):
            raise  # torchrun: the agent restarts everyone
        comm = comm.shrink()
        comm.all_gather({"step": step})
        print(json.dumps({"after": time.time()}), flush=True)
        comm.close()
""")


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **extra}


def _shrink(work: Path, world: int) -> float:
    port = distcomm.free_port()
    store = serve_store(f"tcp://127.0.0.1:{port}", world, 120)
    procs = [subprocess.Popen([sys.executable, str(work / "job.py"), str(work), str(world - 1)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              env=_env({"RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                                        "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                        "MASTER_PORT": str(port), "DISTCOMM_STORE": "external"}))
             for r in range(world)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    del store
    return _recovery(work, outs)


def _restart(work: Path, world: int) -> float:
    port = distcomm.free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(port), str(work / "job.py"), str(work), str(world - 1)]
    out = subprocess.run(cmd, text=True, capture_output=True, timeout=300, env=_env({}))
    return _recovery(work, [out.stdout])


def _recovery(work: Path, outs: list[str]) -> float:
    killed = float((work / "killed").read_text())
    # (ranks that print at once may share a line of torchrun's output)
    after = [float(m) for out in outs for m in re.findall(r'\{"after": ([0-9.]+)\}', out)]
    if not after:
        raise RuntimeError("no rank completed a collective after the kill")
    return max(after) - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    rows = ["| world | shrink (distcomm) | torchrun restart from a checkpoint | restart / shrink |",
            "|---|---|---|---|"]
    for world in args.world:
        times: dict[str, list[float]] = {"shrink": [], "restart": []}
        for _ in range(args.reps):
            for name, run in (("shrink", _shrink), ("restart", _restart)):
                with tempfile.TemporaryDirectory() as d:
                    (Path(d) / "job.py").write_text(JOB)
                    times[name].append(run(Path(d), world))
        shrink, restart = statistics.median(times["shrink"]), statistics.median(times["restart"])
        rows.append(f"| {world} | {shrink:.2f} s | {restart:.2f} s | {restart / shrink:.1f}x |")
        print(rows[-1], flush=True)
    table = "\n".join(rows)
    publish(table, "recovery")


if __name__ == "__main__":
    main()
