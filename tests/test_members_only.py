"""Members only: a job's key, the membership records signed with it, the proof each member of a
new group gives the others, and state handed over through the safe loader. Tried as an outsider
would: a process that knows the store's port and nothing else (see docs/trust-model.md)."""

from __future__ import annotations

import datetime
import functools
import json
import os
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import distcomm
from distcomm._launching.agent import Job, worker_env
from distcomm._launching.rendezvous import serve_store
from distcomm._trust.key import JobKey, job_key
from distcomm._trust.records import Records

from . import _forked
from ._jobs import WAIT, ended, job
from .test_cli import ROOT, cli

_c10d: Any = torch._C._distributed_c10d


def _store() -> Any:
    return _c10d.TCPStore("127.0.0.1", 0, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False)


# ---------------------------------------------------------------- the key
def test_a_key_is_read_from_the_environment_or_an_owner_only_file(tmp_path: Path) -> None:
    assert job_key({}) is None
    assert "hidden text" not in repr(job_key({"DISTCOMM_JOB_KEY": "a hidden text of 16+"}))
    with pytest.raises(ValueError, match="has 5 characters; it needs 16 or more"):
        job_key({"DISTCOMM_JOB_KEY": "short"})
    path = tmp_path / "key"
    path.write_text("a key kept in a file\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match=r"can be read or written by others \(mode 644\); .* chmod 600"):
        job_key({"DISTCOMM_JOB_KEY_FILE": str(path)})
    path.chmod(0o600)
    from_file = job_key({"DISTCOMM_JOB_KEY_FILE": str(path)})
    assert from_file is not None and from_file.mac(b"x") == JobKey(b"a key kept in a file").mac(b"x")
    with pytest.raises(ValueError, match="both DISTCOMM_JOB_KEY and DISTCOMM_JOB_KEY_FILE"):
        job_key({"DISTCOMM_JOB_KEY_FILE": str(path), "DISTCOMM_JOB_KEY": "another key of 16+"})
    with pytest.raises(ValueError, match="can't read the job's key"):
        job_key({"DISTCOMM_JOB_KEY_FILE": str(tmp_path / "none")})


# ---------------------------------------------------------------- signed records
def test_a_record_written_without_the_key_or_copied_elsewhere_reads_as_none_and_is_named_once() -> None:
    raw = _store()
    key = JobKey(b"the job's own key, 16+")
    job = Records(_c10d.PrefixStore("distcomm/j", raw), key, "distcomm/j/")
    job.set("epoch-1/members", "0,1,2")
    assert job.read("epoch-1/members") == b"0,1,2" and job.check(["epoch-1/members"])
    raw.set("distcomm/j/epoch-1/broken", b"shrink")  # an outsider's mark
    raw.set("distcomm/j/epoch-2/members", raw.get("distcomm/j/epoch-1/members"))  # a genuine record, replayed
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert job.read("epoch-1/broken") is None and not job.check(["epoch-1/broken"])
        assert job.read("epoch-1/broken") is None
        assert job.read("epoch-2/members") is None
    named = [str(w.message) for w in seen]
    assert len(named) == 2 and "distcomm/j/epoch-1/broken" in named[0] and "not written with the job's key" in named[0]
    # a claim (compare-and-set on none) takes a slot an outsider filled first; one that holds a genuine value keeps it
    raw.set("distcomm/j/epoch-1/successor", b"shrink")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert job.compare_set("epoch-1/successor", "", "admit:epoch-2") == b"admit:epoch-2"
    assert job.compare_set("epoch-1/successor", "", "shrink") == b"admit:epoch-2"
    job.set("epoch-1/place", "")  # a place freed (an empty record) is taken again, as in the store itself
    assert job.compare_set("epoch-1/place", "", "token") == b"token"
    # signed list entries: a forged pid among them is left out
    job.append_entry("epoch-1/pids/m", "0:100")
    raw.append("distcomm/j/epoch-1/pids/m", b"1:1#00,")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert job.entries("epoch-1/pids/m") == ["0:100"]
    with pytest.raises(KeyError, match="no record distcomm/j/epoch-1/nothing"):
        job.get("epoch-1/nothing")


def test_a_round_counted_complete_by_an_outsider_waits_for_every_rank_place() -> None:
    """The store counts the places taken, but anyone can move a count: an outsider's +1 must not let
    rank 0 call a round of two complete alone."""
    from concurrent.futures import ThreadPoolExecutor

    from distcomm._launching.rendezvous import meet

    server = _store()
    server.add("distcomm/s/round-0/count", 1)
    key = JobKey(b"the job's own key, 16+")
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(meet, "127.0.0.1", server.port, 0, 2, 30.0, scope="s", hosted=False, key=key)
        time.sleep(1.0)
        assert not first.done(), "rank 0 met a round of 2 alone"
        second = pool.submit(meet, "127.0.0.1", server.port, 1, 2, 30.0, scope="s", hosted=False, key=key)
        seats = [first.result(30), second.result(30)]
    assert [(s.epoch, s.members) for s in seats] == [("round-0", (0, 1))] * 2


def test_a_newcomer_comes_in_only_over_a_ticket_of_the_members_own() -> None:
    """A place in the open round, signed (as one copied from an earlier job with the same key would
    be), is not enough: the newcomer proves the key over the ticket of a membership the members were
    in (a digest of their fresh nonces); a proof over an earlier job's ticket, or unsigned, is not one."""
    from distcomm._elastic.membership import remember_let_in, waiting_newcomers
    from distcomm._launching.rendezvous import TICKET, Seat, prove_to_members
    from distcomm._trust.handshake import remember_ticket

    raw = _store()
    job = Records(_c10d.PrefixStore("distcomm/s", raw), JobKey(b"the job's own key, 16+"), "distcomm/s/")
    job.add("round", 1)
    job.set("round-1/world", "3")
    token = "old host pid 7 00ff"
    job.set("round-1/rank/2", token)  # a newcomer's place (or a copy of an earlier job's)
    seat = Seat(job, "epoch-3-abcd", 0, (0, 1), "me", "here", False)
    job.set(f"round-1/proof/2/{token}", "epoch-3-abcd:an earlier job's ticket")
    assert waiting_newcomers(seat, (0, 1), {})[1] == {}
    remember_ticket("epoch-3-abcd:0123456789abcdef01234567")  # (what this process's group formed with)
    job.set(TICKET, "epoch-3-abcd:0123456789abcdef01234567")
    raw.set(f"distcomm/s/round-1/proof/2/{token}", b"epoch-3-abcd:0123456789abcdef01234567")  # unsigned
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert waiting_newcomers(seat, (0, 1), {})[1] == {}
    prove_to_members(job, job.under("round-1"), 2, token, b"")  # the key holder's proof, over the ticket
    assert waiting_newcomers(seat, (0, 1), {})[1] == {2: token}
    # once let in, its membership's members remember it: its place written back into the round (the
    # signed bytes replayed after the place was freed) lets no ghost in again
    job.set("epoch-4-beef/token/2", token)
    remember_let_in(Seat(job, "epoch-4-beef", 0, (0, 1, 2), "me", "here", False, admitted=(2,)))
    assert waiting_newcomers(seat, (0, 1), {})[1] == {}


# ---------------------------------------------------------------- the state's hand-over
def test_the_safe_loader_carries_a_models_state_dict_and_only_its_metadata() -> None:
    safe = distcomm.SafeSerializer()
    big = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256), torch.nn.Linear(256, 64))
    adam = torch.optim.Adam(big.parameters())
    big(torch.ones(2, 256)).sum().backward()
    adam.step()  # its tensors travel out of band: charged against the bytes received with them
    segments = distcomm.PickleSerializer().dumps([big.state_dict(), adam.state_dict()])
    assert len(segments) > 4
    assert safe.loads([memoryview(s) for s in segments])[1]["state"].keys() == adam.state_dict()["state"].keys()
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    state = safe.loads([memoryview(s) for s in safe.dumps(model.state_dict())])
    assert state._metadata == model.state_dict()._metadata
    torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).load_state_dict(state)
    steering = model.state_dict()
    steering._metadata[""]["assign_to_params_buffers"] = True  # would make load_state_dict replace the parameters
    with pytest.raises(distcomm.UnsafePayloadError, match="each module's version"):
        safe.loads([memoryview(s) for s in safe.dumps(steering)])
    odd = __import__("collections").OrderedDict(a=1)
    odd.__dict__["other"] = 1  # any other attribute of an OrderedDict: refused by name
    with pytest.raises(distcomm.UnsafePayloadError, match="only a state dict's _metadata"):
        safe.loads([memoryview(s) for s in safe.dumps(odd)])


class RunsCode:
    """What a hostile member puts in its state: loading its pickle runs code (writes a marker)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return exec, (f"open({self.marker!r}, 'w').write(str(__import__('os').getpid()))",)


def _hostile_source(comm: distcomm.Communicator, marker: str) -> str:
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(comm.rank)  # (states differ: rank 1 receives rank 0's)
    progress: dict[str, Any] = {"step": comm.rank, **({"evil": RunsCode(marker)} if comm.rank == 0 else {})}
    try:
        comm.sync_state(model, progress)
    except distcomm.SerializationError as e:
        return str(e)
    return "returned"


def test_a_member_can_send_wrong_numbers_through_sync_state_but_never_code(tmp_path: Path) -> None:
    marker = str(tmp_path / "ran")
    said = distcomm.testing.spawn(functools.partial(_hostile_source, marker=marker), 2, timeout=WAIT)
    assert not os.path.exists(marker)
    assert said[0] == said[1] and "rank(s) [1] could not send or load the state rank 0 holds" in said[0], said
    assert "UnsafePayloadError" in said[0] and "builtins.exec" in said[0], said


def _sync_with_adam(comm: distcomm.Communicator) -> list[float]:
    torch.manual_seed(comm.rank)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    progress = {"step": 7 if comm.rank == 0 else 0, "seen": ["a", "b"]}
    comm.sync_state(model, opt, sched, progress)
    comm.check_identical(model, opt, sched, progress)
    return [float(p.sum()) for p in model.parameters()] + [progress["step"]]


def test_sync_state_hands_over_a_model_adam_and_a_scheduler_through_the_safe_loader() -> None:
    got = distcomm.testing.spawn(_sync_with_adam, 3, timeout=WAIT)
    assert got[0] == got[1] == got[2] and got[0][-1] == 7


# ---------------------------------------------------------------- the proof in every new group
IMPOSTOR = """
    import json, os, sys, datetime, torch, torch.distributed as dist
    from distcomm._trust.handshake import prove_members
    from distcomm._trust.key import JobKey
    import distcomm
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", rank=rank, world_size=3, timeout=datetime.timedelta(seconds=60))
    key = JobKey(b"the job's key, 16 and more" if rank != 2 else b"an impostor's guess at it")
    try:
        prove_members(key, "epoch-5-abcd", (0, 1, 4))
        print(json.dumps({"proved": True}))
    except distcomm.AuthenticationError as e:
        print(json.dumps({"error": str(e), "ranks": list(e.ranks), "rank loss": distcomm.is_rank_loss(e)}))
"""


def test_a_member_of_a_new_group_without_the_key_fails_every_honest_rank_at_once_named(tmp_path: Path) -> None:
    _, procs = job(tmp_path, IMPOSTOR, 3, keyed=False)
    out = ended(procs)
    for r in (0, 1):
        code, lines, err = out[r]
        assert code == 0 and lines[-1]["ranks"] == [2] and not lines[-1]["rank loss"], err
        assert "rank(s) [2] (job rank(s) [4]) could not prove they hold the job's key" in lines[-1]["error"]
    assert out[2][1][-1]["ranks"] == [0, 1]  # (the impostor finds no one who answers as it does)


# ---------------------------------------------------------------- an outsider against a running job
JOB = """
    import json, os, sys, time, torch
    import distcomm
    stop = sys.argv[1]
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    comm = distcomm.from_env()
    if comm.rank == 0:
        with open(stop + ".port", "w") as f:
            f.write(os.environ["MASTER_PORT"])
    progress, share = {"step": 0}, True
    while True:
        try:
            if share:
                comm.sync_state(model, opt, progress)
                share = False
            if comm.all_reduce(torch.tensor([float(os.path.exists(stop))]), op="max").item():
                break
            loss = model(torch.ones(8, 4) * comm.rank).pow(2).mean()
            opt.zero_grad(); loss.backward(); opt.step()
            progress["step"] += 1
            print(json.dumps({"step": progress["step"], "members": list(comm.membership.job_ranks)}), flush=True)
            time.sleep(0.05)
            new = comm.admit()
            if new is not comm:
                comm, share = new, True
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            comm, share = comm.shrink(), True
    m = comm.membership
    print(json.dumps({"done": progress["step"], "members": list(m.job_ranks), "lost": list(m.lost),
                      "admitted": list(m.admitted)}), flush=True)
    comm.close()
"""

NEWCOMER = """
    import distcomm, json
    try:
        comm = distcomm.from_env(timeout=float(__import__("sys").argv[1]))
        print(json.dumps({"in": list(comm.membership.job_ranks)}), flush=True)
    except Exception as e:
        print(json.dumps({"refused": type(e).__name__, "why": str(e)}), flush=True)
"""


def _forge(port: int) -> list[str]:
    """What an outsider who knows only the port can write: every membership record it finds named in
    the store, and the ones a shrink or an admit would look for, with values that would steer the job."""
    raw = _c10d.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=10))
    keys = list(raw.list_keys())
    scopes = {k.split("/")[1] for k in keys if k.startswith("distcomm/")}
    forged = []
    for scope in scopes:
        base = f"distcomm/{scope}"
        epochs = {k[len(base) + 1:].split("/")[0] for k in keys if k.startswith(base + "/")}
        epochs = {e for e in epochs if e.startswith(("round-", "epoch-"))}
        number = int(raw.add(f"{base}/round", 0))
        for e in epochs:  # a shrink claimed, a membership broken, a host posted silent, a leader named
            for name, value in (("successor", "shrink"), ("broken", "shrink"), ("silent", "1"),
                                ("shrink/leader", "1"), ("shrink/decision", "epoch-99:0")):
                raw.set(f"{base}/{e}/{name}", value)
                forged.append(f"{base}/{e}/{name}")
        for r in range(3):  # a rank's beat, replayed forward
            raw.set(f"{base}/alive/{r}", str(10 ** 15))
        rnd = f"{base}/round-{number}"
        raw.set(f"{rnd}/world", "3")  # the open round: a place taken as rank 1, and its world size
        raw.set(f"{rnd}/rank/1", "outsider pid 1 0000")
        raw.add(f"{rnd}/count", 1)
    return forged


def _steps(lines: list[dict[str, Any]]) -> list[int]:
    return [line["step"] for line in lines if "step" in line]


def test_an_outsider_who_knows_only_the_port_can_neither_join_steer_nor_stall_a_run_job(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "MASTER_", "DISTCOMM_JOB"))}
    agent = _forked.start(["-m", "distcomm", "run", "--nproc-per-node", "3", "--replacements", "1",
                           "--log-dir", str(tmp_path / "logs"), str(script), str(stop)], clean, ROOT)
    try:
        deadline = time.monotonic() + WAIT
        while not (tmp_path / "stop.port").exists() and time.monotonic() < deadline and agent.poll() is None:
            time.sleep(0.1)
        port = int((tmp_path / "stop.port").read_text())
        time.sleep(1.0)
        forged = _forge(port)
        assert forged, "the outsider found no record to forge"
        newcomer = tmp_path / "newcomer.py"
        newcomer.write_text(textwrap.dedent(NEWCOMER))
        at = worker_env(Job((), 3, master_port=port), 1, "none", None)  # a worker's variables, but the key
        assert "DISTCOMM_JOB_KEY" not in at
        keyless = _forked.run([str(newcomer), "30"], at, tmp_path, WAIT)
        guessed = _forked.run([str(newcomer), "6"], {**at, "DISTCOMM_JOB_KEY": "a guess at the job's key"}, tmp_path,
                              WAIT)
        time.sleep(2.0)  # the job steps on meanwhile: shown by its steps after the forged records
    finally:
        stop.write_text("")
        _, stderr = agent.communicate(timeout=WAIT)
    said = json.loads(keyless.stdout.strip().splitlines()[-1])
    assert said["refused"] == "ValueError" and "this job has a key" in said["why"], keyless
    said = json.loads(guessed.stdout.strip().splitlines()[-1])
    assert said["refused"] == "CollectiveTimeoutError", guessed
    assert agent.returncode == 0, stderr[-3000:]
    logs = {r: (tmp_path / "logs" / f"rank{r}.log").read_text() for r in range(3)}
    for r, text in logs.items():
        lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
        assert lines[-1] == {"done": lines[-1]["done"], "members": [0, 1, 2], "lost": [], "admitted": []}, text[-2000:]
        assert all(line["members"] == [0, 1, 2] for line in lines if "step" in line)  # no shrink, no admit
        assert lines[-1]["done"] >= 20, text[-2000:]
    assert "was not written with the job's key" in stderr, stderr[-3000:]


# ---------------------------------------------------------------- a job without a key
KEYLESS = """
    import json, os, signal, sys, time
    import distcomm
    comm = distcomm.from_env()
    newcomer = bool(comm.membership.admitted)
    if comm.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        try:
            comm.barrier()
            time.sleep(0.05)
            comm = comm.admit()
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            comm = comm.shrink()
    print(json.dumps({"members": list(comm.membership.job_ranks)}), flush=True)
"""


def test_a_job_without_a_key_runs_as_before_and_refuses_a_newcomer_saying_how_to_give_one(tmp_path: Path) -> None:
    port, first = job(tmp_path, KEYLESS, 2, "12", keyed=False)
    time.sleep(3.0)
    newcomer = tmp_path / "newcomer.py"
    newcomer.write_text(textwrap.dedent(NEWCOMER))
    env = {k: v for k, v in os.environ.items() if k != "DISTCOMM_JOB_KEY"}
    late = _forked.run([str(newcomer), "60"], {**env, "PYTHONPATH": os.pathsep.join(sys.path), "RANK": "1",
                                              "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(port)}, tmp_path, WAIT)
    out = ended(first)
    said = json.loads(late.stdout.strip().splitlines()[-1])
    assert said["refused"] == "ValueError" and "this job has no key" in said["why"], late
    assert "DISTCOMM_JOB_KEY" in said["why"] and "python -m distcomm run, launch() and testing.spawn() make one" \
        in said["why"]
    assert out[0][0] == 0 and out[0][1][-1] == {"members": [0]}, out[0][2]


def test_cli_refuses_replacements_across_machines_without_a_key() -> None:
    out = cli("run", "--nnodes", "2", "--master-port", "29999", "--replacements", "1", "x.py")
    assert out.returncode == 2 and "only holders of the job's key come in" in out.stderr, out.stderr
    out = cli("run", "x.py", env={"DISTCOMM_JOB_KEY": "short"})
    assert out.returncode == 2 and "it needs 16 or more" in out.stderr, out.stderr


# ---------------------------------------------------------------- every message authenticated
def test_an_authenticated_payload_changed_on_the_way_is_refused_before_anything_loads_it() -> None:
    seen: list[int] = []

    class Counting(distcomm.PickleSerializer):
        def loads(self, segments: Any) -> Any:
            seen.append(len(segments))
            return super().loads(segments)

    sender = distcomm.AuthenticatedSerializer(Counting(), key="the job's own key, 16+")
    payload = [bytearray(s) for s in sender.dumps({"step": 3, "w": torch.ones(20000)})]
    assert sender.loads([memoryview(p) for p in payload])["step"] == 3 and seen == [len(payload) - 1]
    payload[0][-2] ^= 1  # a byte changed on the path
    with pytest.raises(distcomm.UnsafePayloadError, match="MAC doesn't match the job's key"):
        sender.loads([memoryview(p) for p in payload])
    other = distcomm.AuthenticatedSerializer(key="another job's key, 16+")
    with pytest.raises(distcomm.UnsafePayloadError):
        other.loads([memoryview(s) for s in sender.dumps(1)])
    assert seen == [len(payload) - 1]  # the inner loader never saw the refused ones
    with pytest.raises(ValueError, match="needs the job's key"):
        distcomm.AuthenticatedSerializer()


def _authenticated_job(comm: distcomm.Communicator) -> tuple[str, list[int], float]:
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(comm.rank)
    torch.nn.init.normal_(model.weight)
    comm.sync_state(model)
    return repr(comm.serializer), comm.all_gather(comm.rank), float(model.weight.sum())


def test_a_job_whose_messages_are_all_authenticated_runs_its_calls_and_hands_over_its_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCOMM_SERIALIZER", "authenticated")  # (the key: spawn() makes the job's)
    got = distcomm.testing.spawn(_authenticated_job, 3, timeout=WAIT)
    assert all(g[0].startswith("AuthenticatedSerializer(PickleSerializer") and g[1] == [0, 1, 2] for g in got)
    assert got[0][2] == got[1][2] == got[2][2]


# ---------------------------------------------------------------- the state's source: a holder, never a newcomer
SOURCE = """
    import json, os, signal, sys, time
    import distcomm
    where = sys.argv[1]
    comm = distcomm.from_env(timeout=60)
    me, progress, share, seen = comm.membership.job_ranks[comm.rank], {"step": 0}, True, []
    newcomer = bool(comm.membership.admitted)
    while True:
        try:
            if share:
                comm.sync_state(progress)
                seen.append(progress["step"])
                share = False
            if progress["step"] >= 8 and (progress.get("in") or progress["step"] >= 400):
                break  # (decided once the state went round: on until the replacement is in)
            if where == "split" and len(comm.membership.admitted) and comm.world_size == 3:
                sub = comm.split(0 if comm.membership.job_ranks[comm.rank] in (0, 2) else 1)
                sub.sync_state(progress)  # (its rank 0 is the newcomer, job rank 0)
                seen.append(progress["step"])
            if me == 0 and progress["step"] == 3 and not newcomer:
                os.kill(os.getpid(), signal.SIGKILL)
            comm.barrier()
            progress["step"] += 1
            time.sleep(0.05)  # (the rest of a step: the replacement starts meanwhile)
            new = comm.admit()
            if new is not comm:
                comm, share = new, True
                progress["in"] = True
                if where == "second loss" and me == 1:  # lost right after the admit, before the state went round
                    os.kill(os.getpid(), signal.SIGKILL)
        except Exception as e:
            if not distcomm.is_rank_loss(e):
                raise
            comm, share = comm.shrink(), True
    print(json.dumps({"seen": seen, "members": list(comm.membership.job_ranks)}), flush=True)
    comm.close()
"""


@pytest.mark.parametrize("where", ["second loss", "split"])
def test_the_state_comes_from_a_member_that_holds_it_never_from_a_newcomer(tmp_path: Path, where: str) -> None:
    """Job rank 0 is lost and its replacement let in: after a second loss before the state went round
    (the shrink renumbers the newcomer as rank 0), or on a split whose rank 0 is the newcomer, the
    state comes from a member that holds it: no member's step ever goes back."""
    port = distcomm.free_port()
    store = serve_store(f"tcp://127.0.0.1:{port}", 3, WAIT)
    _, procs = job(tmp_path, SOURCE, 3, where, port=port, store_apart=True)
    deadline = time.monotonic() + WAIT
    while procs[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    _, newcomer = job(tmp_path, SOURCE, 3, where, ranks=[0], port=port, store_apart=True)
    out = ended({1: procs[1], 2: procs[2], 3: newcomer[0]})
    del store  # (served until every process ended)
    for r in (2, 3):
        code, lines, err = out[r]
        assert code == 0, (r, err)
        seen = lines[-1]["seen"]
        assert seen == sorted(seen) and seen[-1] >= 3, (r, seen)  # the newcomer's fresh step 0 never taken
    assert out[3][1][-1]["seen"][0] >= 3  # the newcomer was handed the members' step


def _no_holder_left(comm: distcomm.Communicator) -> str:
    comm._holds_state = False  # (every member a newcomer not yet handed the state: the holders were all lost)
    try:
        comm.sync_state({"step": comm.rank})
    except distcomm.CommunicatorStateError as e:
        return str(e)
    return "returned"


def test_sync_state_with_no_member_holding_the_state_raises_on_every_rank() -> None:
    said = distcomm.testing.spawn(_no_holder_left, 2, timeout=WAIT)
    assert said[0] == said[1] and "no member holds the job's trained state" in said[0], said


class Marshalled(distcomm.Serializer):
    """A serializer of the user's own, in no way pickle's."""

    name = "marshal"

    def dumps(self, obj: Any) -> list[memoryview]:
        return [memoryview(__import__("marshal").dumps(obj))]

    def loads(self, segments: Any) -> Any:
        return __import__("marshal").loads(bytes(segments[0]))


def _sync_with_own_serializer(comm: distcomm.Communicator) -> tuple[Any, Any]:
    progress = {"step": 5 if comm.rank == 0 else 0, "tag": "x"}
    comm.sync_state(progress)
    return progress, comm.all_gather(comm.rank)


def test_sync_state_moves_state_its_own_way_whatever_serializer_the_communicator_has() -> None:
    got = distcomm.testing.spawn(_sync_with_own_serializer, 2, serializer=Marshalled(), timeout=WAIT)
    assert got == [({"step": 5, "tag": "x"}, [0, 1])] * 2
