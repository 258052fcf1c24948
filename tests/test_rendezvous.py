"""The store ranks meet at: generations in one scope, other jobs on the same port, a port where
something else listens, and a host that goes away; every wait bounded and named."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

import distcomm
from distcomm._launching.rendezvous import meet


def _ranks_at_once(world: int, meet: Callable[[int], Any]) -> list[Any]:
    """``meet(rank)`` for every rank, each on a thread of its own; what each returned or raised."""
    out: list[Any] = [None] * world

    def one(rank: int) -> None:
        try:
            out[rank] = meet(rank)
        except Exception as e:
            out[rank] = e

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def _launchers_store(port: int) -> Any:
    """A store the launcher hosts, as torchrun's agent does (kept across its workers' rendezvous)."""
    return distcomm._launching.rendezvous._c10d().TCPStore("127.0.0.1", port, 2, True, datetime.timedelta(seconds=30),
                                                 wait_for_workers=False)


def test_a_second_rendezvous_in_one_scope_is_a_new_generation() -> None:
    """As after close() and from_env() again in one torchrun attempt: the second round's keys are
    its own (it used to read the first round's addresses)."""
    port = distcomm.free_port()
    agent = _launchers_store(port)
    seen = []
    for round_ in range(3):
        stores = _ranks_at_once(2, lambda r: meet("127.0.0.1", port, r, 2, 20, scope="job", hosted=False).store)
        assert not any(isinstance(s, Exception) for s in stores), stores
        assert not stores[1].check(["address"])  # nothing of an earlier round
        stores[0].set("address", f"round {round_}")
        seen.append(stores[1].get("address").decode())
    assert seen == ["round 0", "round 1", "round 2"]
    del agent


def test_another_job_on_the_same_port_never_meets_this_one() -> None:
    port = distcomm.free_port()
    agent = _launchers_store(port)
    with pytest.raises(distcomm.CollectiveTimeoutError):  # job a: its rank 1 never comes
        meet("127.0.0.1", port, 0, 2, 0.5, scope="a", hosted=False)
    with pytest.raises(distcomm.CollectiveTimeoutError, match=r"rank 1 waited for rank\(s\) 0 of 2, which never"):
        meet("127.0.0.1", port, 1, 2, 1.0, scope="b", hosted=False)  # job b's rank 0 never comes either
    del agent


def test_a_failed_rendezvous_lets_go_of_its_port() -> None:
    port = distcomm.free_port()
    with pytest.raises(distcomm.CollectiveTimeoutError) as failed:
        meet("127.0.0.1", port, 0, 2, 0.5)  # rank 0 hosts; rank 1 never comes
    assert failed.value.ranks == (1,)
    stores = _ranks_at_once(2, lambda r: meet("127.0.0.1", port, r, 2, 20).store)  # the same port, at once
    assert not any(isinstance(s, Exception) for s in stores), stores


def test_a_port_where_something_else_listens_gives_up_in_bounded_time() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)  # accepts connections, never answers
        port = listener.getsockname()[1]
        with pytest.raises(distcomm.CollectiveTimeoutError, match="doesn't answer as a rendezvous store"):
            meet("127.0.0.1", port, 1, 2, 1.0, what="slurm's rendezvous")


HOST_THEN_DIE = """
import datetime, sys, time, torch
store = torch._C._distributed_c10d.TCPStore("127.0.0.1", int(sys.argv[1]), 2, True, datetime.timedelta(seconds=30),
                                            wait_for_workers=False)
print("ready", flush=True)
time.sleep(60)
"""


def test_the_host_going_away_is_named() -> None:
    port = distcomm.free_port()
    host = subprocess.Popen([sys.executable, "-c", HOST_THEN_DIE, str(port)], stdout=subprocess.PIPE, text=True)
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "ready"
        threading.Timer(1.0, host.kill).start()
        with pytest.raises(distcomm.PeerError, match=r"went away while rank 1 waited"):
            meet("127.0.0.1", port, 1, 2, 20, scope="x")
    finally:
        host.kill()
        host.wait(10)
