"""What a shrink keeps: the groups of a membership that lost a rank (their transport threads,
connections) are held for the group's timeout, then let go at the next safe point, so that a job
that shrinks again and again holds no more than the memberships of one timeout; those of one that
lost no one go with the shrink. Real gloo processes."""

from __future__ import annotations

from pathlib import Path

import pytest

from ._jobs import ended, job

pytestmark = pytest.mark.slow  # (a timeout's wait, in real processes)

SHRINKING = """
    import json, os, signal, sys, time
    import torch
    import distcomm
    from distcomm._elastic.deferred_free import DEFERRED

    TIMEOUT = 2.0
    def counts():
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    comm = distcomm.from_env(timeout=TIMEOUT)
    comm = comm.shrink()  # no one lost: the next membership's groups connect lazily
    start = counts()
    try:
        for step in range(10_000):  # rank 3 dies inside torch's own collective on the group
            if step == 3 and comm.rank == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            torch.distributed.all_reduce(torch.ones(4), group=comm.group)
            comm.synchronize()
    except Exception as e:
        assert distcomm.is_rank_loss(e), repr(e)
    comm = comm.shrink()  # rank 3 lost: this membership's groups are held for a timeout
    for _ in range(4):  # shrinks that lose no one: theirs go at once
        comm.all_reduce(torch.ones(4))
        comm = comm.shrink()
    held, kept = counts(), len(DEFERRED)
    time.sleep(TIMEOUT + 2.5)  # (past _deferred_free's margin too)
    comm.all_reduce(torch.ones(4))
    comm = comm.shrink()  # lets go of every membership broken more than a timeout ago
    print(json.dumps({"start": start, "held": held, "kept": kept, "after": counts(), "kept_after": len(DEFERRED),
                      "members": comm.membership.job_ranks}), flush=True)
    comm.close()
"""


def test_a_job_that_shrinks_again_and_again_holds_only_one_timeouts_memberships(tmp_path: Path) -> None:
    _, procs = job(tmp_path, SHRINKING, 4)
    out = ended(procs)
    assert out[3][0] != 0  # the rank that was killed
    for r in (0, 1, 2):
        code, lines, err = out[r]
        assert code == 0, (r, err)
        got = lines[-1]
        assert got["members"] == [0, 1, 2] and got["kept"] == 1 and got["kept_after"] == 0, got
        (fds0, threads0), (_, threads_held), (fds, threads) = got["start"], got["held"], got["after"]
        assert threads_held > threads0, got  # (the lost membership's, held: what the test would miss)
        assert fds <= fds0 + 6 and threads <= threads0 + 4, got  # one membership's worth


NO_ONE_LOST = """
    import json, os, torch
    import distcomm
    from distcomm._elastic.deferred_free import DEFERRED

    def counts():
        return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))

    comm = distcomm.from_env()
    comm.all_reduce(torch.ones(4096))  # (past the carried size: the group's connections made)
    start = counts()
    for _ in range(10):
        comm = comm.shrink()  # no one lost
        comm.all_reduce(torch.ones(4096))
    members = comm.membership.job_ranks
    print(json.dumps({"start": start, "shrunk": counts(), "kept": len(DEFERRED), "members": members}), flush=True)
    comm.close()
"""


def test_shrinks_that_lose_no_one_let_go_of_the_old_groups_at_once(tmp_path: Path) -> None:
    """A group none of whose members was lost has no peer to wait for: it goes with its shrink, not
    a timeout later (the default one: ten minutes)."""
    _, procs = job(tmp_path, NO_ONE_LOST, 3)
    for r, (code, lines, err) in ended(procs).items():
        assert code == 0 and lines, (r, err)
        got = lines[-1]
        (fds0, threads0), (fds, threads) = got["start"], got["shrunk"]
        assert got["members"] == [0, 1, 2] and got["kept"] == 0, got
        assert fds <= fds0 + 6 and threads <= threads0 + 4, got  # one membership's worth, not eleven
