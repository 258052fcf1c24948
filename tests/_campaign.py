"""The kill campaign: jobs whose ranks are killed (SIGKILL) at random points, the survivors shrinking
and admitting replacements, every collective's result checked exactly against the membership. One
step in eleven is a DDP step with Adam (torch's own allreduce on ``comm.group``), after which every
member's model and optimizer are checked identical; the state goes round after every shrink and admit.

A job is ``world`` processes of ``RANK_PROGRAM`` started as a job controller starts them, with the
store served by the driver (so any rank may die, rank 0 included). Victims die after a random
delay (inside a collective or between two), or when they enter ``shrink`` or ``admit``. The
driver starts a replacement for each victim at once; in some jobs the first replacement dies too
(while it waits to be let in, inside the admit, or just after), and is started again. Counted per
job: kills, hangs (a process still running at the bound), and wrong results or disagreements (a
survivor that exits non-zero, or survivors that end with different memberships).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import distcomm
from distcomm._launching.rendezvous import serve_store

from ._jobs import job_key_for

RANK_PROGRAM = textwrap.dedent("""
    import faulthandler, json, os, random, signal, sys, threading, time
    import torch
    from torch.nn.parallel import DistributedDataParallel
    import distcomm

    seed, steps, world = int(sys.argv[1]), int(sys.argv[2]), int(os.environ["WORLD_SIZE"])
    kill_after, kill_in = float(os.environ.get("KILL_AFTER", "-1")), os.environ.get("KILL_IN", "")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where a hung process stands: the driver asks
    faulthandler.enable(all_threads=True)  # and where each thread stood, in a process that aborts
    print(f"event: started at {time.time():.2f}", file=sys.stderr, flush=True)
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)
    waiting = threading.Timer(float(os.environ.get("KILL_WAITING", "1e9")), die)
    waiting.daemon = True  # (a replacement that dies while it waits to be let in, as it is, or just after)
    waiting.start()
    comm = distcomm.from_env(timeout=60)
    timer = threading.Timer(kill_after, die)
    if kill_after >= 0:
        timer.start()

    def first_member(comm):
        newcomers = set(comm.membership.admitted)
        return next(r for r, j in enumerate(comm.membership.job_ranks) if j not in newcomers)

    def run(comm, step):
        members, n, r = list(comm.membership.job_ranks), comm.world_size, comm.rank
        me, root = members[r], step % n
        kind = random.Random(seed * 1_000_003 + step).randrange(11)
        if kind == 0:
            assert comm.all_gather(me) == members
        elif kind == 1:
            assert comm.gather(me, dst=root) == (members if r == root else [])
        elif kind == 2:
            assert comm.broadcast(step if r == root else None, src=root) == step
        elif kind == 3:
            assert comm.scatter([m * step for m in members] if r == root else None, src=root) == me * step
        elif kind == 4:
            assert float(comm.all_reduce_dict({"x": torch.tensor(float(me))}, op="sum")["x"]) == sum(members)
        elif kind == 5:
            t = torch.full((3,), float(me))
            comm.all_reduce(t)
            assert t.tolist() == [float(sum(members))] * 3
        elif kind == 6:
            assert comm.all_to_all([(me, d) for d in range(n)]) == [(members[s], r) for s in range(n)]
        elif kind == 7:
            comm.synchronize()
        elif kind == 8 and n > 1:
            comm.send(me, dst=(r + 1) % n, tag=step % 7)
            assert comm.recv(src=(r - 1) % n, tag=step % 7) == members[(r - 1) % n]
        elif kind == 9:
            assert comm.reduce_object({me}, "union", dst=root) == (set(members) if r == root else None)
        elif kind == 10:  # a DDP step with Adam: torch's own allreduce on comm.group
            opt.zero_grad()
            ddp(torch.full((2, 4), float(me))).sum().backward()
            opt.step()
            comm.check_identical(model, opt)

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def agree_on_step(comm, step):
        src = first_member(comm)
        step = comm.broadcast(step if comm.rank == src else None, src=src)
        comm.sync_state(model, opt)  # (a newcomer's, and a half-applied DDP step's)
        global ddp
        ddp = DistributedDataParallel(model, process_group=comm.group)
        print(f"event: step {step} members {list(comm.membership.job_ranks)} at {time.time():.2f}", file=sys.stderr,
              flush=True)  # the history a hang is judged by
        return step

    step, shrinks, admits, deadline = 0, 0, 0, None
    agree = True  # the first call (a newcomer's: the members agree on the step with it, and hand it the state)
    while True:
        try:  # every collective inside, the step's agreement too: a rank may be lost in any of them
            if agree:
                step, agree = agree_on_step(comm, step), False
            if step < steps:
                run(comm, step)
                step += 1
                time.sleep(0.01)  # the rest of a step: kills land inside the job, not after it
            if step % 25 == 0 or step >= steps:
                if kill_in == "admit":
                    die()
                new = comm.admit()
                if new is not comm:
                    comm, admits, agree = new, admits + 1, True
                    continue
            if step >= steps:  # the end: wait a while for the replacements still coming (decided by one rank)
                deadline = deadline or time.monotonic() + 30
                src = first_member(comm)
                if comm.broadcast(comm.world_size == world or time.monotonic() > deadline, src=src):
                    break
                time.sleep(0.2)
        except Exception as e:
            if not distcomm.is_rank_loss(e):  # (DDP's allreduce raises torch's errors)
                raise
            if kill_in == "shrink":
                die()
            comm, shrinks, agree = comm.shrink(), shrinks + 1, True
    timer.cancel()  # a kill after the job's end would leave its replacement nothing to join
    waiting.cancel()
    final = comm.all_gather(list(comm.membership.job_ranks))
    assert all(f == final[0] for f in final), final
    print(json.dumps({"members": list(comm.membership.job_ranks), "shrinks": shrinks, "admits": admits,
                      "step": step}), flush=True)
    comm.close()
""")


@dataclasses.dataclass
class Outcome:
    kills: int = 0
    hangs: int = 0
    wrong: int = 0  # a survivor failed (a wrong result, an error) or survivors disagree
    jobs: int = 0
    details: list[str] = dataclasses.field(default_factory=list)

    def add(self, other: Outcome) -> None:
        self.kills += other.kills
        self.hangs += other.hangs
        self.wrong += other.wrong
        self.jobs += other.jobs
        self.details += other.details


def run_job(tmp: Path, world: int, seed: int, steps: int = 300, bound: float = 150.0) -> Outcome:
    """One job of ``world`` ranks with a random plan of kills; what happened."""
    rng = random.Random(seed)
    script = tmp / "rank.py"
    script.write_text(RANK_PROGRAM)
    port = distcomm.free_port()
    store = serve_store(f"tcp://127.0.0.1:{port}", world, bound)
    plan, doomed = _plan(rng, world), _replacement_plan(rng)
    latest = {r: _Process.start(script, f"rank {r}", r, world, port, seed, steps, plan.get(r, {}))
              for r in range(world)}
    everyone = list(latest.values())
    kills = 0
    deadline = time.monotonic() + bound
    try:
        while time.monotonic() < deadline and any(p.running() for p in everyone):
            for r, p in list(latest.items()):
                if p.popen.poll() == -signal.SIGKILL:  # started again at once, as a job controller would
                    kills += 1
                    name = f"{'replacement' if p.name.startswith('rank') else 'second replacement'} of {r}"
                    latest[r] = _Process.start(script, name, r, world, port, seed, steps, doomed)
                    everyone.append(latest[r])
                    doomed = {}
            time.sleep(0.05)
        hung = _stop_hung(everyone)
        outcome = _judge(everyone, hung, kills, seed, world)
        if outcome.hangs or outcome.wrong:
            outcome.details.append(f"seed {seed} world {world}: the job's store at the end:\n{_membership_keys(store)}")
        return outcome
    finally:
        for p in everyone:
            p.end()
        del store


@dataclasses.dataclass
class _Process:
    """One rank's process; its output goes to files (a pipe nobody reads until the end could fill
    and stop it)."""

    name: str
    popen: subprocess.Popen[bytes]
    out: Path
    err: Path

    @classmethod
    def start(cls, script: Path, name: str, rank: int, world: int, port: int, seed: int, steps: int,
              extra: dict[str, str]) -> _Process:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RANK": str(rank), "WORLD_SIZE": str(world),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "DISTCOMM_STORE": "external",
               "DISTCOMM_JOB_KEY": job_key_for(port), **extra}  # (the key, as a user gives it: replacements need it)
        stem = script.parent / name.replace(" ", "-")
        out, err = stem.with_suffix(".out"), stem.with_suffix(".err")
        with out.open("wb") as o, err.open("wb") as e:
            popen = subprocess.Popen([sys.executable, str(script), str(seed), str(steps)], env=env,
                                     cwd=script.parent, stdout=o, stderr=e)
        return cls(name, popen, out, err)

    def running(self) -> bool:
        return self.popen.poll() is None

    def end(self) -> None:
        if self.running():
            self.popen.kill()
        self.popen.wait(10)


def _stop_hung(everyone: list[_Process]) -> list[_Process]:
    """The processes still running at the bound, each made to write its threads' stacks (where it
    hung) and then ended."""
    hung = [p for p in everyone if p.running()]
    for p in hung:
        p.popen.send_signal(signal.SIGUSR1)
    time.sleep(1.0)
    for p in hung:
        p.end()
    return hung


def _plan(rng: random.Random, world: int) -> dict[int, dict[str, str]]:
    """Who dies, and when: one or two ranks after the same random delay (two at once), and often
    one more as it enters shrink() or admit()."""
    ranks = list(range(world))
    rng.shuffle(ranks)
    at = f"{rng.uniform(0.2, 2.5):.3f}"
    plan = {ranks[0]: {"KILL_AFTER": at}}
    if rng.random() < 0.5:
        plan[ranks[1]] = {"KILL_AFTER": at}
    if world > 3 and rng.random() < 0.6:
        plan[ranks[2]] = {"KILL_IN": rng.choice(["shrink", "admit"])}
    if world > 4:  # a second wave, once the first has been shrunk away
        plan[ranks[3]] = {"KILL_AFTER": f"{float(at) + rng.uniform(2.0, 4.0):.3f}"}
    return plan


def _replacement_plan(rng: random.Random) -> dict[str, str]:
    """Whether the job's first replacement dies too, and when: often while it waits to be let in,
    or inside the admit that lets it in (then it is started again)."""
    return {"KILL_WAITING": f"{rng.uniform(0.3, 3.0):.3f}"} if rng.random() < 0.3 else {}


def _judge(everyone: list[_Process], hung: list[_Process], kills: int, seed: int, world: int) -> Outcome:
    out = Outcome(kills=kills, jobs=1)
    finals = []
    for p in everyone:
        stderr = p.err.read_text(errors="replace")
        if p in hung:
            out.hangs += 1
            out.details.append(f"seed {seed} world {world}: {p.name} still running at the bound; it stood at:\n"
                               f"{_our_frames(stderr)}")
            continue
        if p.popen.returncode == -signal.SIGKILL:
            continue
        lines = [json.loads(line) for line in p.out.read_text().splitlines() if line.startswith("{")]
        if p.popen.returncode != 0 or not lines:
            out.wrong += 1
            said = _our_frames(stderr) if "hread 0x" in stderr else stderr[-1500:]  # (an abort dumps its threads)
            out.details.append(f"seed {seed} world {world}: {p.name} exited {p.popen.returncode} after saying "
                               f"{lines[-1:]}: {said}")
            continue
        finals.append(lines[-1]["members"])
    if len({json.dumps(f) for f in finals}) > 1:
        out.wrong += 1
        out.details.append(f"seed {seed} world {world}: survivors disagree: {finals}")
    if out.hangs or out.wrong:
        out.details.append(f"seed {seed} world {world}: every process's end:\n" + "\n".join(map(_end_of, everyone)))
    return out


def _membership_keys(store: object) -> str:
    """The store's rendezvous and membership keys, with their values (not the groups' own keys)."""
    keys = sorted(k for k in store.list_keys()  # type: ignore[attr-defined]
                  if "//" not in k and "/alive/" not in k and "/pid/" not in k and "/here/" not in k)
    return "\n".join(f"  {k} = {store.get(k).decode(errors='replace')[:80]}" for k in keys[:400])  # type: ignore[attr-defined]


def _end_of(p: _Process) -> str:
    """One process's exit code and its last steps, for the record of a job that went wrong."""
    events = [line[len("event: "):] for line in p.err.read_text(errors="replace").splitlines()
              if line.startswith("event: ")]
    last = p.err.stat().st_mtime
    return f"  {p.name}: exit {p.popen.returncode}, last output at {last:.2f}; " + " | ".join(events[-8:])


def _our_frames(stderr: str) -> str:
    """The stack dump's lines in distcomm and the rank program (torch's and the standard library's
    frames say little about where a job hung)."""
    dump = stderr[stderr.find("hread 0x"):] if "hread 0x" in stderr else stderr[-1500:]
    keep = [line for line in dump.splitlines() if "hread 0x" in line or "distcomm" in line or "rank.py" in line]
    events = [line for line in stderr.splitlines() if line.startswith("event: ")]
    return "\n".join([*events[-6:], *keep[:60]])
