"""Payloads over 2 GiB (int64 sizes end to end). Opt-in: `make test-large` (needs ~12 GiB of RAM)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import distcomm
from distcomm.testing import spawn

pytestmark = pytest.mark.large

BIG = (2 << 30) + 4096  # just over 2 GiB


def big_gather(comm: distcomm.Communicator) -> Any:
    obj = np.full(BIG, 7, dtype=np.uint8) if comm.rank == 1 else "small"
    out = comm.gather(obj, dst=0)
    if comm.rank == 0:
        arr = out[1]
        return (arr.nbytes, int(arr[0]), int(arr[-1]), int(arr[BIG // 2]), out[0])
    return comm.stats["gather"].bytes_sent


def test_gather_over_2_gib() -> None:
    dst, sender = spawn(big_gather, 2, timeout=900)
    assert dst == (BIG, 7, 7, 7, "small")
    assert sender >= BIG
