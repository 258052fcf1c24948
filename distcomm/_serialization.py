"""Serializers: turn an object into segments (a pickle stream plus out-of-band buffers) and back.

``PickleSerializer`` (the default) uses pickle protocol 5: numpy arrays and CPU tensors of at
least ``oob_threshold`` bytes are not copied into the stream but travel as their own segments, sent
from their own memory and received into buffers that become the result's memory. Objects plain
pickle can't handle (lambdas, local classes) go through cloudpickle.

``SafeSerializer`` loads with an allowlist: only builtin containers and scalars, numpy arrays and
dtypes, torch tensors and dtypes, and classes the user registers. Anything else is refused by name
before it is built, so a peer can't make this process run code.
"""

from __future__ import annotations

import abc
import contextvars
import copyreg
import io
import os
import pickle
import socket
import warnings
from collections import ChainMap
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import cloudpickle
import torch

from ._errors import SerializationError, UnsafePayloadError

__all__ = ["PickleSerializer", "SafeSerializer", "Serializer", "default_serializer"]

DEFAULT_OOB_THRESHOLD = 64 * 1024

# Tells where tensors that were on a CUDA device when sent are rebuilt on this rank (None: CPU);
# set by the receiving communicator, called only when such a tensor arrives.
_CUDA_TARGET: contextvars.ContextVar[Callable[[], torch.device | None] | None] = contextvars.ContextVar(
    "distcomm_cuda_target", default=None
)


def _rebuild_tensor(
    data: Any, dtype: torch.dtype, shape: tuple[int, ...], requires_grad: bool, was_cuda: bool
) -> torch.Tensor:
    """Rebuild a tensor from its raw bytes without copying them (the inverse of _reduce_tensor)."""
    if not isinstance(dtype, torch.dtype):
        raise SerializationError(f"tensor frame carries dtype {dtype!r}, not a torch.dtype")
    mv = memoryview(data)
    if mv.nbytes == 0:
        flat = torch.empty(0, dtype=torch.uint8)
    else:
        if mv.readonly:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                flat = torch.frombuffer(mv, dtype=torch.uint8)
        else:
            flat = torch.frombuffer(mv, dtype=torch.uint8)
    t = flat.view(dtype).reshape(shape)
    if was_cuda:
        where = _CUDA_TARGET.get()
        target = where() if where is not None else None
        if target is not None:
            t = t.to(target)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(t: torch.Tensor) -> Any:
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
    return _rebuild_tensor, (data, src.dtype, tuple(src.shape), t.requires_grad, was_cuda)


_TABLE: dict[type, Callable[[Any], Any]] = {torch.Tensor: _reduce_tensor}


def _refuse(obj: Any) -> Any:
    raise pickle.PicklingError(
        f"can't send a {type(obj).__module__}.{type(obj).__qualname__} ({obj!r:.80}): open files, sockets and other "
        f"resources of this process don't travel to other processes; send a path or the data instead")


# Process resources that plain pickle refuses and cloudpickle would turn into something else on the
# peers (an open file becomes a StringIO of its contents): refused by both, alike.
_RESOURCES: dict[type, Callable[[Any], Any]] = {
    t: _refuse for t in (io.TextIOWrapper, io.BufferedReader, io.BufferedWriter, io.BufferedRandom, io.FileIO,
                         socket.socket)}

_PICKLE_TABLE: Any = ChainMap(_TABLE, _RESOURCES, copyreg.dispatch_table)
_CLOUDPICKLE_TABLE: Any = ChainMap(_TABLE, _RESOURCES, cloudpickle.Pickler.dispatch_table)


# The C pickler reads dispatch_table when it is created, so it must be a class attribute.
class _Pickler(pickle.Pickler):
    dispatch_table = _PICKLE_TABLE


class _CloudPickler(cloudpickle.Pickler):  # type: ignore[misc]
    dispatch_table = _CLOUDPICKLE_TABLE


class Serializer(abc.ABC):
    """Turns one object into segments and back. Subclass it to plug in another format.

    ``dumps`` returns a list of 1-D byte memoryviews: the first is the stream, the others are
    buffers that travel out of band. ``loads`` receives the same segments (on another rank) and must
    not keep references it does not need: the received buffers become the result's memory.
    """

    name: str = "custom"

    @abc.abstractmethod
    def dumps(self, obj: Any) -> list[memoryview]:
        """Serialize obj. Raise any exception on failure (distcomm reports it on every rank)."""

    @abc.abstractmethod
    def loads(self, segments: Sequence[memoryview]) -> Any:
        """Rebuild the object from segments produced by ``dumps`` on some rank."""


def _dump_with(pickler_cls: type[pickle.Pickler], obj: Any, threshold: int) -> list[memoryview]:
    buffers: list[memoryview] = []

    def keep(pb: pickle.PickleBuffer) -> bool:
        raw = pb.raw()
        if raw.nbytes < threshold:
            return True  # small: serialize in band, inside the stream
        buffers.append(raw)
        return False

    bio = io.BytesIO()
    pickler_cls(bio, protocol=5, buffer_callback=keep).dump(obj)
    return [bio.getbuffer(), *buffers]


class PickleSerializer(Serializer):
    """Pickle protocol 5 with out-of-band buffers; cloudpickle for what plain pickle can't do.

    Args:
        oob_threshold: buffers (numpy arrays, CPU tensors) of at least this many bytes travel out
            of band, without being copied into the stream.
        cloudpickle_fallback: retry with cloudpickle when plain pickle fails (lambdas, closures,
            classes defined inside functions).
    """

    name = "pickle"

    def __init__(self, *, oob_threshold: int = DEFAULT_OOB_THRESHOLD, cloudpickle_fallback: bool = True) -> None:
        if oob_threshold < 0:
            raise ValueError(f"oob_threshold must be >= 0, got {oob_threshold}")
        self.oob_threshold = oob_threshold
        self.cloudpickle_fallback = cloudpickle_fallback

    def dumps(self, obj: Any) -> list[memoryview]:
        try:
            return _dump_with(_Pickler, obj, self.oob_threshold)
        except (pickle.PicklingError, AttributeError, TypeError):
            if not self.cloudpickle_fallback:
                raise
        return _dump_with(_CloudPickler, obj, self.oob_threshold)

    def loads(self, segments: Sequence[memoryview]) -> Any:
        if not segments:
            raise SerializationError("no stream segment to load")
        return pickle.loads(segments[0], buffers=segments[1:])

    def __repr__(self) -> str:
        return f"PickleSerializer(oob_threshold={self.oob_threshold})"


def _name_of(item: Any) -> tuple[str, str]:
    if isinstance(item, str):
        module, _, name = item.rpartition(".")
        if not module:
            raise ValueError(f"allow entry {item!r} must be 'module.Name'")
        return module, name
    mod = getattr(item, "__module__", None)
    qualname = getattr(item, "__qualname__", None)
    if not isinstance(mod, str) or not isinstance(qualname, str):
        raise TypeError(f"allow entry {item!r} must be a class, a function or a 'module.Name' string")
    return mod, qualname


_SAFE_BUILTINS = frozenset(
    {"dict", "list", "tuple", "set", "frozenset", "bytearray", "bytes", "complex", "slice", "range",
     "int", "float", "str", "bool", "object"}
)
_SAFE_GLOBALS = frozenset(
    {
        ("collections", "OrderedDict"),
        ("collections", "deque"),
        ("collections", "Counter"),
        ("datetime", "datetime"),
        ("datetime", "date"),
        ("datetime", "time"),
        ("datetime", "timedelta"),
        ("datetime", "timezone"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.multiarray", "scalar"),
        ("torch", "Size"),
        ("torch", "device"),
        ("torch._utils", "_rebuild_parameter"),
        (__name__, "_rebuild_tensor"),
    }
)


# What a safe payload may hand to a constructor: data it carries itself. A range, an iterator or a
# count would let a few bytes allocate without bound (bytearray(1 << 30), list(range(10**9))).
_CARRIED = (list, tuple, dict, set, frozenset, bytes, bytearray, str, int, float, complex, bool, type(None))
_AMPLIFIERS = frozenset({("builtins", n) for n in ("list", "tuple", "set", "frozenset", "dict", "bytes", "bytearray")}
                        | {("collections", n) for n in ("deque", "Counter", "OrderedDict")})


def _bounded(ctor: Callable[..., Any], name: str) -> Callable[..., Any]:
    counts = ctor in (bytes, bytearray)  # bytes(n) and bytearray(n) allocate n bytes from one int

    def build(*args: Any, **kwargs: Any) -> Any:
        for a in (*args, *kwargs.values()):
            if not isinstance(a, _CARRIED) or (counts and isinstance(a, int)):
                raise UnsafePayloadError(
                    f"SafeSerializer refused {name}() of a {type(a).__name__}: a safe payload builds containers "
                    f"only from data it carries (a count or a range could allocate without bound)")
        return ctor(*args, **kwargs)

    return build


class _ArrayType:
    """numpy.ndarray as a safe payload may name it: an argument to _reconstruct, never called itself
    (ndarray(shape) allocates whatever shape says)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise UnsafePayloadError("SafeSerializer refused numpy.ndarray(...): it allocates from a shape alone")


_ARRAY_TYPE = _ArrayType()


def _reconstruct_array(subtype: Any, shape: Any, dtype: Any) -> Any:
    """numpy's own pickles call _reconstruct(ndarray, (0,), b'b') and then set the state, whose data
    the payload carries; any other shape would allocate from the shape alone."""
    import numpy as np

    if subtype is not _ARRAY_TYPE or tuple(shape) != (0,):
        raise UnsafePayloadError(f"SafeSerializer refused numpy _reconstruct({subtype!r}, {shape!r}): only "
                                 f"numpy's own empty-then-filled form is allowed")
    return np.ndarray.__new__(np.ndarray, (0,), dtype)


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, buffers: Iterable[Any], allowed: frozenset[tuple[str, str]]) -> None:
        super().__init__(file, buffers=buffers)
        self._allowed = allowed

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _AMPLIFIERS and (module, name) not in self._allowed:
            return _bounded(super().find_class(module, name), f"{module}.{name}")
        if module in ("numpy", "numpy._core.multiarray", "numpy.core.multiarray") and name == "ndarray":
            return _ARRAY_TYPE
        if module in ("numpy._core.multiarray", "numpy.core.multiarray") and name == "_reconstruct":
            return _reconstruct_array
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module in ("numpy", "numpy.dtypes") and name.endswith("DType"):
            return super().find_class(module, name)
        if (module, name) in _SAFE_GLOBALS or (module, name) in self._allowed:
            return super().find_class(module, name)
        raise UnsafePayloadError(
            f"SafeSerializer refused to load global {module}.{name}: it is not on the allowlist "
            f"(register it with SafeSerializer(allow=[...]) if it is trusted)"
        )


class SafeSerializer(PickleSerializer):
    """A serializer whose ``loads`` can't run code: it builds only allowlisted types.

    Allowed: builtin containers and scalars, a few stdlib value types (OrderedDict, deque, Counter,
    datetime), numpy arrays, scalars and dtypes, torch tensors, dtypes, Size and device, plus what
    you pass in ``allow`` (classes, functions, or "module.Name" strings). A refused global raises
    UnsafePayloadError naming it; nothing is built. ``dumps`` uses plain pickle (no cloudpickle:
    a peer's SafeSerializer would refuse code anyway).

    Registered classes are rebuilt the ordinary pickle way (``__reduce__``/``__setstate__``), so
    only register classes whose construction from untrusted state is harmless.
    """

    name = "safe"

    def __init__(self, allow: Iterable[Any] = (), *, oob_threshold: int = DEFAULT_OOB_THRESHOLD) -> None:
        super().__init__(oob_threshold=oob_threshold, cloudpickle_fallback=False)
        self.allowed = frozenset(_name_of(a) for a in allow)

    def loads(self, segments: Sequence[memoryview]) -> Any:
        if not segments:
            raise SerializationError("no stream segment to load")
        return _SafeUnpickler(io.BytesIO(segments[0]), segments[1:], self.allowed).load()

    def __repr__(self) -> str:
        names = sorted(f"{m}.{n}" for m, n in self.allowed)
        return f"SafeSerializer(allow={names})"


def default_serializer() -> Serializer:
    """The serializer named by DISTCOMM_SERIALIZER ("pickle", the default, or "safe")."""
    choice = os.environ.get("DISTCOMM_SERIALIZER", "pickle").strip().lower()
    if choice in ("", "pickle"):
        return PickleSerializer()
    if choice == "safe":
        return SafeSerializer()
    raise ValueError(f"DISTCOMM_SERIALIZER={choice!r}: expected 'pickle' or 'safe'")
