"""comm.device_mesh(): what it refuses, alike on every rank and before anything moves, in the
in-process world (its groups are torch groups there too)."""

from __future__ import annotations

from typing import Any

import pytest

import distcomm
from distcomm.testing import run_threaded


def _error(fn: Any) -> str:
    try:
        fn()
    except (ValueError, distcomm.CommunicatorStateError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize(("shape", "names", "says"), [
    ((3, 2), ("replicate", "shard"), "ValueError: device_mesh: a mesh of shape (3, 2) has 6 ranks; this job has 4"),
    ((2, 2), ("shard",), "ValueError: device_mesh: mesh_dim_names must be 2 distinct strings"),
    ((2, 2), ("x", "x"), "ValueError: device_mesh: mesh_dim_names must be 2 distinct strings"),
    ((4, 0), None, "ValueError: device_mesh: mesh_shape must be positive ints"),
])
def test_a_bad_mesh_is_refused_on_every_rank(shape: tuple[int, ...], names: Any, says: str) -> None:
    got = run_threaded(lambda comm: _error(lambda: comm.device_mesh(shape, names)), 4, timeout=60)
    assert all(text.startswith(says) for text in got), got


def test_a_mesh_is_the_jobs_one_per_job_and_not_on_a_split() -> None:
    def fn(comm: distcomm.Communicator) -> tuple[bool, str, str]:
        mesh = comm.device_mesh((2, 2), ("replicate", "shard"))
        again = comm.device_mesh((2, 2), ("replicate", "shard")) is mesh
        other = _error(lambda: comm.device_mesh((4,), ("shard",)))
        sub = comm.split(comm.rank // 2)
        assert sub is not None
        return again, other, _error(lambda: sub.device_mesh((2,), ("shard",)))

    for again, other, on_sub in run_threaded(fn, 4, timeout=60):
        assert again
        assert other.startswith("ValueError: device_mesh(4,): this job's communicator already has a mesh of shape "
                                "(2, 2) ('replicate', 'shard'); one mesh per job"), other
        assert on_sub.startswith("CommunicatorStateError: device_mesh lays out the job's ranks"), on_sub


def test_the_mesh_groups_answer_from_the_layout() -> None:
    def fn(comm: distcomm.Communicator) -> tuple[int, int, int, int]:
        mesh = comm.device_mesh((2, 2), ("replicate", "shard"))
        rep, shard = mesh.get_group("replicate"), mesh.get_group("shard")
        return rep.rank(), rep.size(), shard.rank(), shard.size()

    assert run_threaded(fn, 4, timeout=60) == [(0, 2, 0, 2), (0, 2, 1, 2), (1, 2, 0, 2), (1, 2, 1, 2)]
