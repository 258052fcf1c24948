"""A real training job losing a rank: torch's DistributedDataParallel and Adam, default timeouts.

    python benchmarks/recovery_ddp.py [--world 4 8] [--reps 3]

The job: an MLP (about 0.3 M parameters) under DDP over the job's communicator, Adam, one step
every ~50 ms; at step 20 one rank kills itself (SIGKILL), writing the time just before. Two ways on:
- distcomm: the job runs under ``python -m distcomm run --replacements 1``; the survivors catch
  what DDP raises (``distcomm.is_rank_loss``), ``shrink()``, hand the state round (``sync_state``),
  rebuild DDP and go on; the lost rank is started again and let in by the members' ``admit()``.
- restart: the same job under ``torchrun --max-restarts 1``: the agent ends every worker and starts
  them all again; each loads the last checkpoint (written every step by rank 0) and goes on.
- torchft: the same model, data and Adam under torchft's DDP and lighthouse (``_torchft_job``),
  where it is installed (``make bench-recovery`` installs it in benchmarks/.deps).
- built first: the distcomm job again, its model and optimizer built before ``from_env()``.
Figures (medians over the repetitions): the time from the kill to the last survivor's next
completed step, and the stall on the step a replacement joins (that step's time, from the admit
that lets it in to the step's end, less the median step before the kill), worst over the members.
Prints a markdown table (and writes benchmarks/out/recovery_ddp.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import _torchft_job  # (run as a script: benchmarks/ is on the path)
from _jobs import job_env, results
from _report import publish

import distcomm

JOB = textwrap.dedent("""
    import json, os, signal, sys, time
    import torch
    from torch.nn.parallel import DistributedDataParallel
    import distcomm

    out, victim, steps = sys.argv[1], int(sys.argv[2]), 60
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    if os.environ.get("BUILD_FIRST"):  # a newcomer's start-up before it waits to be let in
        model, opt = build()
    comm = distcomm.from_env()  # default timeouts
    if not os.environ.get("BUILD_FIRST"):  # the usual order: start the job, then build the model
        model, opt = build()
    newcomer = bool(comm.membership.admitted)
    ckpt = os.path.join(out, "ckpt.pt")
    progress, share, log = {"step": 0}, True, {"done": [], "joined": []}
    if attempt:  # a torchrun restart: resume from the checkpoint
        state = torch.load(ckpt)
        model.load_state_dict(state["model"]), opt.load_state_dict(state["opt"])
        progress["step"] = state["step"]
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    while progress["step"] < steps:
        try:
            if share:
                comm.sync_state(model, opt, progress)
                ddp, share = DistributedDataParallel(model, process_group=comm.group), False
            me = comm.membership.job_ranks[comm.rank]
            if me == victim and progress["step"] == 20 and not newcomer and not attempt:
                with open(os.path.join(out, "killed"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            ddp(x).pow(2).mean().backward()
            opt.step()
            progress["step"] += 1
            log["done"].append(time.time())
            if comm.rank == 0 and os.environ.get("TORCHELASTIC_RUN_ID") and not os.environ.get("DISTCOMM_RUN"):
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": progress["step"]}, ckpt)
            time.sleep(0.05)  # the rest of a step
            started = time.time()
            new = comm.admit()
            if new is not comm:
                comm, share = new, True
                log["joined"].append(started)
        except Exception as e:
            if not distcomm.is_rank_loss(e) or (os.environ.get("TORCHELASTIC_RUN_ID")
                                                and not os.environ.get("DISTCOMM_RUN")):
                raise  # (torchrun: the agent restarts everyone)
            comm, share = comm.shrink(), True
    print("RESULT " + json.dumps({"newcomer": newcomer, **log}), flush=True)
    comm.close()
""")


def _distcomm(work: Path, world: int) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "distcomm", "run", "--nproc-per-node", str(world), "--replacements", "1",
           str(work / "job.py"), str(work), str(world - 1)]
    out = subprocess.run(cmd, text=True, capture_output=True, timeout=600, env=job_env({"DISTCOMM_RUN": "1"}))
    if out.returncode:
        raise RuntimeError(f"the distcomm job failed:\n{out.stderr[-3000:]}")
    return _figures(work, results(out.stdout))


def _distcomm_built_first(work: Path, world: int) -> tuple[float, float]:
    os.environ["BUILD_FIRST"] = "1"  # (read by the job: the model built before from_env())
    try:
        return _distcomm(work, world)
    finally:
        del os.environ["BUILD_FIRST"]


def _restart(work: Path, world: int) -> tuple[float, float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(distcomm.free_port()), str(work / "job.py"),
           str(work), str(world - 1)]
    out = subprocess.run(cmd, text=True, capture_output=True, timeout=600, env=job_env({}))
    if out.returncode:
        raise RuntimeError(f"the torchrun job failed:\n{out.stderr[-3000:]}")
    return _figures(work, results(out.stdout))


def _figures(work: Path, results: list[dict[str, Any]]) -> tuple[float, float]:
    """(kill to the last survivor's next completed step, the worst stall on the step a replacement joined)."""
    killed = float((work / "killed").read_text())
    members = [r for r in results if not r["newcomer"]]
    recovery = max(min(t for t in r["done"] if t > killed) for r in members) - killed
    stall = 0.0
    for r in (r for r in members if r["joined"]):  # (none in a restart)
        steps = list(zip(r["done"], r["done"][1:], strict=False))  # each step, from the one before it
        usual = statistics.median(b - a for a, b in steps if b < killed)
        for joined in (j for j in r["joined"] if j > killed):  # (torchft's: its first quorums too)
            stall = max(stall, next(b - a for a, b in steps if a < joined < b) - usual)
    return recovery, stall


def _torchft(work: Path, world: int) -> tuple[float, float]:
    return _figures(work, _torchft_job.run(work, world))


def _median(got: dict[str, list[tuple[float, float]]], name: str, which: int) -> str:
    return f"{statistics.median(r[which] for r in got[name]):.2f} s" if got.get(name) else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    ways = {"distcomm": _distcomm, "built first": _distcomm_built_first, "restart": _restart}
    if _torchft_job.available():
        ways["torchft"] = _torchft
    else:
        print(f"(torchft is not installed: {_torchft_job.VERSION} goes in benchmarks/.deps)", flush=True)
    rows = ["| world | kill to the next DDP step: distcomm (shrink) | torchft | torchrun restart from a checkpoint | "
            "stall on the step a replacement joins: distcomm, model built after `from_env()` | built before | "
            "torchft |", "|---|---|---|---|---|---|---|"]
    for world in args.world:
        got: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
        for _ in range(args.reps):
            for name, run in ways.items():
                with tempfile.TemporaryDirectory() as d:
                    (Path(d) / "job.py").write_text(JOB)
                    got[name].append(run(Path(d), world))
        cells = [("distcomm", 0), ("torchft", 0), ("restart", 0), ("distcomm", 1), ("built first", 1), ("torchft", 1)]
        rows.append(f"| {world} | " + " | ".join(_median(got, name, which) for name, which in cells) + " |")
        print(rows[-1], flush=True)
    publish("\n".join(rows), "recovery_ddp")


if __name__ == "__main__":
    main()
