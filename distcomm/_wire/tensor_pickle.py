"""How a tensor travels inside a pickle: its raw bytes as a PickleBuffer (out of band when large),
rebuilt on the receiver without a copy, on the device the receiving communicator names. Both
serializers use it; the safe loader checks its arguments before calling ``rebuild_tensor``."""

from __future__ import annotations

import contextvars
import pickle
from collections.abc import Callable
from typing import Any

import torch

from .._errors import SerializationError

__all__ = ["CUDA_TARGET", "rebuild_tensor", "reduce_tensor"]

# Tells where tensors that were on a CUDA device when sent are rebuilt on this rank (None: CPU);
# set by the receiving communicator, called only when such a tensor arrives.
CUDA_TARGET: contextvars.ContextVar[Callable[[], torch.device | None] | None] = contextvars.ContextVar(
    "distcomm_cuda_target", default=None
)


def rebuild_tensor(
    data: Any, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool, was_cuda: bool
) -> torch.Tensor:
    """Rebuild a tensor from its raw bytes without copying them (the inverse of reduce_tensor)."""
    if not isinstance(dtype, torch.dtype):
        raise SerializationError(f"tensor frame carries dtype {dtype!r}, not a torch.dtype")
    mv = memoryview(data)
    if mv.nbytes == 0:
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        # Read-only data (bytes from the stream, which CPython may share: every 1-byte bytes object is
        # one object) is copied: the tensor is writable, and writing to it must not change the bytes.
        flat = torch.frombuffer(bytearray(mv) if mv.readonly else mv, dtype=torch.uint8)
    t = flat.view(dtype).reshape(shape)
    if was_cuda:
        where = CUDA_TARGET.get()
        target = where() if where is not None else None
        if target is not None:
            t = t.to(target)
    if requires_grad:
        t.requires_grad_(True)
    return t


def reduce_tensor(t: torch.Tensor) -> Any:
    """Reduce a dense tensor to its raw bytes as a PickleBuffer (out of band when large)."""
    if t.layout != torch.strided or t.is_quantized or t.is_meta or t.is_nested:
        return t.__reduce_ex__(2)  # type: ignore[no-untyped-call]
    src = t.detach()
    was_cuda = src.device.type != "cpu"
    if was_cuda:
        src = src.cpu()  # CUDA tensors travel through CPU; no context is created on peers' devices
    src = src.resolve_conj().resolve_neg().contiguous()
    if src.numel():
        data: Any = pickle.PickleBuffer(src.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
    else:
        data = b""
    return rebuild_tensor, (data, src.dtype, tuple(src.shape), t.requires_grad, was_cuda)
