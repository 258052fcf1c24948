"""Byte buffers the pipeline sends from and receives into: views, aligned copies, tensors as the
transports need them, and the garbage collector's pause while large results load."""

from __future__ import annotations

import contextlib
import datetime
import gc
import math
import os
import threading
import warnings

import numpy as np
import torch

from . import frame as _frame

__all__ = ["GC_PAUSE_BYTES", "PHYSICAL_MEMORY", "GCPause", "as_view", "byte_tensor", "is_aligned", "materialized",
           "NOTHING", "owned_copy", "seconds"]


def as_view(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes as a memoryview (no copy)."""
    return memoryview(t.numpy())  # type: ignore[arg-type]


def owned_copy(view: memoryview) -> memoryview:
    """A copy of ``view`` in fresh, aligned memory of its own."""
    t = torch.empty(view.nbytes, dtype=torch.uint8)
    out = memoryview(t.numpy())  # type: ignore[arg-type]
    out[:] = _frame.flat(view)
    return out


def materialized(t: torch.Tensor, fresh: bool = False) -> torch.Tensor:
    """``t`` as a native collective must get it: contiguous, with a conjugate or negative view's
    bit applied (the transports read a view's memory, not its flags: a conj() view would travel
    unconjugated). ``fresh``: a copy even when ``t`` is fit as it is."""
    if t.is_conj() or t.is_neg():
        return t.resolve_conj().resolve_neg().contiguous()  # a new tensor
    if t.is_contiguous() and not fresh:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def is_aligned(view: memoryview) -> bool:
    return view.nbytes == 0 or np.frombuffer(view, dtype=np.uint8).ctypes.data % _frame.ALIGN == 0


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 50


PHYSICAL_MEMORY = _physical_memory()


def byte_tensor(view: memoryview) -> torch.Tensor:
    """A uint8 tensor over the view's memory (no copy). Read-only memory is only ever sent."""
    if view.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    if view.readonly:
        with warnings.catch_warnings():  # torch warns about non-writable memory; the transport only reads it
            warnings.simplefilter("ignore")
            return torch.frombuffer(view, dtype=torch.uint8)
    return torch.frombuffer(view, dtype=torch.uint8)


class GCPause:
    """Hold off Python's cyclic garbage collector while large payloads are unpickled.

    Unpickling allocates one container per dict or list in the payload; every 700 of them start a
    collection that walks the young objects, and later the whole heap. For results made of many
    small objects (detections, metrics rows) that is most of the unpickling time. The collector is
    only postponed: it runs as usual once loading ends. Nested and concurrent pauses (threads) are
    counted, so the last one out restores the state found by the first one in.
    """

    _lock = threading.Lock()
    _depth = 0
    _threshold: tuple[int, ...] = (700, 10, 10)

    # It sets the collector's first threshold to 0 (no automatic collections) rather than calling
    # gc.disable(): a gc.disable() or gc.enable() of the user's, from any thread, meanwhile stays as it is.
    def __enter__(self) -> None:
        cls = GCPause
        with cls._lock:
            if cls._depth == 0:
                cls._threshold = gc.get_threshold()
                gc.set_threshold(0, *cls._threshold[1:])
            cls._depth += 1

    def __exit__(self, *exc: object) -> None:
        cls = GCPause
        with cls._lock:
            cls._depth -= 1
            if cls._depth == 0 and gc.get_threshold()[0] == 0:  # thresholds the user set meanwhile stay
                gc.set_threshold(*cls._threshold)
                _age_young_objects()


def _age_young_objects() -> None:
    """Collect the young generations now, while the loaded objects are still this call's.

    The pause left every object the load allocated in the young generation, far past its
    threshold: the collection that walks them (and frees nothing: they are the results) would
    start at the next allocation, landing on this call's return or on whatever the user runs next.
    One collection of the young generation here walks them once, in this call, and ages them
    with the collector's own accounting, so the full collections that free the user's garbage
    cycles come as often as they would without the pause. Nothing when no collection is due."""
    if gc.isenabled() and gc.get_count()[0] >= gc.get_threshold()[0] > 0:
        gc.collect(0)


GC_PAUSE_BYTES = 16 * 1024
"""Loading what arrived after the slots pauses the collector when that is at least this many bytes."""
NOTHING = contextlib.nullcontext()


def seconds(timeout: float | datetime.timedelta | None, default: float | None) -> float | None:
    if timeout is None:
        return default
    if isinstance(timeout, datetime.timedelta):
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be seconds (float) or a timedelta, got {type(timeout).__name__}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"timeout must be a positive, finite number of seconds (or None for no limit), got {timeout}")
    return float(timeout)
