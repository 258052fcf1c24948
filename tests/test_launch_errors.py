"""launch()'s RankFailedError: its first line names the rank that failed first, with what and where."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

import distcomm
from distcomm._launching.launch import describe
from distcomm.testing import run_threaded
from tests._scripts import run_script

# Rank 1 raises before its first collective; a thread of its own (a data loader's, say) holds its
# exit, so that rank 0, which lost it in all_gather, is the first process to end.
SCRIPT = textwrap.dedent("""
    import json, threading, time
    import distcomm

    def main():
        comm = distcomm.current()
        if comm.rank == 1:
            threading.Thread(target=time.sleep, args=(6,)).start()
            raise ValueError("shard 7 is empty")
        comm.all_gather(comm.rank)

    if __name__ == "__main__":
        try:
            distcomm.launch(main, 2, timeout=20)
        except distcomm.RankFailedError as e:
            print("RESULT", json.dumps({"message": str(e), "rank": e.rank, "traceback": e.remote_traceback,
                                        "exception": type(e.exception).__name__}), flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_headline_names_the_rank_that_failed_first(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    got = run_script(script, SCRIPT, timeout=180)
    headline = got["message"].splitlines()[0]
    assert headline.startswith("rank 1 raised ValueError: shard 7 is empty"), got["message"]
    raise_line = next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if "raise ValueError" in line)
    assert f"(in main() at job.py:{raise_line})" in headline, headline  # where it was, in the script
    assert got["rank"] == 1 and got["exception"] == "ValueError"
    # the peer that lost it comes after, on a line of its own
    assert "rank 0 raised" in got["message"] and "all_gather" in got["message"], got["message"]
    # the remote traceback names the script and shows the line (not "<dynamic-code>")
    assert f'File "{script}", line {raise_line}, in main' in got["traceback"], got["traceback"]
    assert 'raise ValueError("shard 7 is empty")' in got["traceback"], got["traceback"]
    assert "<dynamic-code>" not in got["message"]


def _wrong_scatter(comm: Any) -> str:
    try:
        comm.scatter([1, 2], src=0)
    except distcomm.CollectiveError as e:
        return describe(e)
    return "returned"


def test_a_headline_carries_the_reason_not_a_colon() -> None:
    """``scatter #1 failed on rank 0:`` used to end the line; the reason was only in the traceback."""
    for line in run_threaded(_wrong_scatter, 3):
        assert line.startswith("CollectiveError: scatter #1 failed on rank 0: rank 0: scatter on src 0 got 2 "
                               "objects for world_size 3 (in _wrong_scatter() at test_launch_errors.py:"), line


HANGS = textwrap.dedent("""
    import json, time
    import distcomm

    def stuck():
        time.sleep(600)

    def main():
        if distcomm.get_rank() == 0:
            raise ValueError("rank 0 gives up")
        stuck()

    if __name__ == "__main__":
        try:
            distcomm.launch(main, 2, timeout=60)
        except distcomm.RankFailedError as e:
            print("RESULT", json.dumps({"message": str(e)}), flush=True)
""")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_rank_the_launcher_ended_is_named_with_where_it_was_stuck(tmp_path: Path) -> None:
    got = run_script(tmp_path / "job.py", HANGS, timeout=180)["message"]
    assert got.startswith("rank 0 raised ValueError: rank 0 gives up"), got
    stuck_line = next(i for i, line in enumerate(HANGS.splitlines(), 1) if "time.sleep(600)" in line)
    assert "rank 1 (pid " in got and f"was ended (stuck in stuck() at job.py:{stuck_line})" in got, got
    assert "--- rank 1's threads when it was ended ---" in got and "in stuck" in got, got


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_launchers_own_error_says_the_main_guard_is_missing(tmp_path: Path) -> None:
    source = textwrap.dedent("""
        import json, distcomm
        try:
            distcomm.launch(print, 2, timeout=30)
        except distcomm.RankFailedError as e:
            print("RESULT", json.dumps({"message": str(e)}), flush=True)
    """)
    got = run_script(tmp_path / "job.py", source, timeout=180)["message"]
    first = got.splitlines()[0]
    assert "launch() is called at job.py:4 outside an `if __name__ == \"__main__\":` guard" in first, got


OWN_SIGUSR1 = textwrap.dedent("""
    import json, os, signal, sys, time
    import distcomm

    out = os.path.dirname(os.path.abspath(__file__))

    def checkpoint(signum, frame):  # a preemption handler, as Slurm's --signal=USR1@N calls it
        open(os.path.join(out, f"handled{os.getpid()}"), "w").close()

    signal.signal(signal.SIGUSR1, checkpoint)  # at import: each launched process installs it too

    def main():
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.2)
        distcomm.synchronize()

    if __name__ == "__main__":
        distcomm.launch(main, 2, timeout=60)
        print("RESULT", json.dumps({"handled": len([f for f in os.listdir(out) if f.startswith("handled")])}))
""")


@pytest.mark.slow
def test_launch_leaves_the_programs_own_sigusr1_alone(tmp_path: Path) -> None:
    """launch() asked for stacks with SIGUSR1 and replaced the program's preemption handler."""
    assert run_script(tmp_path / "job.py", OWN_SIGUSR1, timeout=120) == {"handled": 2}
