"""Collectives in ``torch.profiler`` traces: while a profiler records, each collective runs inside a
span named after it (``distcomm.all_gather``), and a zero-length span inside it names the bytes it
moved on this rank, so a slow step's trace shows where it waits and on what. When no profiler
records, the cost is one check of the profiler's state (a C call, about 50 ns)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.profiler import record_function

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["profiling", "traced"]

profiling: Callable[[], bool] = getattr(torch._C._autograd, "_profiler_enabled", lambda: False)
"""Whether a torch profiler records now."""


def traced(comm: Communicator, name: str, call: Callable[[], Any]) -> Any:
    """``call()`` inside a span ``distcomm.<name>``, ending with a span of the bytes it moved."""
    sent, received = _moved(comm)
    with record_function(f"distcomm.{name}"):
        try:
            return call()
        finally:
            now_sent, now_received = _moved(comm)
            with record_function(f"distcomm.{name}: sent {now_sent - sent} B, received {now_received - received} B"):
                pass


def _moved(comm: Communicator) -> tuple[int, int]:
    stats = comm._stats.values()
    return sum(s.bytes_sent for s in stats), sum(s.bytes_received for s in stats)
