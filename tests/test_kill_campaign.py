"""The kill campaign (tests/_campaign.py): ranks killed at random points, inside every kind of
collective, between them, while shrinking and while admitting; at 4 and 8 ranks, one and two at
once. No survivor may hang, fail or disagree. A handful of jobs here; hundreds of kills in the
slow tier (``DISTCOMM_CAMPAIGN_JOBS`` sets how many jobs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ._campaign import Outcome, run_job


@pytest.mark.parametrize(("world", "seed"), [(4, 1), pytest.param(8, 2, marks=pytest.mark.slow)])
def test_a_few_jobs_survive_their_kills(tmp_path: Path, world: int, seed: int) -> None:
    out = run_job(tmp_path, world, seed)
    assert out.kills >= 1 and out.hangs == 0 and out.wrong == 0, out.details


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_kill_campaign(tmp_path: Path) -> None:
    jobs = int(os.environ.get("DISTCOMM_CAMPAIGN_JOBS", "85"))  # about 220 kills, 21 minutes on 2 cores
    total = Outcome()
    for i in range(jobs):
        total.add(run_job(tmp_path, 4 if i % 2 else 8, 1000 + i))
    print(f"kill campaign: {total.jobs} jobs, {total.kills} kills, {total.hangs} hangs, {total.wrong} wrong")
    print("\n".join(total.details))
    assert total.hangs == 0 and total.wrong == 0, total.details
