"""The kill campaign (tests/_campaign.py): ranks killed at random points, inside every kind of
collective, between them, while shrinking and while admitting; at 4 and 8 ranks, one and two at
once. No survivor may hang, fail or disagree.

The campaign is 85 seeded jobs (seeds 1000-1084: an even seed at 8 ranks, an odd one at 4). The
slow tier runs a sample of 12 that rotates with the hour, so that successive runs cover the whole
campaign; it prints the seeds it ran. ``DISTCOMM_CAMPAIGN_SEEDS=1003,1017`` replays those seeds;
``DISTCOMM_CAMPAIGN=all`` runs all 85; ``DISTCOMM_CAMPAIGN_JOBS=N`` a sample of N."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from ._campaign import Outcome, run_job


@pytest.mark.slow
@pytest.mark.parametrize(("world", "seed"), [(4, 1), (8, 2)])
def test_a_few_jobs_survive_their_kills(tmp_path: Path, world: int, seed: int) -> None:
    out = run_job(tmp_path, world, seed)
    assert out.kills >= 1 and out.hangs == 0 and out.wrong == 0, out.details


CAMPAIGN = range(1000, 1085)
SAMPLE = 12  # about 3 minutes on 2 cores; all 85, about 21


def campaign_seeds(env: dict[str, str], hour: int) -> list[int]:
    """The seeds this run takes: those named, the whole campaign, or a sample that rotates with ``hour``."""
    if env.get("DISTCOMM_CAMPAIGN_SEEDS"):
        return [int(s) for s in env["DISTCOMM_CAMPAIGN_SEEDS"].split(",") if s.strip()]
    if env.get("DISTCOMM_CAMPAIGN") == "all":
        return list(CAMPAIGN)
    jobs = min(int(env.get("DISTCOMM_CAMPAIGN_JOBS", SAMPLE)), len(CAMPAIGN))
    start = hour * jobs % len(CAMPAIGN)
    return [CAMPAIGN[(start + i) % len(CAMPAIGN)] for i in range(jobs)]


def test_the_sample_rotates_over_the_whole_campaign() -> None:
    seen = set()
    for hour in range(8):
        seen.update(campaign_seeds({}, hour))
    assert seen == set(CAMPAIGN)
    assert campaign_seeds({"DISTCOMM_CAMPAIGN_SEEDS": "1003, 1017"}, 5) == [1003, 1017]
    assert len(campaign_seeds({"DISTCOMM_CAMPAIGN": "all"}, 5)) == 85


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_the_kill_campaign(tmp_path: Path) -> None:
    seeds = campaign_seeds(dict(os.environ), int(time.time() // 3600))
    print(f"kill campaign: seeds {','.join(map(str, seeds))} (replay: DISTCOMM_CAMPAIGN_SEEDS=<seeds>)", flush=True)
    total = Outcome()
    for seed in seeds:
        total.add(run_job(tmp_path, 4 if seed % 2 else 8, seed))
    print(f"kill campaign: {total.jobs} jobs, {total.kills} kills, {total.hangs} hangs, {total.wrong} wrong")
    print("\n".join(total.details))
    assert total.hangs == 0 and total.wrong == 0, total.details
