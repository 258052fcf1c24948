"""A replacement is let in when it is ready: its ``from_env()`` returns once the members have seen it,
and it joins them at its first use, so its start-up (the model it builds) is off the members' path.

Ranks are real processes started as a job controller starts them (``_jobs``); rank 2 is killed
with SIGKILL, the survivors shrink, and the test starts its replacement."""

from __future__ import annotations

import json
import signal
from pathlib import Path

from ._jobs import ended, job

# DDP with Adam: job rank 2 dies at step 3; the replacement sleeps 3 s after from_env() (its start-up)
# before its first call. Each member logs its admits: (began, ended, let someone in).
JOB = """
    import json, os, signal, sys, time, torch
    from torch.nn.parallel import DistributedDataParallel
    import distcomm

    role = sys.argv[1]
    comm = distcomm.from_env(timeout=60)
    returned, before = time.time(), {}
    if role == "newcomer":  # what a script may read before its first use, without joining
        before = {"is_gloo": isinstance(comm, distcomm.GlooCommunicator), "name": type(comm).__name__,
                  "device": str(comm.device), "launcher": comm.launcher, "current": distcomm.current() is comm,
                  "plain": type(comm) is distcomm.GlooCommunicator}
        time.sleep(3.0)  # its start-up: the members step on meanwhile
    used = time.time()
    torch.manual_seed(0 if role == "member" else 1)  # (the newcomer's own start: sync_state replaces it)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    progress, share, admits = {"step": 0}, True, []
    while True:
        try:
            if share:
                comm.sync_state(model, opt, progress)
                ddp, share = DistributedDataParallel(model, process_group=comm.group), False
            if progress["step"] >= 600 or (progress["step"] >= 15 and comm.world_size == 3):
                break  # (decided once the state went round: every member alike)
            if comm.membership.job_ranks[comm.rank] == 2 and progress["step"] == 3 and role == "member":
                os.kill(os.getpid(), signal.SIGKILL)
            opt.zero_grad()
            ddp(x[comm.rank::comm.world_size]).pow(2).mean().backward()
            opt.step()
            progress["step"] += 1
            time.sleep(0.05)  # the rest of a step
            began = time.time()
            new = comm.admit()
            admits.append((began, time.time(), new is not comm))
            if new is not comm:
                comm, share = new, True
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            comm, share = comm.shrink(), True
            if comm.rank == 0:
                print(json.dumps({"shrunk": True}), flush=True)  # the test starts the replacement now
    comm.check_identical(model, opt, progress)  # (raises on every rank where one's state differs)
    m = comm.membership
    print(json.dumps({"members": m.job_ranks, "admitted": m.admitted, "returned": returned, "used": used,
                      "before": before, "plain": type(comm) is distcomm.GlooCommunicator, "admits": admits}),
          flush=True)
    comm.close()
"""


def test_a_replacement_is_let_in_at_its_first_use_while_the_members_step_on(tmp_path: Path) -> None:
    port, procs = job(tmp_path, JOB, 3, "member")
    assert procs[0].stdout is not None
    first = procs[0].stdout.readline()  # rank 0 says when the survivors have shrunk
    assert json.loads(first) == {"shrunk": True}, first
    _, newcomer = job(tmp_path, JOB, 3, "newcomer", ranks=[2], port=port)
    done = ended({**procs, 3: newcomer[2]})
    assert done[2][0] == -signal.SIGKILL, done[2]
    for r in (0, 1, 3):
        code, lines, err = done[r]
        assert code == 0 and lines, (r, code, err)  # check_identical passed: one state on every member
        assert lines[-1]["members"] == [0, 1, 2] and lines[-1]["admitted"] == [2] and lines[-1]["plain"], lines[-1]
    said = done[3][1][-1]
    assert said["before"] == {"is_gloo": True, "name": "GlooCommunicator", "device": "cpu", "launcher": "env",
                              "current": True, "plain": False}, said  # nothing read so far joined
    assert "first call came" not in done[3][2], done[3][2]  # it joined at its first call: nobody waited
    for r in (0, 1):
        admits = done[r][1][-1]["admits"]
        while_starting = [a for a in admits if said["returned"] < a[0] and a[1] < said["used"]]
        assert len(while_starting) >= 2 and not any(a[2] for a in while_starting), (r, said, admits)
        let_in = [a for a in admits if a[2]]
        assert len(let_in) == 1 and let_in[0][1] > said["used"], (r, said, admits)  # once it was ready
