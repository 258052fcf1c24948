"""A job that outlives its ranks: the rendezvous knows ranks (a restarted process takes its own
place), survivors of a killed rank shrink to a new communicator, and members admit a replacement.

Ranks are real processes started as a job controller starts them (RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT: a launcher whose survivors live on), killed with SIGKILL."""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import distcomm
import distcomm.testing
from distcomm._elastic.liveness import alive
from distcomm._launching.rendezvous import meet, serve_store

from ._jobs import WAIT, job_key_for
from ._jobs import ended as _ended
from ._jobs import job as _job


def _ranks_at_once(calls: list[Any]) -> list[Any]:
    """Each of ``calls`` on a thread of its own, started a moment apart; what each returned or raised."""
    out: list[Any] = [None] * len(calls)

    def one(i: int) -> None:
        try:
            out[i] = calls[i]()
        except Exception as e:
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
        time.sleep(0.2)
    for t in threads:
        t.join(60)
    return out


# ---------------------------------------------------------------- rounds by rank
def test_a_restarted_rank_takes_its_own_place_not_a_missing_ranks() -> None:
    """Rank 1's first process gives up, its second arrives: rank 2 is still missing, and rank 0 says
    so (arrivals were counted: rank 1 twice completed the round in rank 2's place)."""
    port = distcomm.free_port()
    first = _ranks_at_once([lambda: meet("127.0.0.1", port, 0, 3, 6.0),
                            lambda: meet("127.0.0.1", port, 1, 3, 1.0),   # gives up, its place kept
                            lambda: meet("127.0.0.1", port, 1, 3, 3.0)])  # the restarted process
    assert isinstance(first[0], distcomm.CollectiveTimeoutError), first
    assert first[0].ranks == (2,), first[0]
    assert isinstance(first[2], distcomm.CollectiveTimeoutError), first


def test_a_restarted_rank_completes_the_round_with_the_others() -> None:
    """As under torchrun's agent, whose store outlives the workers: rank 1's first process gives up
    before rank 0 comes, its restarted process and rank 0 then meet."""
    port = distcomm.free_port()
    agent = _launchers_store(port)
    seats = _ranks_at_once([lambda: meet("127.0.0.1", port, 1, 2, 0.1, hosted=False),
                            lambda: meet("127.0.0.1", port, 1, 2, 20.0, hosted=False),
                            lambda: meet("127.0.0.1", port, 0, 2, 20.0, hosted=False)])
    assert isinstance(seats[0], distcomm.CollectiveTimeoutError), seats
    assert seats[1].epoch == seats[2].epoch and seats[2].members == (0, 1), seats
    del agent


def _launchers_store(port: int) -> Any:
    """A store the launcher hosts, as torchrun's agent does (kept across its workers' rendezvous)."""
    return distcomm._launching.rendezvous._c10d().TCPStore("127.0.0.1", port, 2, True, datetime.timedelta(seconds=30),
                                                 wait_for_workers=False)


def test_two_live_processes_started_as_one_rank_are_both_named() -> None:
    port = distcomm.free_port()
    agent = _launchers_store(port)
    seats = _ranks_at_once([lambda: meet("127.0.0.1", port, 1, 2, 20.0, hosted=False),
                            lambda: meet("127.0.0.1", port, 1, 2, 20.0, hosted=False),
                            lambda: meet("127.0.0.1", port, 0, 2, 20.0, hosted=False)])
    assert isinstance(seats[0], ValueError) and "two processes were started as rank 1" in str(seats[0]), seats
    assert seats[1].token in str(seats[0]) and seats[2].members == (0, 1), seats  # both processes named
    assert seats[0].args[0].count(" pid ") == 2, seats
    del agent


def test_a_rank_with_another_world_size_is_refused_naming_both() -> None:
    port = distcomm.free_port()
    seats = _ranks_at_once([lambda: meet("127.0.0.1", port, 0, 2, 3.0), lambda: meet("127.0.0.1", port, 1, 3, 3.0)])
    assert isinstance(seats[1], ValueError), seats
    assert "says the job has 3 ranks, but " in str(seats[1]) and ": 2; start every rank" in str(seats[1]), seats
    assert str(seats[1]).count(" pid ") == 2, seats  # both processes named


def test_nothing_listening_is_named_as_such() -> None:
    with pytest.raises(distcomm.CollectiveTimeoutError, match=r"nothing listens there \(connection refused\)"):
        meet("127.0.0.1", distcomm.free_port(), 1, 2, 2.0)


def test_a_rank_waiting_when_the_store_host_gives_up_is_told_in_one_line(capfd: pytest.CaptureFixture[str]) -> None:
    """Rank 0 (the store's host) gives up on a missing rank 2 while rank 1 still waits: rank 1 is told
    the store went away, without torch's pages of C++ frames for each look at a store that is gone."""
    port = distcomm.free_port()
    got = _ranks_at_once([lambda: meet("127.0.0.1", port, 0, 3, 2.0), lambda: meet("127.0.0.1", port, 1, 3, 30.0)])
    assert isinstance(got[0], distcomm.CollectiveTimeoutError) and got[0].ranks == (2,), got
    assert isinstance(got[1], distcomm.PeerError) and "went away while rank 1 waited" in str(got[1]), got
    assert "frame #" not in capfd.readouterr().err


def test_a_rank_waiting_when_a_launchers_store_goes_away_is_told_which_process_served_it() -> None:
    """The store is the launcher's (torchrun's agent), not rank 0's: the error says so, and names no rank."""
    port = distcomm.free_port()
    agents = [_launchers_store(port)]
    got = _ranks_at_once([lambda: meet("127.0.0.1", port, 1, 2, 30.0, hosted=False),
                          lambda: (time.sleep(1.0), agents.clear())])  # the agent ends while rank 1 waits
    assert isinstance(got[0], distcomm.PeerError) and got[0].ranks == (), got
    assert "went away while rank 1 waited for the other ranks: the process serving it (the launcher's" in str(got[0])


def test_a_host_name_that_does_not_resolve_is_named_at_once() -> None:
    start = time.monotonic()
    with pytest.raises(distcomm.CommunicatorStateError, match="does not resolve on this machine"):
        meet("no-such-host.invalid", 29500, 1, 2, 60.0)
    assert time.monotonic() - start < 30  # not the timeout


# ---------------------------------------------------------------- whole jobs
SURVIVE = """
    import json, os, signal, sys, time
    import distcomm

    victims = [int(v) for v in sys.argv[1].split(",") if v]
    where = sys.argv[2]  # "collective": killed inside one; "shrink": one more dies instead of shrinking
    comm = distcomm.from_env(timeout=60)
    try:
        for step in range(10_000):
            if step == 3 and comm.rank in victims:
                os.kill(os.getpid(), signal.SIGKILL)
            assert comm.all_gather(comm.rank) == list(range(comm.world_size))
    except distcomm.DistCommError as e:
        failed = type(e).__name__
    if where == "shrink" and comm.rank == max(set(range(comm.world_size)) - set(victims)):
        os.kill(os.getpid(), signal.SIGKILL)  # dies while the others agree
    if where == "slow" and comm.rank == 1:
        time.sleep(3.0)  # alive, and late to the shrink: not dropped
    new = comm.shrink()
    print(json.dumps({"failed": failed, "rank": new.rank, "world": new.world_size,
                      "members": new.membership.job_ranks, "lost": new.membership.lost,
                      "gathered": new.all_gather(new.membership.job_ranks[new.rank]),
                      "sum": int(new.all_reduce_dict({"x": 1}, op="sum")["x"]), "repr": repr(new),
                      "launchers": [comm.launcher, new.launcher]}), flush=True)
    new.close()
"""


@pytest.mark.parametrize(("world", "victims", "where"), [
    (4, "2", "collective"), pytest.param(4, "1", "slow", marks=pytest.mark.slow),
    pytest.param(4, "3", "shrink", marks=pytest.mark.slow),
    pytest.param(5, "1,3", "collective", marks=pytest.mark.slow)])
def test_survivors_shrink_to_a_communicator_of_themselves(tmp_path: Path, world: int, victims: str,
                                                          where: str) -> None:
    _, procs = _job(tmp_path, SURVIVE, world, victims, where)
    ended = _ended(procs)
    lost = {int(v) for v in victims.split(",")}
    if where == "shrink":
        lost.add(max(set(range(world)) - lost))
    alive = [r for r in range(world) if r not in lost]
    for r in range(world):
        code, lines, err = ended[r]
        if r in lost:
            assert code == -signal.SIGKILL, (r, code, err)
            continue
        assert code == 0 and len(lines) == 1, (r, code, err)
        got = lines[0]
        assert got["failed"] in ("PeerError", "CollectiveTimeoutError", "CommunicatorStateError"), got
        assert (got["rank"], got["world"], got["members"]) == (alive.index(r), len(alive), alive), got
        assert got["lost"] == sorted(lost) and got["gathered"] == alive and got["sum"] == len(alive), got
        assert f"lost={sorted(lost)}" in got["repr"], got
        assert got["launchers"][0] and got["launchers"][0] == got["launchers"][1], got  # (the same processes)


NOBODY_LOST = """
    import json
    import distcomm

    comm = distcomm.from_env(timeout=60)
    sub = comm.split(comm.rank % 2)
    comm.all_gather(0)
    new = comm.shrink()
    try:
        sub.all_gather(0)
        retired = "usable"
    except distcomm.CommunicatorStateError as e:
        retired = str(e)
    again = new.split(new.rank % 2).all_gather(new.rank)
    print(json.dumps({"members": new.membership.job_ranks, "lost": new.membership.lost,
                      "gathered": new.all_gather(new.rank), "old_closed": comm._closed, "sub": retired,
                      "split_again": again}), flush=True)
    new.close()
"""


def test_a_shrink_that_lost_no_one_keeps_every_rank(tmp_path: Path) -> None:
    _, procs = _job(tmp_path, NOBODY_LOST, 3)
    for r, (code, lines, err) in _ended(procs).items():
        assert code == 0, err
        assert lines == [{"members": [0, 1, 2], "lost": [], "gathered": [0, 1, 2], "old_closed": True,
                          "sub": "GlooCommunicator is closed: the job's communicator it was split from was remade "
                                 "by shrink(); split the new one",
                          "split_again": [0, 2] if r % 2 == 0 else [1]}], lines


STORE_HOST_DIES = """
    import json, os, signal
    import distcomm

    comm = distcomm.from_env(timeout=60)
    try:
        for step in range(10_000):
            if step == 3 and comm.rank == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_gather(comm.rank)
    except distcomm.DistCommError:
        pass
    try:
        comm.shrink()
    except distcomm.PeerError as e:
        print(json.dumps({"error": str(e)}), flush=True)
"""


def test_survivors_of_the_store_host_are_told_at_once(tmp_path: Path) -> None:
    _, procs = _job(tmp_path, STORE_HOST_DIES, 3)
    ended = _ended(procs)
    for r in (1, 2):
        code, lines, err = ended[r]
        assert code == 0 and lines, err
        assert "the job's store" in lines[0]["error"] and "was lost" in lines[0]["error"], lines
        assert "host the store apart" in lines[0]["error"], lines


ADMIT = """
    import json, os, signal, sys, time
    import distcomm

    comm = distcomm.from_env(timeout=60)
    if sys.argv[1] == "newcomer":
        comm.rank  # its first use: it joins the members here
        time.sleep(0.8)  # a start-up after that, which the members wait for (it is told so)
        comm.broadcast(None)  # the state the members hand over at admission
        print(json.dumps({"rank": comm.rank, "world": comm.world_size, "state": comm.broadcast(None),
                          "admitted": comm.membership.admitted,
                          "gathered": comm.all_gather(comm.membership.job_ranks[comm.rank])}), flush=True)
        comm.close()
        sys.exit(0)
    params = 0
    try:
        for step in range(10_000):
            if step == 3 and comm.rank == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            params += sum(comm.all_gather(1))
    except distcomm.DistCommError:
        comm = comm.shrink()
    if comm.rank == 0:
        print(json.dumps({"shrunk": True}), flush=True)  # the test starts the replacement now
    for step in range(10_000):
        params += sum(comm.all_gather(1))
        new = comm.admit()
        if new is not comm:
            comm = new
            comm.broadcast({"params": params, "step": step})
            break
        time.sleep(0.02)
    print(json.dumps({"rank": comm.rank, "world": comm.world_size, "state": comm.broadcast({"params": params}),
                      "admitted": comm.membership.admitted,
                      "gathered": comm.all_gather(comm.membership.job_ranks[comm.rank])}), flush=True)
    comm.close()
"""


def test_members_admit_a_replacement_into_the_lost_ranks_place(tmp_path: Path) -> None:
    port, procs = _job(tmp_path, ADMIT, 4, "member")
    assert procs[0].stdout is not None
    first = procs[0].stdout.readline()  # rank 0 says when the survivors have shrunk
    assert json.loads(first) == {"shrunk": True}, first
    _, newcomer = _job(tmp_path, ADMIT, 4, "newcomer", ranks=[2], port=port)
    ended = _ended({**procs, 4: newcomer[2]})
    assert ended[2][0] == -signal.SIGKILL
    states = []
    for r in (0, 1, 3, 4):
        code, lines, err = ended[r]
        assert code == 0, (r, err)
        got = lines[-1]
        assert got["world"] == 4 and got["admitted"] == [2] and got["gathered"] == [0, 1, 2, 3], got
        states.append(got["state"])
    assert ended[4][1][-1]["rank"] == 2  # the replacement took the lost rank's place
    assert re.search(r"RuntimeWarning: distcomm: this replacement's first call came \d+\.\d\d s after", ended[4][2])
    assert "every member waited for it that long: it joins them at its first use" in ended[4][2]
    assert len({json.dumps(s, sort_keys=True) for s in states}) == 1, states  # one state on every member


ADMIT_LOSING = """
    import json, os, signal, sys, time
    import distcomm, distcomm._elastic.membership, distcomm._launching.start

    def dies_after(fn, when=lambda result: True):
        def call(*args, **kwargs):
            result = fn(*args, **kwargs)
            if when(result):
                os.kill(os.getpid(), signal.SIGKILL)
            return result
        return call

    comm = distcomm.from_env(timeout=60)
    if sys.argv[1] == "member":
        try:
            for step in range(10_000):
                if step == 3 and comm.rank == 2:
                    os.kill(os.getpid(), signal.SIGKILL)
                comm.all_gather(1)
        except distcomm.DistCommError:
            comm = comm.shrink()
        if comm.rank == 0:
            print(json.dumps({"shrunk": True}), flush=True)  # the test starts the replacement now
        me = comm.membership.job_ranks[comm.rank]
        if sys.argv[2] == "forming" and me == 3:  # dies as the admit's group forms, before it writes a key
            distcomm._launching.start.publish_pid = dies_after(lambda seat: None)
        if sys.argv[2] == "deciding" and me == 0:  # decides, tells the newcomer, and dies before the broadcast
            membership = distcomm._elastic.membership
            membership._decide = dies_after(membership._decide, lambda decision: decision[1])
        while True:
            try:
                new = comm.admit()
            except distcomm.DistCommError:
                new = comm.shrink()
            if new is not comm:
                break
            comm.all_gather(1)
            time.sleep(0.02)
        comm = new
    m = comm.membership
    print(json.dumps({"members": m.job_ranks, "lost": m.lost, "admitted": m.admitted,
                      "gathered": comm.all_gather(m.job_ranks[comm.rank])}), flush=True)
    comm.close()
"""


@pytest.mark.parametrize(("where", "victim"), [("forming", 3), ("deciding", 0)])
def test_a_member_lost_inside_an_admit_leaves_the_others_and_the_newcomer_together(
        tmp_path: Path, where: str, victim: int) -> None:
    """A member that dies as the admit's group forms (its address never written), or rank 0 that dies
    between deciding and telling the members (the newcomer told, the members not): the others and
    the newcomer agree on the survivors of the admit's membership instead of waiting out the timeout."""
    port = distcomm.free_port()
    store = serve_store(f"tcp://127.0.0.1:{port}", 4, WAIT)
    _, procs = _job(tmp_path, ADMIT_LOSING, 4, "member", where, port=port, store_apart=True)
    first = procs[0].stdout.readline() if procs[0].stdout else ""
    assert json.loads(first) == {"shrunk": True}, first
    _, newcomer = _job(tmp_path, ADMIT_LOSING, 4, "newcomer", where, ranks=[2], port=port, store_apart=True)
    ended = _ended({**procs, 4: newcomer[2]})
    assert ended[2][0] == ended[victim][0] == -signal.SIGKILL
    for r in sorted({0, 1, 3, 4} - {victim}):
        code, lines, err = ended[r]
        assert code == 0, (r, err)
        assert lines[-1] == {"members": sorted({0, 1, 2, 3} - {victim}), "lost": [victim], "admitted": [2],
                             "gathered": sorted({0, 1, 2, 3} - {victim})}, (r, lines, err)
    del store


SOME_ADMIT = """
    import json
    import distcomm

    comm = distcomm.from_env(timeout=30)
    try:
        comm.admit() if comm.rank == 0 else comm.all_gather(1)
    except distcomm.CollectiveMismatchError as e:
        print(json.dumps({"error": str(e)}), flush=True)
"""


@pytest.mark.slow
def test_admit_called_by_some_members_only_is_a_mismatch_on_every_rank(tmp_path: Path) -> None:
    _, procs = _job(tmp_path, SOME_ADMIT, 2)
    for code, lines, err in _ended(procs).values():
        assert code == 0 and lines, err
        assert "admit" in lines[0]["error"] and "all_gather" in lines[0]["error"], lines


DUPLICATE = """
    import json, sys, time
    import distcomm

    try:
        comm = distcomm.from_env(timeout=30)
    except ValueError as e:
        print(json.dumps({"refused": str(e)}), flush=True)
        sys.exit(0)
    for _ in range(200):
        comm.all_gather(0)
        comm.admit()
        time.sleep(0.05)
    comm.close()
"""


@pytest.mark.slow
def test_a_newcomer_for_a_rank_that_is_alive_is_refused_naming_both(tmp_path: Path) -> None:
    port, procs = _job(tmp_path, DUPLICATE, 2)
    time.sleep(2.0)
    _, extra = _job(tmp_path, DUPLICATE, 2, ranks=[1], port=port)
    ended = _ended({**procs, 2: extra[1]})
    assert ended[0][0] == 0 and ended[1][0] == 0, ended
    code, lines, err = ended[2]
    assert code == 0 and lines, err
    refused = lines[0]["refused"]
    assert "rank 1 of the job is a member and alive (" in refused and refused.count(" pid ") == 2, lines  # both named


# ---------------------------------------------------------------- the start-up's own failures
TWICE = """
    import json, sys, time
    import distcomm

    for round_ in range(2):
        comm = distcomm.from_env(timeout=30)
        got = comm.all_gather(comm.rank)
        if comm.rank == 0:
            time.sleep(2.0)  # rank 0 leaves its block last (saving a checkpoint)
        comm.close()
    print(json.dumps({"gathered": got}), flush=True)
"""


def test_a_second_from_env_meets_again_when_rank_0_leaves_last(tmp_path: Path) -> None:
    _, procs = _job(tmp_path, TWICE, 2)
    for code, lines, err in _ended(procs).values():
        assert code == 0 and lines == [{"gathered": [0, 1]}], err


ISEND_THEN_RAISE = """
    import json, sys, time
    import distcomm

    start = time.monotonic()
    try:
        with distcomm.from_env(timeout=100) as comm:
            if comm.rank == 1:
                comm.isend({"small": 1}, dst=0)
                raise RuntimeError("the program's own error")
            comm.all_gather(0)  # waits for rank 1, which raised
    except distcomm.DistCommError as e:
        print(json.dumps({"error": type(e).__name__, "seconds": time.monotonic() - start}), flush=True)
"""


def test_a_rank_that_raises_after_an_isend_does_not_hold_the_job(tmp_path: Path) -> None:
    """Its exit waited for the receiver, which waited for it in a collective: the whole timeout."""
    _, procs = _job(tmp_path, ISEND_THEN_RAISE, 2)
    ended = _ended(procs)
    assert ended[1][0] == 1 and "the program's own error" in ended[1][2], ended[1]
    code, lines, err = ended[0]
    assert code == 0 and lines and lines[0]["error"] in ("PeerError", "CollectiveTimeoutError"), err
    assert lines[0]["seconds"] < 100, lines  # well before the communicator's timeout


LEFT_IN_A_RECV = """
    import json, sys, time
    import distcomm

    class SlowToFree:  # the interpreter's finalization, drawn out: a wait that ends inside it aborts
        def __del__(self):
            time.sleep(2.0)

    comm = distcomm.from_env(timeout=60)
    if comm.rank == 1:
        try:
            comm.recv(src=0)  # rank 0 sends nothing: it leaves for shrink()
        except distcomm.PeerError:
            pass
    else:
        time.sleep(0.5)
    comm = comm.shrink()  # no one lost: every rank again
    members = list(comm.membership.job_ranks)
    comm.synchronize()
    comm.close()
    print(json.dumps({"members": members}), flush=True)
    if comm.rank == 0:
        time.sleep(1.0)  # rank 0 ends while rank 1 ends, ending rank 1's wait on the old group
    elif comm.rank == 1:
        slow = SlowToFree()
"""


@pytest.mark.slow  # (a few seconds of real processes: the slow tier)
def test_a_rank_left_waiting_in_an_old_group_exits_cleanly(tmp_path: Path) -> None:
    """Rank 1's helper thread still waits in the first group's recv when the program ends; rank 0's
    exit ends that wait. Inside the interpreter's finalization, that aborted rank 1 ("terminate
    called without an active exception", exit -6) after all its work was done."""
    port = distcomm.free_port()
    store = serve_store(f"tcp://127.0.0.1:{port}", 5, WAIT)
    _, procs = _job(tmp_path, LEFT_IN_A_RECV, 5, port=port, store_apart=True)
    for r, (code, lines, err) in _ended(procs).items():
        assert code == 0 and lines == [{"members": [0, 1, 2, 3, 4]}], (r, code, err)
    del store




LEFT_WAITING_ON_EACH_OTHER = """
    import json, time
    import distcomm

    class SlowToFree:  # the interpreter's finalization, drawn out: a wait that ends inside it aborts
        def __del__(self):
            time.sleep(2.0)

    comm = distcomm.from_env(timeout=60)
    if comm.rank < 2:
        try:
            comm.recv(src=1 - comm.rank)  # neither sends: each waits on the other until rank 2 shrinks
        except distcomm.PeerError:
            pass
    else:
        time.sleep(0.5)
    comm = comm.shrink()  # no one lost
    members = list(comm.membership.job_ranks)
    comm.synchronize()
    comm.close()
    print(json.dumps({"members": members}), flush=True)
    if comm.rank < 2:
        slow = SlowToFree()
"""


@pytest.mark.slow  # (a few seconds of real processes: the slow tier)
def test_two_ranks_left_waiting_on_each_other_in_an_old_group_exit_cleanly(tmp_path: Path) -> None:
    """Ranks 0 and 1 each still wait, in a waiter thread, for the other's message in the first group
    when the program ends: each wait would end only when the other process exits, so one of them
    exited first and the other's wait ended inside its finalization (an abort). Exit breaks them."""
    port = distcomm.free_port()
    store = serve_store(f"tcp://127.0.0.1:{port}", 3, WAIT)
    _, procs = _job(tmp_path, LEFT_WAITING_ON_EACH_OTHER, 3, port=port, store_apart=True)
    for r, (code, lines, err) in _ended(procs).items():
        assert code == 0 and lines == [{"members": [0, 1, 2]}], (r, code, err)
    del store

ASKED_FROM_TRANSPORT = """
    import json, sys, threading
    import torch
    import torch.distributed as dist
    import distcomm
    from distcomm._elastic import forming as _forming

    asked = []  # the watched store's calls: on a thread of gloo's own, or on Python's
    for name in ("get", "wait", "check", "set", "add"):
        def spy(self, *args, _call=getattr(_forming.WatchedStore, name), _name=name):
            gloo = isinstance(threading.current_thread(), threading._DummyThread)
            asked.append(("gloo" if gloo else "python", _name))
            return _call(self, *args)
        setattr(_forming.WatchedStore, name, spy)

    comm = distcomm.from_env(timeout=60)
    if sys.argv[1] == "shrink":
        comm = comm.shrink()  # no one lost: a membership whose group connects lazily
    n, r = comm.world_size, comm.rank
    assert comm.all_to_all([(r, d) for d in range(n)]) == [(s, r) for s in range(n)]  # every pair connects
    t = torch.ones(4)
    comm.all_reduce(t)
    comm.broadcast_tensor(t, src=n - 1)
    assert t.tolist() == [float(n)] * 4
    before = len(asked)
    assert comm.split(0).all_gather(r) == list(range(n))  # distcomm's own group: formed watched
    split = asked[before:]
    before = len(asked)
    group = dist.new_group(list(range(n)))  # the user's own (lazy where TORCH_GLOO_LAZY_INIT says): torch's way
    t = torch.ones(2)
    dist.all_reduce(t, group=group)
    user = asked[before:]
    comm.close()
    print(json.dumps({"from_gloo": [c for k, c in asked if k == "gloo"], "split_watched": ("python", "wait") in split,
                      "user": user}), flush=True)
"""


@pytest.mark.parametrize("how", ["shrink", "TORCH_GLOO_LAZY_INIT=1"])
def test_a_lazily_connected_group_never_asks_the_python_store_from_its_transport_threads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """After a shrink (or in any group, with the user's TORCH_GLOO_LAZY_INIT), a group connects each
    pair at its first call, asking the store for the peer's address on gloo's own threads. Asking a
    Python store there aborted a process that ended while one of them did ("terminate called without
    an active exception"). distcomm's own later groups still form in the watched store; a group the
    user makes with torch forms in the native one."""
    if how != "shrink":
        monkeypatch.setenv(*how.split("="))
    _, procs = _job(tmp_path, ASKED_FROM_TRANSPORT, 3, how)
    for r, (code, lines, err) in _ended(procs).items():
        assert code == 0 and lines == [{"from_gloo": [], "split_watched": True, "user": []}], (r, code, lines, err)

# ---------------------------------------------------------------- launch(..., elastic=True)
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "elastic_train.py"


@pytest.mark.slow
def test_the_elastic_example_outlives_a_killed_rank_and_admits_its_replacement() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, str(EXAMPLE), "--nproc", "4", "--steps", "80", "--kill-rank", "1",
                          "--kill-step", "3"], env=env, capture_output=True, text=True, timeout=WAIT * 2)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rank 1 (pid" in out.stderr and "was lost (killed by SIGKILL); started again" in out.stderr, out.stderr
    assert "shrunk to GlooCommunicator(rank=0, world_size=3, open, launcher=launch, lost=[1])" in out.stdout, out.stdout
    done = next(line for line in out.stdout.splitlines() if line.startswith("done: "))
    assert "admitted=[1]" in done and "the same on every rank: True" in done, done
    checked = json.loads(done.rpartition("per rank: ")[2])  # (a check every 5 steps, Adam's state included)
    assert len(checked) == 4 and min(checked[:1] + checked[2:]) >= 15 and checked[1] >= 1, done


def test_replacements_need_an_elastic_job() -> None:
    with pytest.raises(ValueError, match="pass elastic=True too"):
        distcomm.launch(print, 2, replacements=1)


def _raise_on_rank_1() -> None:
    comm = distcomm.current()
    if comm.rank == 1:
        raise KeyError("a bug, not a loss")
    comm.all_gather(0)


@pytest.mark.slow
def test_an_elastic_job_still_fails_on_a_rank_that_raises() -> None:
    with pytest.raises(distcomm.RankFailedError, match="rank 1 raised KeyError"):
        distcomm.launch(_raise_on_rank_1, 2, elastic=True, replacements=1, timeout=30)


def test_doubles_that_lose_no_one() -> None:
    """A LocalCommunicator and a fake lose no rank: shrink() and admit() give the communicator itself,
    as a real one that lost no one gives one of the same membership. A threaded world that loses no
    one gives a new one of the same membership, as a real job does (tests/test_elastic_doubles.py)."""
    local = distcomm.LocalCommunicator()
    assert local.shrink() is local and local.admit() is local and local.membership.job_ranks == (0,)
    fake = distcomm.testing.FakeCommunicator(rank=1, world_size=3)
    assert fake.shrink() is fake and fake.membership == distcomm.Membership((0, 1, 2))
    got = distcomm.testing.run_threaded(lambda c: (c.admit() is c, c.shrink().membership.job_ranks), 2)
    assert got == [(True, (0, 1))] * 2


def test_from_env_names_a_master_addr_that_does_not_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    """Across machines, the name is looked up before gloo's interface is (which would blame it)."""
    for name, value in {"MASTER_ADDR": "no-such-host.invalid", "MASTER_PORT": "29632", "RANK": "1",
                        "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(distcomm.CommunicatorStateError) as info:
        distcomm.GlooCommunicator.from_env(timeout=5)
    assert "'no-such-host.invalid' does not resolve on this machine" in str(info.value)
    assert "GLOO_SOCKET_IFNAME" not in str(info.value)


HOLDS_THE_GIL = """
    import ctypes, json, sys, time
    import distcomm, distcomm._elastic.liveness

    distcomm._elastic.liveness.LOSS_SECONDS = 1.5  # (30 s in a job): lost after 1.5 s, or 6 s if its process lives here
    comm = distcomm.from_env(timeout=60)
    comm.all_gather(0)
    if comm.rank == 1:
        ctypes.PyDLL(None).sleep(int(sys.argv[1]))  # a C call that holds the GIL: its keep-alive can't beat
    try:
        got = comm.all_gather(comm.rank)
        print(json.dumps({"got": got, "members": comm.membership.job_ranks}), flush=True)
    except distcomm.PeerError as e:
        print(json.dumps({"lost": e.ranks, "said": str(e)}), flush=True)
        time.sleep(3.0)  # (rank 0 serves the store: the others learn the loss from it first)
"""


def test_a_killed_process_its_controller_has_not_reaped_yet_is_not_alive() -> None:
    """A zombie's pid still answers kill(0); a job controller reaps its dead ranks when it gets to it
    (the job tests' forked ranks are reaped at once, so this is tested here)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert alive(proc.pid)
        proc.kill()
        def state() -> str:  # the field after the name in /proc/<pid>/stat
            return Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0]

        deadline = time.monotonic() + 10
        while state() != "Z" and time.monotonic() < deadline:
            time.sleep(0.02)
        assert state() == "Z"  # (not waited for: a zombie)
        assert not alive(proc.pid)
    finally:
        proc.kill()
        proc.wait(10)


@pytest.mark.slow  # (a few seconds of real processes: the slow tier)
def test_a_rank_whose_process_lives_here_is_not_lost_by_its_keep_alive_alone(tmp_path: Path) -> None:
    """A pybind11 op that doesn't release the GIL stops the keep-alive's beat; the watcher sees the
    process alive on this machine, and no one is declared lost."""
    _, procs = _job(tmp_path, HOLDS_THE_GIL, 3, "4")
    for r, (code, lines, err) in _ended(procs).items():
        assert code == 0 and lines == [{"got": [0, 1, 2], "members": [0, 1, 2]}], (r, code, err)


@pytest.mark.slow  # (a few seconds of real processes: the slow tier)
def test_a_rank_stuck_here_for_four_times_the_loss_time_is_lost_naming_its_process(tmp_path: Path) -> None:
    _, procs = _job(tmp_path, HOLDS_THE_GIL, 3, "9")
    ended = _ended(procs)
    for r in (0, 2):
        code, lines, err = ended[r]
        assert code == 0 and lines[0]["lost"] == [1], (r, lines, err)
        said = lines[0]["said"]
        assert "has not answered for 6 s" in said and "lives on this machine but is stuck" in said, said


NEWCOMER_FOR_THE_DEAD = """
    import json, os, signal, sys, time
    import distcomm

    comm = distcomm.from_env(timeout=30)
    progress, share = {"step": 0}, True
    while progress["step"] < 12:
        try:
            if share:
                comm.sync_state(progress)
                share = False
            me = comm.membership.job_ranks[comm.rank]
            if progress["step"] == 3:
                if me == 2 and not comm.membership.admitted:
                    os.kill(os.getpid(), signal.SIGKILL)
                time.sleep(6.0)  # the replacement is waiting before anyone noticed rank 2 is gone
            new = comm.admit()  # rank 0 finds a newcomer for member 2, which is dead: it waits on
            if new is not comm:
                comm, share = new, True
                continue
            comm.all_gather(me)
            progress["step"] += 1
        except distcomm.DistCommError:
            comm, share = comm.shrink(), True
    m = comm.membership
    print(json.dumps({"members": m.job_ranks, "admitted": m.admitted}), flush=True)
    comm.close()
"""


@pytest.mark.slow
def test_a_replacement_for_a_member_that_died_but_is_not_yet_shrunk_away_is_let_in(tmp_path: Path) -> None:
    port, procs = _job(tmp_path, NEWCOMER_FOR_THE_DEAD, 3)
    deadline = time.monotonic() + WAIT
    while procs[2].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    _, newcomer = _job(tmp_path, NEWCOMER_FOR_THE_DEAD, 3, ranks=[2], port=port)
    ended = _ended({**procs, 3: newcomer[2]})
    assert ended[2][0] == -signal.SIGKILL, ended[2]
    for r in (0, 1, 3):
        code, lines, err = ended[r]
        assert code == 0 and lines == [{"members": [0, 1, 2], "admitted": [2]}], (r, code, lines, err)


@pytest.mark.slow  # (a few seconds of real processes: the slow tier)
def test_a_replacement_with_another_world_size_is_refused_naming_both_sizes(tmp_path: Path) -> None:
    """It was let in, and the round it opened took its size: later replacements were refused instead."""
    port, procs = _job(tmp_path, DUPLICATE, 2)
    time.sleep(2.0)
    script = tmp_path / "job.py"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RANK": "1", "WORLD_SIZE": "3",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DISTCOMM_JOB_KEY": job_key_for(port)}
    odd = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, text=True, capture_output=True,
                         timeout=WAIT)
    ended = _ended(procs)
    assert ended[0][0] == 0 and ended[1][0] == 0, {r: e[2][-1500:] for r, e in ended.items()}
    assert odd.returncode == 0 and "says the job has 3 ranks, but the members of the running job: 2" in odd.stdout, (
        odd.stdout, odd.stderr[-2000:])
    assert " pid " in odd.stdout, odd.stdout  # the process named


@pytest.mark.slow
def test_a_second_replacement_for_one_rank_tells_the_first_at_once(tmp_path: Path) -> None:
    """The earlier waited out its timeout and was told the members "never arrived"; now it is told at
    once, naming both processes, and the later one is let in."""
    port, procs = _job(tmp_path, NEWCOMER_FOR_THE_DEAD, 3)
    deadline = time.monotonic() + WAIT
    while procs[2].poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    _, first = _job(tmp_path, NEWCOMER_FOR_THE_DEAD, 3, ranks=[2], port=port)
    time.sleep(1.0)
    _, second = _job(tmp_path, NEWCOMER_FOR_THE_DEAD, 3, ranks=[2], port=port)
    ended = _ended({**procs, 3: first[2], 4: second[2]})
    code, lines, err = ended[3]
    assert code == 1 and "two processes were started as rank 2" in err and err.count(" pid ") >= 2, err
    for r in (0, 1, 4):
        code, lines, err = ended[r]
        assert code == 0 and lines == [{"members": [0, 1, 2], "admitted": [2]}], (r, code, lines, err)


def test_two_processes_started_as_rank_0_are_both_named(tmp_path: Path) -> None:
    """The second could not listen on the port, and was told "the port may be held by another job"."""
    port, first = _job(tmp_path, DUPLICATE, 2, ranks=[0])
    time.sleep(2.0)
    _, second = _job(tmp_path, DUPLICATE, 2, ranks=[0], port=port)
    try:
        out, err = second[0].communicate(timeout=WAIT)
    finally:
        first[0].kill()
        first[0].wait(10)
    assert second[0].returncode == 0 and "two processes were started as rank 0" in out, (out, err[-2000:])
    assert out.count(" pid ") == 2, out
