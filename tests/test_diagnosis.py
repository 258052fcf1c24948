"""Errors name what every rank is doing: its collective, call number and the user's call site."""

from __future__ import annotations

import re
import time
from typing import Any

import pytest

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded, spawn

from .test_faults import outcome


def _line(marker: str) -> int:
    """The line of this file that holds ``marker`` (call sites are compared by line)."""
    with open(__file__) as f:
        return next(i for i, text in enumerate(f, 1) if marker in text and "_line(" not in text)


def _per_rank(msg: str) -> dict[int, str]:
    """The error's table as rank -> line ("  ranks 0-2, 5: text" lines)."""
    out = {}
    for m in re.finditer(r"^  ranks? ([\d, -]+): (.*)$", msg, re.M):
        for span in m.group(1).split(", "):
            lo, _, hi = span.partition("-")
            for r in range(int(lo), int(hi or lo) + 1):
                out[r] = m.group(2)
    return out


def split_paths(comm: distcomm.Communicator) -> Any:
    comm.synchronize()
    if comm.rank == 3:
        first = outcome(lambda: comm.gather({"x": 1}, dst=0))  # site: gather
    else:
        first = outcome(lambda: comm.synchronize())  # site: barrier
    return first, comm.all_gather(comm.rank)


# gloo: a world of its own
@pytest.mark.parametrize("world", [pytest.param("gloo", marks=pytest.mark.slow), "threaded"])
def test_a_mismatch_names_each_group_of_ranks_with_its_call_site(world: str) -> None:
    out = spawn(split_paths, 4, timeout=120) if world == "gloo" else run_threaded(split_paths, 4, timeout=60)
    for first, after in out:
        assert first[0] == "CollectiveMismatchError", first
        assert re.search(rf"ranks 0-2: synchronize \(call #\d+\) at test_diagnosis.py:{_line('# site: barrier')}\n",
                         first[1]), first[1]
        assert re.search(rf"rank 3: gather root=0 \(call #\d+\) at test_diagnosis.py:{_line('# site: gather')}",
                         first[1]), first[1]
        assert after == [0, 1, 2, 3]


def one_rank_busy(comm: distcomm.Communicator) -> Any:
    distcomm.synchronize()  # site: first barrier (through the module helper)
    if comm.rank == 3:
        time.sleep(3)
        return None
    return outcome(lambda: comm.synchronize(timeout=1))  # site: second barrier


def test_a_timeout_names_what_every_rank_is_doing_in_the_threaded_world() -> None:
    out = run_threaded(one_rank_busy, 4, timeout=30)
    for r in range(3):
        name, msg = out[r][0], out[r][1]
        assert name == "CollectiveTimeoutError", out[r]
        second, first = _line("# site: second barrier"), _line("# site: first barrier")
        last = rf"\(last returned: synchronize #\d+ at test_diagnosis.py:{first}\)"
        table = _per_rank(msg)
        # the ranks that wait: still in the barrier, or (when their own timeout fired first) out of it
        for rank in range(3):
            waiting = rf"(in|CollectiveTimeoutError in) synchronize #\d+ at test_diagnosis.py:{second} {last}"
            assert re.fullmatch(waiting, table[rank]), msg
        assert re.fullmatch(rf"not in a collective {last}", table[3]), msg


def late_to_the_barrier(comm: distcomm.Communicator) -> Any:
    comm.synchronize()
    if comm.rank == 2:
        time.sleep(3)
    result = outcome(lambda: comm.synchronize(timeout=1.5))  # site: late barrier
    if comm.rank != 2:
        time.sleep(4)  # keep rank 0's store up while rank 2 reads what the others reported
    return result


@pytest.mark.slow
def test_a_timeout_over_gloo_names_what_every_rank_reported() -> None:
    """Ranks that time out write what they are doing to the store; a rank that arrives later reads it."""
    site = f"test_diagnosis.py:{_line('# site: late barrier')}"
    out = spawn(late_to_the_barrier, 3, timeout=120, reuse=False)
    for r in (0, 1):
        assert out[r][0] == "CollectiveTimeoutError", out[r]
        table = _per_rank(out[r][1])
        assert re.match(rf"in synchronize #\d+ at {site} ", table[r]), out[r][1]
        assert table[2].startswith("no report"), out[r][1]
    assert out[2][0] in ("CollectiveTimeoutError", "PeerError"), out[2]
    table = _per_rank(out[2][1])
    for r in range(3):  # what ranks 0 and 1 wrote to the store when they gave up, and rank 2's own
        assert re.match(rf"in synchronize #\d+ at {site} ", table[r]), out[2][1]


def test_the_site_is_the_users_line_through_helpers_and_for_the_fake() -> None:
    comm = FakeCommunicator(rank=0, world_size=2)
    with distcomm.use(comm):
        distcomm.all_gather(1)  # site: helper call
    assert comm._done is not None
    label, _, where = comm._done
    assert label == "all_gather" and where[1] == _line("# site: helper call") and where[0] == __file__


_LATE_SETUP = """
import datetime, sys, time
import torch.distributed as dist
import torch.multiprocessing as mp
import distcomm

def main(rank, port):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    if rank == 1:
        time.sleep(5)  # never creates its communicator in time
        return
    try:
        distcomm.GlooCommunicator(timeout=2)  # SETUP-SITE
    except distcomm.CollectiveTimeoutError as e:
        print(str(e), flush=True)

if __name__ == "__main__":
    mp.start_processes(main, args=(distcomm.free_port(),), nprocs=2, start_method="spawn")
"""


@pytest.mark.slow
def test_a_timeout_in_set_up_says_set_up_and_where(tmp_path: Any) -> None:
    import subprocess
    import sys

    script = tmp_path / "late_setup.py"
    script.write_text(_LATE_SETUP)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120).stdout
    line = next(i for i, text in enumerate(_LATE_SETUP.splitlines(), 1) if "SETUP-SITE" in text)
    assert _per_rank(out)[0] == f"in setup #0 at late_setup.py:{line}", out


def test_set_up_is_not_a_users_last_collective() -> None:
    """Set-up runs as a collective (its timeouts name it), but a rank's state names only the user's
    collectives as the last one returned."""
    states = spawn(lambda comm: comm._state(), 2, timeout=60, reuse=False)  # a world that ran nothing yet
    assert states == ["not in a collective", "not in a collective"]


def test_transport_text_is_whole_and_without_the_source_location() -> None:
    from distcomm._errors import clipped, transport_text

    gloo = RuntimeError("[/w/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                        "[127.0.0.1]:23246. This is typically caused by the peer exiting\nsecond line")
    assert transport_text(gloo) == ("Connection closed by peer [127.0.0.1]:23246. This is typically caused by "
                                    "the peer exiting")
    assert clipped("short", 10) == "short"
    cut = clipped("Connection closed by peer [127.0.0.1]:23246. This is typically caused", 40)
    assert cut == "Connection closed by peer…" and len(cut) <= 40
