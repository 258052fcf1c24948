"""A snapshot's host copy: one rank's state at one step, its tensors' bytes in one host buffer.

The copy must be of one step, yet cost the loop little. What the loop itself changes (a model's
buffers, ``progress``) is copied at once, in ``comm.snapshot``; what only an optimizer's step
changes (the parameters' shards, Adam's moments: nearly all of it) is copied on the snapshot's
thread while the next step's forward and backward run, and every optimizer among the objects
waits for that copy at the start of its next ``step()`` (a step pre-hook). A GPU's tensors are
copied on a side stream into pinned memory; the optimizer's step waits for it on the GPU.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from .._sharded import is_dtensor, layout_of, local_of
from .._state_copy import rebuilt, sendable
from .._wire.serialization import SafeSerializer

__all__ = ["Copy", "HostCopies"]


@dataclasses.dataclass
class Copy:
    """One rank's state at one step: ``header`` the pickled ``[(skeleton, specs)]`` of each object
    (a state call's header: ``_state_copy``), ``flat`` its tensors' bytes in the specs' order, in
    host memory. ``ready``: a GPU copy's event (None: the bytes are there once its thread is done)."""

    step: int
    header: bytes
    flat: torch.Tensor
    ready: Any = None

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()

    def parts(self, allow: Iterable[Any] = ()) -> tuple[Any, list[torch.Tensor]]:
        """The header, loaded with the safe loader (a held copy is a peer's; ``allow``: as
        ``sync_state``'s), and each tensor's bytes (views of ``flat``)."""
        self.wait()
        header = SafeSerializer(allow).loads([memoryview(self.header)])
        parts, at = [], 0
        for _, specs in header:
            for _, dtype, shape, _, _ in specs:
                n = _nbytes(dtype, shape)
                parts.append(self.flat[at:at + n])
                at += n
        return header, parts


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    n = getattr(torch, dtype).itemsize
    for s in shape:
        n *= s
    return int(n)


class HostCopies:
    """Makes the host copies of one rank's snapshots, and holds its optimizers' next step until
    the copy of what the step changes is done."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._done.set()
        self._ready: Any = None
        self._hooked: weakref.WeakSet[Any] = weakref.WeakSet()

    def guard(self, objects: tuple[Any, ...]) -> None:
        """Hook every optimizer among ``objects`` (once): its step waits for the copy in progress."""
        for obj in objects:
            if hasattr(obj, "register_step_pre_hook") and obj not in self._hooked:
                obj.register_step_pre_hook(self._wait)
                self._hooked.add(obj)

    def _wait(self, *_: Any) -> None:
        self._done.wait()
        if self._ready is not None:
            torch.cuda.current_stream().wait_event(self._ready)
            self._ready = None

    def start(self, objects: tuple[Any, ...], step: int, old: Copy | None) -> tuple[Copy, Callable[[], None]]:
        """The copy of ``objects`` at ``step`` (into ``old``'s buffer where it is the same size: a
        step's state is), with what it copied at once; the rest of it, for the snapshot's thread to
        run (``finish``). A GPU's tensors are all copied on a side stream."""
        states = [obj.state_dict() if hasattr(obj, "state_dict") else obj for obj in objects]
        cuts = [_cut(state) for state in states]
        header = pickle.dumps([(skeleton, specs) for skeleton, specs, _ in cuts])
        locals_ = [t for _, _, ts in cuts for t in ts]
        sizes = [t.numel() * t.element_size() for t in locals_]
        on_gpu = any(t.is_cuda for t in locals_)
        total = sum(sizes)
        flat = old.flat if old is not None and old.flat.numel() == total else torch.empty(
            total, dtype=torch.uint8, pin_memory=on_gpu)
        at = [sum(sizes[:k]) for k in range(len(sizes))]
        pieces = [(flat[a:a + n], t) for a, n, t in zip(at, sizes, locals_, strict=True)]
        if on_gpu:
            return Copy(step, header, flat, self._on_side_stream(pieces, _stepped(objects))), lambda: None
        stepped = _stepped(objects)
        later = [(into, t) for into, t in pieces if t.data_ptr() in stepped]
        _fill([(into, t) for into, t in pieces if t.data_ptr() not in stepped])
        self._done.clear()
        return Copy(step, header, flat), lambda: _fill(later)

    def finish(self, rest: Callable[[], None]) -> None:
        """Run ``rest`` (``start``'s), then let the optimizers step."""
        try:
            rest()
        finally:
            self._done.set()

    def _on_side_stream(self, pieces: list[tuple[torch.Tensor, torch.Tensor]], stepped: set[int]) -> Any:
        """Copy ``pieces`` on a side stream after the work queued so far; the event that says it is
        done. The loop's stream waits for it before an optimizer's step, or at once where it copies
        something else the loop changes (a buffer)."""
        stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            _fill(pieces, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record(stream)
        if any(t.data_ptr() not in stepped for _, t in pieces):
            torch.cuda.current_stream().wait_event(ready)
        self._ready = ready
        return ready


def _fill(pieces: list[tuple[torch.Tensor, torch.Tensor]], non_blocking: bool = False) -> None:
    for into, t in pieces:
        if t.numel():
            into.copy_(t.reshape(-1).view(torch.uint8), non_blocking=non_blocking)


def _stepped(objects: tuple[Any, ...]) -> set[int]:
    """Where the tensors that only an optimizer's step changes live: its parameters' local shards
    and its state's tensors (a model's state aliases its parameters)."""
    found: set[int] = set()
    for obj in objects:
        for group in getattr(obj, "param_groups", None) or ():
            found.update(_local(p).data_ptr() for p in group.get("params", ()) if isinstance(p, torch.Tensor))
        for per_param in (getattr(obj, "state", None) or {}).values() if hasattr(obj, "param_groups") else ():
            found.update(_local(v).data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor))
    found.discard(0)  # (empty tensors: nothing to copy, and no address)
    return found


def _cut(state: Any) -> tuple[Any, list[Any], list[torch.Tensor]]:
    """``state``'s skeleton, the specs of the tensors cut out of it (a state call's header) and
    their local parts, not copied (``start`` copies each once, into the host buffer)."""
    specs: list[Any] = []
    locals_: list[torch.Tensor] = []
    count = iter(range(1 << 62))

    def leaf(value: Any) -> Any:
        n = next(count)
        if not sendable(value):
            return value
        local = _local(value)
        local = local if local.is_contiguous() else local.contiguous()
        specs.append((n, str(local.dtype).removeprefix("torch."), tuple(local.shape), local.device.type,
                      _layout(value) if is_dtensor(value) else None))
        locals_.append(local)
        return None

    return rebuilt(state, leaf), specs, locals_


def _local(t: torch.Tensor) -> torch.Tensor:
    """``local_of(t)``, without the dispatch of a DTensor's ``detach`` and ``to_local`` where its
    local tensor is at hand: a snapshot reads every shard of the state at every step."""
    local = getattr(t, "_local_tensor", None) if is_dtensor(t) else t
    return local if isinstance(local, torch.Tensor) else local_of(t)


_LAYOUTS: dict[int, tuple[Any, str]] = {}
"""``layout_of`` by the DTensor's spec (a parameter's is shared by the DTensors its state dicts
make): the same text at every step, made once."""


def _layout(dt: Any) -> str:
    spec = getattr(dt, "_spec", None)
    if spec is None:
        return layout_of(dt)
    known = _LAYOUTS.get(id(spec))
    if known is None or known[0] is not spec:  # (kept with its spec: an id is not reused while held)
        known = _LAYOUTS[id(spec)] = (spec, layout_of(dt))
    return known[1]
