"""Collectives appear in torch.profiler traces as spans named after them, with the bytes they moved."""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import distcomm
from distcomm.testing import FakeCommunicator, spawn


def _span_names(comm: distcomm.Communicator) -> list[str]:
    comm.all_gather({"x": 1})  # before the profiler: no span
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        comm.all_gather({"x": comm.rank})
        comm.reduce_dict({"loss": torch.tensor(1.0)})
        comm.barrier()
    return [e.name for e in prof.events() if e.name.startswith("distcomm.")]


def _check(names: list[str], moves_bytes: bool) -> None:
    spans = [n for n in names if ":" not in n]
    assert spans == ["distcomm.all_gather", "distcomm.reduce_dict", "distcomm.synchronize"], names
    sizes = [n for n in names if n.startswith("distcomm.all_gather: sent ")]
    assert len(sizes) == 1, names
    if moves_bytes:
        assert sizes[0] != "distcomm.all_gather: sent 0 B, received 0 B", sizes


def test_spans_over_gloo() -> None:
    for names in spawn(_span_names, 2, timeout=120):
        _check(names, moves_bytes=True)


def test_spans_on_the_doubles() -> None:
    _check(_span_names(FakeCommunicator(0, 2)), moves_bytes=True)
    _check(_span_names(distcomm.LocalCommunicator()), moves_bytes=False)


def test_no_span_without_a_profiler() -> None:
    from distcomm import _one_at_a_time, _tracing

    seen: list[Any] = []
    original = _one_at_a_time.traced
    _one_at_a_time.traced = lambda *a: seen.append(a)  # type: ignore[assignment]
    try:
        comm = distcomm.LocalCommunicator()
        comm.all_gather(1)
        with profile(activities=[ProfilerActivity.CPU]):
            comm.all_gather(2)
    finally:
        _one_at_a_time.traced = original
    assert len(seen) == 1 and not _tracing.profiling()  # only the call under the profiler was traced


def test_synchronize_has_one_name() -> None:
    """The name users call is the name in stats, in the fake's calls, in spans and in errors."""
    comm = FakeCommunicator(0, 2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        comm.synchronize()
        comm.barrier()  # torch's name, an alias: the same collective
    spans = [e.name for e in prof.events() if e.name.startswith("distcomm.") and ":" not in e.name]
    assert spans == ["distcomm.synchronize"] * 2
    assert [c.op for c in comm.calls] == ["synchronize"] * 2
    assert list(comm.stats) == ["synchronize"] and comm.stats["synchronize"].calls == 2
