"""The safe loader behind SafeSerializer: an allowlist, constructors bounded by what a payload
carries, and numpy arrays and dtypes built only from plain descriptions that numpy itself checks.

It runs on Python's own unpickler, which lets it see each opcode: the C unpickler sizes its memo
from the index a payload names (9 bytes can make it write 512 MiB) and allocates counted bytes
before it reads them. Here a memo index is a dict key, counted data is read before anything is
allocated for it, and extension codes (objects copyreg cached, outside the allowlist) are refused.

Each BUILD is checked before it applies: a dtype's state is turned into a plain description (names,
formats, offsets, item size), numpy builds the dtype from that, and the state is accepted only if
it is exactly the state of that dtype. A forged state (flags that hide an object field, an offset
past the item size, a dtype changed after an array used it) is refused by name before numpy sees
it, so reading or freeing the result can't touch memory the payload chose.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, NoReturn

import numpy as np
import torch

from ._errors import UnsafePayloadError

_NP_CORE: Any = getattr(np, "_core", None) or np.core  # numpy 2 names it _core

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
        ("torch", "Size"),
        ("torch", "device"),
        ("torch._utils", "_rebuild_parameter"),
        ("distcomm._serialization", "_rebuild_tensor"),
    }
)

# numpy globals that numpy's own pickles name: each is replaced by a checked version.
_NUMPY_MODULES = ("numpy", "numpy._core.multiarray", "numpy.core.multiarray", "numpy._core.numeric",
                  "numpy.core.numeric")
_NUMPY_NAMES = frozenset({"dtype", "ndarray", "_reconstruct", "scalar", "_frombuffer"})

# What a safe payload may hand to a constructor: data it carries itself. A range, an iterator or a
# count would let a few bytes allocate without bound (bytearray(1 << 30), list(range(10**9))).
_CARRIED = (list, tuple, dict, set, frozenset, bytes, bytearray, str, int, float, complex, bool, type(None))
_AMPLIFIERS = frozenset({("builtins", n) for n in ("list", "tuple", "set", "frozenset", "dict", "bytes", "bytearray")}
                        | {("collections", n) for n in ("deque", "Counter", "OrderedDict")})


def _refuse(what: str) -> NoReturn:
    raise UnsafePayloadError(f"SafeSerializer refused {what}")


def _bounded(ctor: Callable[..., Any], name: str) -> Callable[..., Any]:
    counts = ctor in (bytes, bytearray)  # bytes(n) and bytearray(n) allocate n bytes from one int

    def build(*args: Any, **kwargs: Any) -> Any:
        for a in (*args, *kwargs.values()):
            if not isinstance(a, _CARRIED) or (counts and isinstance(a, int)):
                _refuse(f"{name}() of a {type(a).__name__}: a safe payload builds containers only from data it "
                        f"carries (a count or a range could allocate without bound)")
        return ctor(*args, **kwargs)

    return build


class _ArrayType:
    """numpy.ndarray as a safe payload may name it: an argument to _reconstruct, never called itself
    (ndarray(shape) allocates whatever shape says)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _refuse("numpy.ndarray(...): it allocates from a shape alone")


_ARRAY_TYPE = _ArrayType()


_ALIGNED_STRUCT = 0x80  # numpy's NPY_ALIGNED_STRUCT flag: the struct was laid out with align=True


def _plain_state(state: Any) -> tuple[Any, ...]:
    if not (isinstance(state, tuple) and len(state) in (8, 9) and state[0] in (3, 4)
            and state[1] in ("<", ">", "|", "=") and all(isinstance(v, int) for v in state[5:8])):
        _refuse(f"a numpy dtype state that numpy doesn't write: {state!r:.200}")
    return state


def _dtype_from(inst: np.dtype[Any], state: tuple[Any, ...]) -> np.dtype[Any]:
    """The dtype numpy builds from the plain description that `state` gives (a state numpy wrote
    is exactly that dtype's state)."""
    endian, sub, names, fields, elsize = state[1:6]
    if sub is not None:
        if not (isinstance(sub, tuple) and len(sub) == 2 and isinstance(sub[0], np.dtype)
                and isinstance(sub[1], tuple) and all(isinstance(n, int) and n >= 0 for n in sub[1])):
            _refuse(f"a numpy subarray description {sub!r:.200}")
        return np.dtype((sub[0], sub[1]))
    if names is not None or fields is not None:
        if not (isinstance(names, tuple) and isinstance(fields, dict) and all(isinstance(n, str) for n in names)):
            _refuse("a numpy structured dtype whose names and fields aren't a tuple of str and a dict")
        spec: dict[str, list[Any]] = {"names": [], "formats": [], "offsets": [], "titles": []}
        for n in names:
            field = fields.get(n)
            if not (isinstance(field, tuple) and len(field) in (2, 3) and isinstance(field[0], np.dtype)
                    and isinstance(field[1], int) and (len(field) == 2 or isinstance(field[2], str))):
                _refuse(f"numpy field {n!r}: {field!r:.200} is not (dtype, offset[, title])")
            spec["names"].append(n)
            spec["formats"].append(field[0])
            spec["offsets"].append(field[1])
            spec["titles"].append(field[2] if len(field) == 3 else None)
        aligned = bool(state[7] & _ALIGNED_STRUCT)
        return np.dtype({**spec, "itemsize": elsize}, align=aligned)  # type: ignore[call-overload,no-any-return]
    if inst.kind in "mM" and len(state) == 9:
        meta = state[8]
        if not (isinstance(meta, tuple) and len(meta) == 2 and isinstance(meta[1], tuple) and len(meta[1]) == 4
                and isinstance(meta[1][0], bytes) and len(meta[1][0]) <= 3 and isinstance(meta[1][1], int)):
            _refuse(f"numpy datetime metadata {meta!r:.200}")
        unit, count = meta[1][0].decode("ascii", "replace"), meta[1][1]
        inst = np.dtype(f"{inst.char}8[{count}{unit}]")
    return inst.newbyteorder(endian) if endian in "<>" else inst


class _Loader(pickle._Unpickler):
    """Python's unpickler with an allowlist, bounded constructors, and checked numpy."""

    dispatch: ClassVar[dict[int, Callable[..., None]]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # the unpickler's own, set as it loads
    read: Callable[[int], bytes]
    readline: Callable[[], bytes]
    append: Callable[[Any], None]

    def __init__(self, file: io.BytesIO, buffers: Iterable[Any], allowed: frozenset[tuple[str, str]]) -> None:
        super().__init__(file, buffers=buffers)
        self._file = file
        self._allowed = allowed
        self._unbuilt: dict[int, np.dtype[Any]] = {}  # dtypes made here whose state is still to come
        self.memo: list[Any] = []  # indices are positions: 8 bytes an entry

    def find_class(self, module: str, name: str) -> Any:
        if module in _NUMPY_MODULES and name in _NUMPY_NAMES:
            return self._numpy(name)
        if (module, name) in _AMPLIFIERS and (module, name) not in self._allowed:
            return _bounded(super().find_class(module, name), f"{module}.{name}")
        if module == "builtins" and name in _SAFE_BUILTINS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _SAFE_GLOBALS or (module, name) in self._allowed:
            return super().find_class(module, name)
        _refuse(f"to load global {module}.{name}: it is not on the allowlist "
                f"(register it with SafeSerializer(allow=[...]) if it is trusted)")

    def _numpy(self, name: str) -> Any:
        return {"dtype": self._dtype, "ndarray": _ARRAY_TYPE, "_reconstruct": self._reconstruct,
                "scalar": self._scalar, "_frombuffer": self._frombuffer}[name]

    def _use(self, dtype: Any, what: str) -> np.dtype[Any]:
        """A dtype some array or field now depends on: plain data only, and its state final."""
        if not isinstance(dtype, np.dtype):
            _refuse(f"{what} with dtype {dtype!r:.80}: not a numpy dtype")
        self._unbuilt.pop(id(dtype), None)
        if dtype.hasobject:
            _refuse(f"{what} of dtype {dtype}: object fields hold pointers, not data")
        return dtype

    def _dtype(self, spec: Any, align: Any = False, copy: Any = True) -> np.dtype[Any]:
        if not isinstance(spec, str) or len(spec) > 32:
            _refuse(f"numpy.dtype({spec!r:.80}): a safe payload names a dtype by its type string")
        try:
            made = np.dtype(spec, bool(align), True)  # always a new dtype, never numpy's shared float64
        except (TypeError, ValueError) as e:
            raise UnsafePayloadError(f"SafeSerializer refused numpy.dtype({spec!r}): {e}") from e
        if made.hasobject:
            _refuse(f"numpy.dtype({spec!r}): object dtypes hold pointers, not data")
        self._unbuilt[id(made)] = made
        return made

    def _reconstruct(self, subtype: Any, shape: Any, dtype: Any) -> Any:
        # numpy's own pickles call _reconstruct(ndarray, (0,), b'b') and then set the state, whose data the
        # payload carries; any other shape would allocate from the shape alone.
        if subtype is not _ARRAY_TYPE or shape != (0,) or not isinstance(dtype, (bytes, str)):
            _refuse(f"numpy _reconstruct({subtype!r}, {shape!r:.80}, {dtype!r:.80}): only numpy's own "
                    f"empty-then-filled form is allowed")
        try:
            made = np.ndarray.__new__(np.ndarray, (0,), dtype)  # type: ignore[arg-type]
        except (TypeError, ValueError) as e:
            raise UnsafePayloadError(f"SafeSerializer refused a numpy array of dtype {dtype!r:.80}: {e}") from e
        self._use(made.dtype, "a numpy array")
        return made

    def _scalar(self, dtype: Any, data: Any) -> Any:
        return _NP_CORE.multiarray.scalar(self._use(dtype, "a numpy scalar"), data)

    def _frombuffer(self, buf: Any, dtype: Any, shape: Any, order: Any) -> Any:
        return _NP_CORE.numeric._frombuffer(buf, self._use(dtype, "a numpy array"), shape, order)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if isinstance(inst, np.dtype):
            if self._unbuilt.pop(id(inst), None) is not inst:
                _refuse(f"to change numpy dtype {inst} after it was built or used")
            state = _plain_state(state)
            try:
                made = self._use(_dtype_from(inst, state), "a numpy dtype")
            except (TypeError, ValueError) as e:
                raise UnsafePayloadError(f"SafeSerializer refused numpy dtype state {state!r:.200}: {e}") from e
            if made.__reduce__()[2] != state:
                _refuse(f"numpy dtype state {state!r:.200}: it isn't the state numpy gives the dtype it describes "
                        f"(flags, sizes or offsets that don't match)")
            self.stack.pop()
            inst.__setstate__(made.__reduce__()[2])  # type: ignore[attr-defined]
            return
        if isinstance(inst, np.ndarray):
            if not (isinstance(state, tuple) and len(state) == 5):
                _refuse(f"numpy array state {state!r:.80}")
            self._use(state[2], "a numpy array")
        super().load_build()  # type: ignore[misc]

    dispatch[pickle.BUILD[0]] = load_build

    def load_bytearray8(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        data = self.read(size)  # what is there, not what the count says
        if len(data) != size:
            raise pickle.UnpicklingError(f"BYTEARRAY8 of {size} bytes, {len(data)} left in the stream")
        self.append(bytearray(data))

    dispatch[pickle.BYTEARRAY8[0]] = load_bytearray8

    def load(self) -> Any:
        """Python's load loop, reading the in-memory stream directly: a FRAME only announces how
        much follows, which a stream already in memory doesn't need."""
        file = self._file
        self.read, self.readinto, self.readline = file.read, file.readinto, file.readline
        self.metastack: list[Any] = []
        self.stack = []
        self.append = self.stack.append
        self.proto = 0
        read, dispatch = file.read, self.dispatch
        try:
            while True:
                key = read(1)
                if not key:
                    raise EOFError("the pickle stream ended before its STOP")
                dispatch[key[0]](self)
        except pickle._Stop as stop:  # type: ignore[attr-defined]
            return stop.value

    def load_frame(self) -> None:
        self.read(8)

    dispatch[pickle.FRAME[0]] = load_frame

    def load_memoize(self) -> None:
        self.memo.append(self.stack[-1])

    def _put(self, index: int) -> None:
        if index == len(self.memo):
            self.memo.append(self.stack[-1])
        elif 0 <= index < len(self.memo):
            self.memo[index] = self.stack[-1]
        else:
            raise pickle.UnpicklingError(f"memo index {index} past the {len(self.memo)} objects stored so far")

    def load_put(self) -> None:
        self._put(int(self.readline()[:-1]))

    def load_binput(self) -> None:
        self._put(self.read(1)[0])

    def load_long_binput(self) -> None:
        self._put(struct.unpack("<I", self.read(4))[0])

    dispatch[pickle.MEMOIZE[0]] = load_memoize
    dispatch[pickle.PUT[0]] = load_put
    dispatch[pickle.BINPUT[0]] = load_binput
    dispatch[pickle.LONG_BINPUT[0]] = load_long_binput

    def load_ext(self) -> None:
        _refuse("an extension code: it names an object copyreg cached, outside the allowlist")

    for _op in (pickle.EXT1, pickle.EXT2, pickle.EXT4):
        dispatch[_op[0]] = load_ext
    del _op


def load(stream: memoryview, buffers: Sequence[memoryview], allowed: frozenset[tuple[str, str]]) -> Any:
    """Load a stream with the allowlist."""
    return _Loader(io.BytesIO(stream), buffers, allowed).load()
