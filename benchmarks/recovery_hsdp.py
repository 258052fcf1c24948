"""An HSDP training job losing a rank: FSDP2 over a 2 x 2 mesh (2 replicas, each sharded over 2 ranks), Adam.

    python benchmarks/recovery_hsdp.py [--reps 2]

The job: an MLP of about 1.6 M parameters (6 MiB; Adam's moments twice that), FSDP2 on each layer
and the whole, Adam, a pause of 30 ms per step beside the step's own work; at step 20 job rank 3
(replica 1's second shard) kills itself (SIGKILL), writing the time just before. Each job goes on
until 10 steps after the healed replica's first step. Three ways on:
- distcomm: ``python -m distcomm run --nproc-per-node 4 --replacements 1``, the mesh
  ``comm.device_mesh((2, 2), ("replicate", "shard"))`` (as examples/hsdp_train.py): replica 0 catches
  the loss (``distcomm.is_rank_loss``), ``shrink()``s to itself and steps on alone; job rank 2 waits
  in ``shrink()`` until the replacement makes replica 1 whole; the members' ``admit()`` lets the
  replica in at a step boundary and ``sync_state`` hands each its shards.
- torchft: its HSDP shape on gloo (``_torchft_hsdp_job``): each replica group its own torchrun (2
  ranks, ``--max-restarts 1``) with FSDP2 over the group's mesh, the gradient shards averaged across
  the groups by a Manager (FSDP's all-reduce hook), ``OptimizerWrapper``, a lighthouse (defaults);
  the killed rank's torchrun restarts its group, which heals from the other at a quorum.
- restart: the distcomm job under ``torchrun --max-restarts 1``: every worker ended and started
  again; each loads its last per-rank checkpoint (its shards and Adam's, written every step).
Figures (medians over the repetitions): (a) the kill to the healthy replica's next completed step
(the later of its two ranks); (b) the kill to the healed replica's first completed step (the later
of its two ranks: the replacement and its peer, or the restarted group); (c) the stall on the step
the replica joins: that step's time on the healthy replica's ranks (from the step before's end, so
the admit or quorum that lets the replica in counts) less their median step before the kill, the
worse of the two. A torchrun restart restarts every rank: its (a) and (b) are one wait, no (c).
Prints a markdown table (and writes benchmarks/out/recovery_hsdp.md).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import _torchft_hsdp_job  # (run as a script: benchmarks/ is on the path)
from _jobs import job_env, results
from _report import publish

import distcomm

KILL_STEP, PAUSE = 20, 0.03

# (shared with the torchft job: the model, the data, the kill, the stop, the log)
JOB = textwrap.dedent("""
    import glob, json, os, signal, sys, time
    import torch
    from torch.distributed.fsdp import fully_shard
    import distcomm

    out, kill_step, pause = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    restarts = bool(os.environ.get("TORCHELASTIC_RUN_ID")) and not os.environ.get("DISTCOMM_RUN")  # (torchrun)
    comm = distcomm.from_env()  # default timeouts
    mesh = comm.device_mesh((2, 2), ("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                                torch.nn.ReLU(), torch.nn.Linear(1024, 256))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-3)
    me = comm.membership.job_ranks[comm.rank]  # (a replacement joins the members here, its model built)
    first_process = me not in comm.membership.admitted and not attempt  # (not a replacement, not restarted)
    progress, share = {"step": 0}, True

    def ckpt(step, rank=me):
        return os.path.join(out, f"ckpt-{rank}-{step}.pt")

    if attempt:  # a torchrun restart: the newest step every rank saved
        steps = [int(p.rsplit("-", 1)[1][:-3]) for p in glob.glob(os.path.join(out, f"ckpt-{me}-*.pt"))]
        step = max(s for s in steps if all(os.path.exists(ckpt(s, r)) for r in range(4)))
        state = torch.load(ckpt(step))
        with torch.no_grad():
            for p, w, moments in zip(params, state["model"], state["opt"]):
                p.to_local().copy_(w)
                for k, v in moments.items():
                    opt.state[p][k] = v if k == "step" else torch.zeros_like(p)
                    if k != "step":
                        opt.state[p][k].to_local().copy_(v)
        progress["step"] = step

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    x = torch.randn(256, 256, generator=torch.Generator().manual_seed(1))
    log, stop = {"done": [], "joined": []}, 300
    while True:
        try:
            if share:
                comm.sync_state(model, opt, progress)
                share = False
            if stop == 300 and os.path.exists(os.path.join(out, "healed")):
                stop = int(open(os.path.join(out, "healed")).read()) + 10
            if progress["step"] >= stop:
                break
            if me == 3 and progress["step"] == kill_step and first_process:
                with open(os.path.join(out, "killed"), "w") as f:
                    f.write(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)
            model(x[me::4]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            progress["step"] += 1
            log["done"].append((progress["step"], time.time()))
            if me // 2 == 1 and progress["step"] > kill_step and not os.path.exists(os.path.join(out, "healed")):
                with open(os.path.join(out, f"healed.{me}"), "w") as f:
                    f.write(str(progress["step"]))
                os.replace(os.path.join(out, f"healed.{me}"), os.path.join(out, "healed"))
            if restarts:  # this rank's shards, every step (the last two kept)
                torch.save({"model": [local(p).detach() for p in params],
                            "opt": [{k: local(v) for k, v in opt.state[p].items()} for p in params]},
                           ckpt(progress["step"]) + ".tmp")
                os.replace(ckpt(progress["step"]) + ".tmp", ckpt(progress["step"]))
                if os.path.exists(ckpt(progress["step"] - 2)):
                    os.remove(ckpt(progress["step"] - 2))
            time.sleep(pause)  # the rest of a step
            started = time.time()
            new = comm.admit()  # (the replica made whole comes in here)
            if new is not comm:
                comm, share = new, True
                log["joined"].append(started)
        except Exception as e:
            if not distcomm.is_rank_loss(e) or restarts:
                raise  # (torchrun: the agent restarts everyone)
            comm, share = comm.shrink(), True
    print("RESULT " + json.dumps({"replica": me // 2, "newcomer": not first_process, **log}), flush=True)
    comm.close()
""")


def _args(work: Path) -> list[str]:
    return [str(work / "job.py"), str(work), str(KILL_STEP), str(PAUSE)]


def _distcomm(work: Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "distcomm", "run", "--nproc-per-node", "4", "--replacements", "1", *_args(work)]
    out = subprocess.run(cmd, text=True, capture_output=True, timeout=300, env=job_env({"DISTCOMM_RUN": "1"}))
    if out.returncode:
        raise RuntimeError(f"the distcomm job failed:\n{out.stderr[-3000:]}")
    return results(out.stdout)


def _restart(work: Path) -> list[dict[str, Any]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--max-restarts", "1",
           "--master-addr", "127.0.0.1", "--master-port", str(distcomm.free_port()), *_args(work)]
    out = subprocess.run(cmd, text=True, capture_output=True, timeout=300, env=job_env({}))
    if out.returncode:
        raise RuntimeError(f"the torchrun job failed:\n{out.stderr[-3000:]}")
    return results(out.stdout)


def _torchft(work: Path) -> list[dict[str, Any]]:
    return _torchft_hsdp_job.run(work, KILL_STEP, PAUSE)


def _figures(work: Path, results: list[dict[str, Any]]) -> dict[str, float]:
    """The step before the kill, (a), (b) and (c), in seconds (module doc)."""
    killed = float((work / "killed").read_text())
    if sorted(r["replica"] for r in results) != [0, 0, 1, 1]:
        raise RuntimeError(f"not every rank reported: {results}")

    def next_step(r: dict[str, Any]) -> float:  # (the first step after the one the kill cut short)
        return min(t for step, t in r["done"] if step > KILL_STEP) - killed

    got = {"a": max(next_step(r) for r in results if r["replica"] == 0),
           "b": max(next_step(r) for r in results if r["replica"] == 1)}
    healthy = [r for r in results if r["replica"] == 0 and not r["newcomer"]]  # (none in a restart)
    usual, stall = [], []
    for r in healthy:
        ends = [t for _, t in r["done"]]
        steps = list(itertools.pairwise(ends))  # each step, from the end of the one before
        usual.append(statistics.median(b - a for a, b in steps if b < killed))
        for joined in (j for j in r["joined"] if j > killed):  # (torchft's: its first quorums too)
            stall.append(next(b - a for a, b in steps if a < joined < b) - usual[-1])
    if usual:
        got["usual"] = max(usual)
    if stall:
        got["c"] = max(stall)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=2)
    args = parser.parse_args()
    ways = {"distcomm": _distcomm, "restart": _restart}
    why = _torchft_hsdp_job.available()
    if why is None:
        ways["torchft"] = _torchft
    else:
        print(f"(torchft does not import: {why}; `make bench-recovery` installs it in benchmarks/.deps)", flush=True)
    got: dict[str, list[dict[str, float]]] = {name: [] for name in ways}
    for _ in range(args.reps):
        for name, run in ways.items():
            with tempfile.TemporaryDirectory() as d:
                (Path(d) / "job.py").write_text(JOB)
                got[name].append(_figures(Path(d), run(Path(d))))
                print(f"{name}: " + ", ".join(f"{k} {v:.2f} s" for k, v in got[name][-1].items()), flush=True)

    def cell(name: str, key: str, ms: bool = False) -> str:
        values = [g[key] for g in got.get(name, []) if key in g]
        if not values:
            return "-"
        median = statistics.median(values)
        return f"{median * 1e3:.0f} ms" if ms else f"{median:.2f} s"

    names = {"distcomm": "distcomm: `shrink()`, `--replacements 1`, `admit()` + `sync_state`",
             "torchft": "torchft: a torchrun per replica group, Manager + lighthouse (defaults), healing over HTTP",
             "restart": "torchrun `--max-restarts 1`, every rank from its checkpoint"}
    rows = [f"| 2x2 HSDP (FSDP2, Adam), rank 3 killed at step {KILL_STEP}; medians of {args.reps} | "
            "step before the kill | (a) kill to the healthy replica's next step | "
            "(b) kill to the healed replica's first step | (c) stall on the step the replica joins |",
            "|---|---|---|---|---|"]
    for name in ("distcomm", "torchft", "restart"):
        if name in got:
            rows.append(f"| {names[name]} | {cell(name, 'usual', ms=True)} | {cell(name, 'a')} | {cell(name, 'b')} | "
                        f"{cell(name, 'c')} |")
        else:
            rows.append(f"| {names[name]} | not run: torchft does not import ({why}) | - | - | - |")
    publish("\n".join(rows), "recovery_hsdp")


if __name__ == "__main__":
    main()
