"""pytest fixtures for distributed code, registered through the ``pytest11`` entry point.

Usage in a test::

    def test_trainer_logs_on_main(threaded_world):
        logs = threaded_world(lambda comm: Trainer(comm).fit(), world_size=4)

Fixtures:
    fake_comm: a FakeCommunicator(rank=0, world_size=2).
    threaded_world: ``run_threaded`` with a 60 s default timeout.
    spawn_world: ``spawn`` (real gloo processes) with a 120 s default timeout.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import pytest

from ._fake import FakeCommunicator
from ._spawn import spawn
from ._threaded import run_threaded


@pytest.fixture
def fake_comm() -> FakeCommunicator:
    """A FakeCommunicator for rank 0 of a world of 2 (peers contribute the same objects)."""
    return FakeCommunicator(rank=0, world_size=2)


@pytest.fixture
def threaded_world() -> Callable[..., list[Any]]:
    """``run_threaded(fn, world_size, **kwargs)``: ranks as threads in this process."""
    return functools.partial(run_threaded, timeout=60.0)


@pytest.fixture
def spawn_world() -> Callable[..., list[Any]]:
    """``spawn(fn, world_size, **kwargs)``: ranks as real gloo processes on 127.0.0.1."""
    return functools.partial(spawn, timeout=120.0)
