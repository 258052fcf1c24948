"""HSDP (FSDP2 over ``comm.device_mesh``) outlives a lost rank, under ``python -m distcomm run``: the
replica is the unit of failure. The other replica steps on, with the gradient averaged over the
replicas left; the lost rank's replica peer waits in ``shrink()`` until the replacement makes the
replica whole; ``admit()`` lets both in, and ``sync_state`` hands each its own shards. A loss that
leaves no replica whole fails every survivor, saying the job can't go on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from .test_run_agent import _agent, _ended, _script

HSDP_JOB = """
    import json, os, signal, sys, time
    import torch
    from torch.distributed.fsdp import fully_shard
    import distcomm

    shape, victims, steps = tuple(json.loads(sys.argv[1])), set(json.loads(sys.argv[2])), int(sys.argv[3])
    slow = os.environ.get("SLOW_REPLACEMENT")  # (a file: once there, a replacement takes a minute to start)
    if slow and os.path.exists(slow):
        time.sleep(60)
    handshake = os.environ.get("DIE_IN_HANDSHAKE")  # (a directory: the first replacement dies as it is let in)
    if handshake and os.path.exists(handshake + "/killed") and not os.path.exists(handshake + "/died"):
        import distcomm._launching.start as start

        def dying(*args, **kwargs):  # (the members' new group is made; the key not yet proven over it)
            open(handshake + "/died", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)

        start.prove_members = dying
    member_dies = os.environ.get("MEMBER_DIES_AS_LET_IN")  # ("handshake" or "split", a directory)
    if member_dies and os.environ["RANK"] == "0":  # (job rank 0 dies there as the broken replica comes back)
        import distcomm._launching.start as start, distcomm._mesh as meshes
        where, marks = member_dies.split(":", 1)
        module, name = {"handshake": (start, "prove_members"), "split": (meshes, "_lines")}[where]
        real = getattr(module, name)

        def dies_as_let_in(*args, **kwargs):
            size = len(args[2]) if where == "handshake" else args[0].world_size  # (the admit's: the whole job)
            if (size == shape[0] * shape[1] and os.path.exists(marks + "/killed")
                    and not os.path.exists(marks + "/member died")):
                open(marks + "/member died", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)

        setattr(module, name, dies_as_let_in)
    comm = distcomm.from_env()
    mesh = comm.device_mesh(shape, ("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    print(json.dumps({"built": True, "joined": "first use" not in repr(comm)}), flush=True)  # (a replacement: not yet)
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(0))
    y = x.sum(1, keepdim=True)
    progress, share, events = {"step": 0}, True, []
    original = comm.membership.job_ranks[comm.rank] not in comm.membership.admitted
    whole = os.environ.get("EXPECT_WHOLE") == "1"  # (steps on past `steps` until the replica is back)

    def expected_grads(n):
        # the mean over the membership's ranks of each rank's gradient, on one unsharded model
        with torch.no_grad():
            for p, q in zip(model.parameters(), plain.parameters()):
                q.copy_(p.full_tensor())
        plain.zero_grad()
        for r in range(n):
            (torch.nn.functional.mse_loss(plain(x[r::n]), y[r::n]) / n).backward()
        return [q.grad.clone() for q in plain.parameters()]

    def say(**what):
        print(json.dumps({"job_rank": comm.membership.job_ranks[comm.rank], "step": progress["step"], **what}),
              flush=True)

    worst = 0.0
    while True:
        try:
            if share:
                comm.sync_state(model, opt, progress)
                share = False
            back = comm.world_size == shape[0] * shape[1]
            if progress["step"] >= steps and (not whole or back or progress["step"] >= 50 * steps):
                break  # (the replica back first, however slowly the replacement starts: the same on every rank)
            me = comm.membership.job_ranks[comm.rank]
            if me in victims and progress["step"] == 5 and original:
                if slow:
                    open(slow, "w").close()
                if handshake or member_dies:
                    open((handshake or member_dies.split(":", 1)[1]) + "/killed", "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            n, r = comm.world_size, comm.rank
            want = expected_grads(n)
            torch.nn.functional.mse_loss(model(x[r::n]), y[r::n]).backward()
            for p, w in zip(model.parameters(), want):
                worst = max(worst, (p.grad.full_tensor() - w).abs().max().item())
            opt.step()
            opt.zero_grad()
            progress["step"] += 1
            time.sleep(0.05)
            new = comm.admit()
            if new is not comm:
                comm, share = new, True
                say(admitted=list(comm.membership.admitted), members=list(comm.membership.job_ranks))
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            t = time.monotonic()
            try:
                comm, share = comm.shrink(), True
            except distcomm.CommunicatorStateError as e:
                say(refused=str(e))
                sys.exit(3)
            say(shrink_seconds=time.monotonic() - t, members=list(comm.membership.job_ranks))
    comm.check_identical(model, opt)
    shards = [p.to_local().detach().flatten().tolist() for p in model.parameters()]
    say(done=True, members=list(comm.membership.job_ranks), worst_grad_error=worst, shards=shards,
        local_size=comm.local_size)
    comm.close()
"""


def _lines(text: str) -> list[dict[str, Any]]:
    """The JSON lines the workers printed (``[rankN]: {...}``), in order."""
    out = []
    for line in text.splitlines():
        body = line.partition("]: ")[2]
        if body.startswith("{"):
            out.append(json.loads(body))
    return out


def test_the_other_replica_steps_on_and_the_lost_one_comes_back_whole(tmp_path: Path) -> None:
    job = _script(tmp_path, HSDP_JOB)
    agent = _agent("--nproc-per-node", "4", "--replacements", "1", job, "[2, 2]", "[3]", "30",
                   env={"EXPECT_WHOLE": "1"})
    code, out, err = _ended(agent, timeout=240)
    assert code == 0, err[-3000:]
    said = _lines(out)
    shrinks = {d["job_rank"]: d for d in said if "shrink_seconds" in d}
    assert shrinks[0]["members"] == shrinks[1]["members"] == [0, 1], shrinks  # the healthy replica went on alone
    assert shrinks[2]["members"] == [0, 1, 2, 3], shrinks  # its peer waited until its replica was whole again
    admits = [d for d in said if "admitted" in d]
    assert {d["job_rank"] for d in admits} == {0, 1} and all(d["admitted"] == [2, 3] for d in admits), admits
    assert shrinks[2]["step"] < admits[0]["step"], (shrinks, admits)  # the healthy replica stepped meanwhile
    built = [d["joined"] for d in said if "built" in d]  # the replacement built FSDP over the mesh, then joined
    assert sorted(built) == [False, True, True, True, True], built
    done = {d["job_rank"]: d for d in said if d.get("done")}
    assert sorted(done) == [0, 1, 2, 3] and all(d["members"] == [0, 1, 2, 3] for d in done.values())
    assert len({d["step"] for d in done.values()}) == 1 and done[0]["step"] >= 30, done
    assert all(d["local_size"] == 4 for d in done.values()), done  # the replacement too is on this machine
    # the replicas agree, bit for bit
    assert done[0]["shards"] == done[2]["shards"] and done[1]["shards"] == done[3]["shards"]
    assert done[0]["shards"] != done[1]["shards"]
    # every step's gradient, with 2 replicas and with 1, was the mean over the membership's ranks
    assert all(d["worst_grad_error"] < 1e-5 for d in done.values()), done


def test_a_replacement_lost_as_its_replica_is_let_in_leaves_the_replica_waiting_again(tmp_path: Path) -> None:
    """The replacement dies after the new membership's group is made, before the key is proven over
    it: the survivors re-form without it, and that membership's replica 1 isn't whole, so its other
    rank waits again while replica 0 steps on; the next replacement makes replica 1 whole."""
    job = _script(tmp_path, HSDP_JOB)
    agent = _agent("--nproc-per-node", "4", "--replacements", "2", job, "[2, 2]", "[3]", "30",
                   env={"EXPECT_WHOLE": "1", "DIE_IN_HANDSHAKE": str(tmp_path)})
    code, out, err = _ended(agent, timeout=300)
    assert code == 0, err[-3000:]
    assert (tmp_path / "died").exists(), err[-3000:]  # (the first replacement did die in the handshake)
    said = _lines(out)
    shrinks = [d for d in said if "shrink_seconds" in d]
    assert all(d["members"] in ([0, 1], [0, 1, 2, 3]) for d in shrinks), shrinks  # never a broken replica
    done = {d["job_rank"]: d for d in said if d.get("done")}
    assert sorted(done) == [0, 1, 2, 3] and all(d["members"] == [0, 1, 2, 3] for d in done.values()), done
    assert done[0]["shards"] == done[2]["shards"] and done[1]["shards"] == done[3]["shards"]
    assert all(d["worst_grad_error"] < 1e-5 for d in done.values()), done


@pytest.mark.slow
@pytest.mark.parametrize("where", ["handshake", "split"])
def test_a_member_lost_as_a_replica_is_let_in_leaves_the_replacement_to_shrink_with_the_members(
        tmp_path: Path, where: str) -> None:
    """A 3 x 2 mesh loses job rank 5; as its replacement is let in, job rank 0 dies: in the key
    handshake (the membership forms without it, and replica 0 isn't whole) or in the mesh's splits
    (after the membership formed). The replacement's first call raises a rank loss, and its
    ``shrink()`` meets the members': replicas 1 and 2 step on, and the next replacement brings
    replica 0 back."""
    job = _script(tmp_path, HSDP_JOB)
    agent = _agent("--nproc-per-node", "6", "--replacements", "2", job, "[3, 2]", "[5]", "30",
                   env={"EXPECT_WHOLE": "1", "MEMBER_DIES_AS_LET_IN": f"{where}:{tmp_path}"})
    code, out, err = _ended(agent, timeout=540)
    assert code == 0, err[-3000:]
    assert (tmp_path / "member died").exists(), err[-3000:]
    said = _lines(out)
    assert any(d.get("job_rank") == 5 and "shrink_seconds" in d for d in said), said  # (the replacement shrank)
    done = {d["job_rank"]: d for d in said if d.get("done")}
    assert sorted(done) == list(range(6)) and all(d["members"] == list(range(6)) for d in done.values()), done
    assert done[0]["shards"] == done[2]["shards"] == done[4]["shards"], done
    assert done[1]["shards"] == done[3]["shards"] == done[5]["shards"], done
    assert all(d["worst_grad_error"] < 1e-5 for d in done.values()), done


def test_a_loss_in_every_replica_ends_the_job_saying_why(tmp_path: Path) -> None:
    job = _script(tmp_path, HSDP_JOB)
    code, out, err = _ended(_agent("--nproc-per-node", "4", job, "[2, 2]", "[1, 3]", "30"), timeout=180)
    assert code != 0
    refused = {d["job_rank"]: d["refused"] for d in _lines(out) if "refused" in d}
    assert sorted(refused) == [0, 2], (refused, err[-3000:])
    assert all("no replica of the job's mesh (2, 2)" in text and "can't go on" in text for text in refused.values())


def test_a_mesh_of_one_replica_cannot_lose_a_rank(tmp_path: Path) -> None:
    job = _script(tmp_path, HSDP_JOB)
    code, out, err = _ended(_agent("--nproc-per-node", "2", job, "[1, 2]", "[1]", "30"), timeout=180)
    assert code != 0
    refused = {d["job_rank"]: d["refused"] for d in _lines(out) if "refused" in d}
    assert list(refused) == [0] and "lost job rank(s) [1]" in refused[0], (refused, err[-3000:])


def test_a_replica_still_broken_when_the_job_ends_is_let_go(tmp_path: Path) -> None:
    """The healthy replica finishes before the replacement is up: the lost rank's peer, waiting in
    shrink() for its replica to be whole, and the replacement are ended by the agent, and the job
    counts as finished (not a hang until the timeout)."""
    job = _script(tmp_path, HSDP_JOB)
    agent = _agent("--nproc-per-node", "4", "--replacements", "1", "--term-grace", "3", job, "[2, 2]", "[3]", "12",
                   env={"SLOW_REPLACEMENT": str(tmp_path / "slow")})
    code, out, err = _ended(agent, timeout=150)
    done = sorted(d["job_rank"] for d in _lines(out) if d.get("done"))
    assert done == [0, 1], (done, err[-3000:])
    assert "rank 2 (pid" in err and "waited for its replica to be whole again, and was ended: the others had ended" \
        in err, err[-3000:]
    assert "started again, was never admitted: the others had ended" in err, err[-3000:]
    assert code == 0, err[-3000:]
