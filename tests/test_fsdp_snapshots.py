"""Plain FSDP (one replica: a mesh with no "replicate" dimension) outlives a lost rank, under
``python -m distcomm run``: every rank snapshots its shards after each step (``comm.snapshot``), its
copy held by the next rank; when a rank is lost, the survivors wait in ``shrink()`` for the
replacement, and ``sync_state`` takes every rank back to the newest step all copies are held for.
The replayed steps see the same data (it depends only on the step and the rank), so the job ends
bit for bit as the same job without the kill. Two neighbours lost at once (a copy with its owner)
end the job saying why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import distcomm

from .test_hsdp_elastic import _lines
from .test_run_agent import _agent, _ended, _script

FSDP_JOB = """
    import hashlib, json, os, signal, sys, time
    import torch
    from torch.distributed.fsdp import fully_shard
    import distcomm

    victims, kill_at, steps, marker = set(json.loads(sys.argv[1])), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    comm = distcomm.from_env()
    world = comm.world_size
    mesh = comm.device_mesh((world,), ("shard",))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    progress, share = {"step": 0}, True

    def say(**what):
        print(json.dumps({"job_rank": comm.membership.job_ranks[comm.rank], "step": progress["step"], **what}),
              flush=True)

    def digest():
        h = hashlib.sha256()
        for p in model.parameters():
            h.update(p.detach().to_local().numpy().tobytes())
            for v in opt.state.get(p, {}).values():
                h.update((v.to_local() if hasattr(v, "to_local") else v).detach().numpy().tobytes())
        return h.hexdigest()

    while True:
        try:
            if share:
                comm.sync_state(model, opt, progress)
                share = False
                say(synced=True, members=list(comm.membership.job_ranks))
            if progress["step"] >= steps:
                break
            me = comm.membership.job_ranks[comm.rank]
            if me in victims and progress["step"] == kill_at and not os.path.exists(f"{marker}.{me}"):
                open(f"{marker}.{me}", "w").close()  # (its replacement finds it, and lives)
                os.kill(os.getpid(), signal.SIGKILL)
            # the data depends only on the step and the job rank: replayed steps see the same
            g = torch.Generator().manual_seed(1000 * progress["step"] + me)
            x = torch.randn(16, 8, generator=g)
            torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True).sin()).backward()
            opt.step()
            opt.zero_grad()
            progress["step"] += 1
            comm.snapshot(model, opt, progress)
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            try:
                comm, share = comm.shrink(timeout=120), True
            except distcomm.CommunicatorStateError as e:
                say(refused=str(e))
                sys.exit(3)
            say(shrunk=True, members=list(comm.membership.job_ranks))
    say(done=True, digest=digest(), members=list(comm.membership.job_ranks))
    comm.close()
"""


def _run(tmp_path: Path, nproc: int, victims: list[int], *, replacements: int, steps: int = 12,
         kill_at: int = 6) -> tuple[int, list[dict[str, Any]], str]:
    tmp_path.mkdir(exist_ok=True)
    job = _script(tmp_path, FSDP_JOB)
    extra = ("--replacements", str(replacements)) if replacements else ()
    agent = _agent("--nproc-per-node", str(nproc), *extra, job, json.dumps(victims), str(kill_at), str(steps),
                   str(tmp_path / "killed"))
    code, out, err = _ended(agent, timeout=240)
    return code, _lines(out), err


def _done(said: list[dict[str, Any]]) -> dict[int, str]:
    return {d["job_rank"]: d["digest"] for d in said if d.get("done")}


@pytest.mark.parametrize(("nproc", "victim"), [(2, 1), (3, 0)])
def test_a_lost_rank_is_restored_from_its_neighbours_copy_bit_for_bit(tmp_path: Path, nproc: int,
                                                                       victim: int) -> None:
    code, plain, err = _run(tmp_path / "plain", nproc, [], replacements=0)
    assert code == 0, err[-3000:]
    code, said, err = _run(tmp_path / "killed", nproc, [victim], replacements=1)
    assert code == 0, err[-3000:]
    restored = [d for d in said if d.get("synced") and d["step"] > 0]
    assert {d["job_rank"] for d in restored} == set(range(nproc)), said  # the survivors and the replacement
    back_to = {d["step"] for d in restored}
    assert len(back_to) == 1 and 0 < back_to.pop() <= 6, restored  # one snapshot step, at most the kill's
    print(f"went back to step {restored[0]['step']} (killed as it began step 6)")
    assert _done(said) == _done(plain) and len(_done(plain)) == nproc, (said, plain)


def test_two_neighbours_lost_at_once_end_the_job_saying_why(tmp_path: Path) -> None:
    code, said, err = _run(tmp_path, 3, [1, 2], replacements=0)
    assert code != 0
    refused = {d["job_rank"]: d["refused"] for d in said if "refused" in d}
    assert list(refused) == [0], (said, err[-3000:])
    assert "snapshots went with them" in refused[0] and "can't go on" in refused[0], refused


def test_the_restore_takes_the_newest_step_held_for_every_rank() -> None:
    from distcomm._elastic.restore import _plan

    # job rank 1 lost (its replacement holds nothing); rank 0 held its copies of steps 4 and 5 (6 was on its way)
    said: list[Any] = [(0, [5, 6], 1, [4, 5]), None, (2, [5, 6], 0, [5, 6])]
    assert _plan((0, 1, 2), said) == (5, {1: 0})
    with pytest.raises(distcomm.CommunicatorStateError, match="no snapshot step is held for every rank"):
        _plan((0, 1, 2), [(0, [5, 6], None, []), None, (2, [5, 6], 0, [5, 6])])


def test_copies_are_held_on_the_next_machine_where_there_are_several() -> None:
    from distcomm._elastic.snapshots import holder_of

    assert [holder_of(r, 4, 4) for r in range(4)] == [1, 2, 3, 0]  # one machine: the next rank
    assert [holder_of(r, 8, 4) for r in range(8)] == [4, 5, 6, 7, 0, 1, 2, 3]  # the same local rank, next machine
    assert [holder_of(r, 6, 4) for r in range(6)] == [1, 2, 3, 4, 5, 0]  # machines of unequal sizes: the next rank
