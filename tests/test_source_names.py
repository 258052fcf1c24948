"""Functions of the launching script keep their file names in other processes: remote tracebacks
show ``File "train.py", line 5`` with the line, call sites read ``train.py:7`` (not <dynamic-code>)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests._scripts import run_script

SCRIPT = textwrap.dedent("""
    import json
    import distcomm
    from distcomm.testing import spawn

    def fails_on_rank_1(comm):
        if comm.rank == 1:
            raise KeyError("no such shard")  # FAILS HERE
        return comm.rank

    def mismatched(comm):
        if comm.rank == 0:
            return comm.all_gather(1)  # RANK 0 CALLS
        return comm.gather(1)  # RANK 1 CALLS

    if __name__ == "__main__":
        out = {}
        try:
            spawn(fails_on_rank_1, 2, timeout=60, reuse=False)
        except distcomm.RankFailedError as e:
            out["raised"] = {"message": str(e), "traceback": e.remote_traceback}
        try:
            spawn(mismatched, 2, timeout=60, reuse=False)
        except distcomm.RankFailedError as e:
            out["mismatch"] = {"message": str(e), "traceback": e.remote_traceback}
        print("RESULT", json.dumps(out), flush=True)
""")


def _line(marker: str) -> int:
    return next(i for i, line in enumerate(SCRIPT.splitlines(), 1) if marker in line)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_remote_tracebacks_and_call_sites_name_the_script(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    got = run_script(script, SCRIPT, timeout=200)

    raised = got["raised"]
    assert f'File "{script}", line {_line("FAILS HERE")}, in fails_on_rank_1' in raised["traceback"], raised
    assert 'raise KeyError("no such shard")  # FAILS HERE' in raised["traceback"], raised  # the line's text
    assert raised["message"].startswith(
        f"rank 1: KeyError: 'no such shard' (in fails_on_rank_1() at script.py:{_line('FAILS HERE')})"), raised

    mismatch = got["mismatch"]["message"]
    assert "ranks called different collectives" in mismatch, mismatch
    assert f"at script.py:{_line('RANK 0 CALLS')}" in mismatch, mismatch
    assert f"at script.py:{_line('RANK 1 CALLS')}" in mismatch, mismatch
    assert "<dynamic-code>" not in json.dumps(got)
