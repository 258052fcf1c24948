"""The safe loader behind SafeSerializer.

A peer must not be able to make the loading process run code, crash, or allocate much more than
it received. The loader is Python's own unpickler, which lets it see each opcode (the C unpickler
sizes its memo from the index a payload names: 9 bytes can make it write 512 MiB; and it allocates
counted bytes before reading them). On top of it:

- **Globals**: an allowlist. Each allowed constructor gets a checked version that takes only the
  kinds of arguments honest pickles pass, carried in the payload: no counts, ranges or iterators
  (``bytearray(1 << 30)``, ``list(range(10**9))``, ``torch.Size(range(n))``), no containers where
  text is expected (``str`` of a structure of shared references), no nesting of types whose
  deallocation recurses (``slice``, ``deque``).
- **BUILD** (set an object's state) applies only to what honest pickles build: numpy dtypes and
  arrays made here (once each) and instances of classes the user registered. Anything else (a
  tensor's ``__setstate__``, a function's attributes) is refused.
- **numpy**: ``numpy.dtype(...)`` makes a placeholder. Its BUILD turns the pickled state into a
  plain description (kind, fields, offsets, item size), numpy builds a new dtype from that, and the
  state is accepted only if it is exactly that dtype's state; the placeholder is then replaced by
  it. Dtypes are never modified, object dtypes are refused, and an array's state is set once, on
  an array made here, over bytes (never over another array's memory).
- **Memo and opcodes**: memo indices must be consecutive; a placeholder can't be fetched from the
  memo or duplicated before its state is set; extension codes (objects copyreg cached, which the
  allowlist never sees) are refused.
- **Work**: hashing a tuple visits every path through it, and CPython caches no tuple's hash, so a
  tuple that reuses its halves 40 times over (88 bytes with memo references) takes 2**40 steps as a
  dict key. The loader knows, for each tuple, frozenset and structured numpy dtype it builds, how
  many entries hashing (or comparing) it visits, counting a part once per reference; every key,
  set element and state it hashes is charged that, within a budget per byte received.
- **Globals** load as themselves (``loads(dumps(float)) is float``): a call of one goes through its
  checked version, so an allowlisted class or function kept as a value is the real one.
- Error messages show payload values through a bounded repr.
"""

from __future__ import annotations

import collections
import datetime
import io
import math
import pickle
import reprlib
import struct
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar, NoReturn

import numpy as np
import torch

from .._errors import UnsafePayloadError
from .tensor_pickle import rebuild_tensor

_NP_CORE: Any = getattr(np, "_core", None) or np.core  # numpy 2 names it _core

def _dtype_text(d: np.dtype[Any]) -> str:
    """A dtype in bounded text (a structured one that reuses its fields prints every path through them)."""
    if d.names is not None:
        names = ", ".join(repr(n)[:20] for n in d.names[:4]) + (", ..." if len(d.names) > 4 else "")
        return f"<structured dtype ({names}), {d.itemsize} bytes>"
    if d.subdtype is not None:
        return f"<subarray dtype ({_dtype_text(d.subdtype[0])}, {_REPR.repr(d.subdtype[1])})>"
    return str(d)


class _BoundedRepr(reprlib.Repr):
    def repr1(self, x: Any, level: int) -> str:
        if isinstance(x, np.dtype):
            return _dtype_text(x)
        return super().repr1(x, level)


_REPR = _BoundedRepr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 2, 60, 60, 60
for _attr in ("maxlist", "maxtuple", "maxdict", "maxset", "maxfrozenset", "maxdeque", "maxarray"):
    setattr(_REPR, _attr, 4)


def _show(x: Any) -> str:
    """A payload value for an error message, in bounded time and memory."""
    if isinstance(x, (str, bytes, bytearray, int, float, complex, bool, type(None), list, tuple, dict, set,
                      frozenset, np.dtype)):
        return _REPR.repr(x)
    if isinstance(x, type):
        return f"the class {x.__module__}.{x.__qualname__}"
    return f"<{type(x).__module__}.{type(x).__qualname__}>"


def _refuse(what: str) -> NoReturn:
    raise UnsafePayloadError(f"SafeSerializer refused {what}")


# ---------------------------------------------------------------------------------- constructors
_NUMBER = (int, float, bool)
_CALL_COST = 1024  # what one constructor call may allocate beyond its data (a tensor, an array, a deque's block)
_CALL_BUDGET = 100  # bytes that calls may allocate per byte received (plus 1 MiB)
_MAX_DTYPE_NESTING = 32  # structured dtypes inside structured dtypes
_MAX_NESTING = 100  # tuples and frozensets in tuples and frozensets: hashing them recurses in C, unguarded
_HASH_BUDGET = 64  # entries that hashing keys may visit per byte received (plus _HASH_FREE)
_HASH_FREE = 1 << 22  # about 0.1 s of tuple hashing
_DTYPE_ENTRY = 16  # hashing or comparing a structured dtype's field costs about 16 tuple entries
_INT_BYTES = 32  # hashing an int costs about one tuple entry per 32 bytes of it
_BIG_INT = 256  # bytes: ints longer than this (LONG4 only) are charged by their size
_VOID_DTYPE: type = type(np.dtype("V1"))  # structured and subarray dtypes, whose hash walks their fields
_SIZED = frozenset({tuple, frozenset})  # nest: hashing them recurses in C
_LISTED = frozenset({tuple, frozenset, torch.Size})  # hashing them visits each item
_COSTLY = frozenset({tuple, frozenset, torch.Size, _VOID_DTYPE})  # hashing these visits more than one entry
_COSTLY_AND_INT = _COSTLY | {int}  # once a load has made an int of more than _BIG_INT bytes
_TORCH_DTYPES = frozenset(k for k, v in vars(torch).items() if isinstance(v, torch.dtype))
_TEXT = (str, bytes, bytearray)
_CARRIED = (list, tuple, dict, set, frozenset, bytes, bytearray, str, int, float, complex, bool, type(None))
_BUFFER = (bytes, bytearray, memoryview, pickle.PickleBuffer)


def _args_of(*kinds: type | tuple[type, ...]) -> Callable[[Any], bool]:
    return lambda a: isinstance(a, kinds)


def _size_of(value: Any) -> int:
    """How many bytes or items ``value`` holds."""
    if isinstance(value, (bytes, bytearray, memoryview, pickle.PickleBuffer)):
        return memoryview(value).nbytes
    if isinstance(value, (str, list, tuple, dict, set, frozenset, collections.deque)):
        return len(value)
    return 0


# What a constructor may build per byte or item of its arguments: a container of a str makes a new
# str per character (about 80 bytes), a hash table about 100 bytes an entry; str() of bytes is 4 per byte.
_PER_ITEM: dict[Any, int] = {list: 100, tuple: 100, set: 100, frozenset: 100, dict: 100, collections.deque: 100,
                             collections.Counter: 100, collections.OrderedDict: 100, str: 4, bytes: 8,
                             bytearray: 8}
_ENCODINGS = frozenset({"utf-8", "utf8", "ascii", "latin-1", "latin1"})  # others import a codec module
_ERRORS = frozenset({"strict", "replace", "ignore", "surrogateescape", "backslashreplace"})


def _plain_codec(*args: Any, **kwargs: Any) -> str | None:
    encoding, errors = [*args[1:3], None, None][:2]
    encoding, errors = kwargs.get("encoding", encoding), kwargs.get("errors", errors)
    if encoding is not None and (not isinstance(encoding, str) or encoding.lower() not in _ENCODINGS):
        return f"encoding {_show(encoding)}: only {', '.join(sorted(_ENCODINGS))}"
    if errors is not None and (not isinstance(errors, str) or errors not in _ERRORS):
        return f"errors {_show(errors)}"
    return None


# Constructors that hash their argument's items (and how many times each): charged before they run.
_HASHING: dict[Any, int] = {set: 1, frozenset: 1, dict: 1, collections.Counter: 2, collections.OrderedDict: 2}


def _checked(ctor: Callable[..., Any], name: str, ok: Callable[[Any], bool], why: str,
             also: Callable[..., str | None] | None, loader: _Loader) -> Callable[..., Any]:
    hashes = _HASHING.get(ctor, 0)

    def build(*args: Any, **kwargs: Any) -> Any:
        for a in (*args, *kwargs.values()):
            if not ok(a):
                _refuse(f"{name}() of a {type(a).__name__}: {why}")
        if also is not None:
            problem = also(*args, **kwargs)
            if problem:
                _refuse(f"{name}(): {problem}")
        loader._charge(_CALL_COST + sum(_size_of(a) for a in args) * _PER_ITEM.get(ctor, 1), name)
        if hashes:
            loader._hashed(hashes * sum(loader._items_cost(ctor, a) for a in args), f"{name}()")
        made = ctor(*args, **kwargs)
        if isinstance(made, (tuple, frozenset)):
            loader._nested(made, made)
        return made

    return build


_FROM_CARRIED = "a safe payload builds containers only from data it carries (a count, a range or an " \
                "iterator could allocate without bound)"


def _no_nested_deque(*args: Any, **kwargs: Any) -> str | None:
    items = args[0] if args else ()
    if isinstance(items, (list, tuple)) and any(isinstance(v, collections.deque) for v in items):
        return "a deque inside a deque (freeing deeply nested ones recurses)"
    return None


def _sizes_only(*args: Any, **kwargs: Any) -> str | None:
    if args and not all(isinstance(v, int) and not isinstance(v, bool) for v in args[0]):
        return "a size must be a sequence of ints"
    return None


_CONSTRUCTORS: dict[tuple[str, str], tuple[Callable[[Any], bool], str, Callable[..., str | None] | None]] = {
    **{("builtins", n): (_args_of(_CARRIED), _FROM_CARRIED, None)
       for n in ("list", "tuple", "set", "frozenset", "dict")},
    **{("builtins", n): (lambda a: isinstance(a, _CARRIED) and not isinstance(a, int), _FROM_CARRIED, _plain_codec)
       for n in ("bytes", "bytearray")},  # bytes(n) allocates n bytes from one int
    ("builtins", "str"): (_args_of(_TEXT), "str() takes text (of a structure it could grow without bound)",
                          _plain_codec),
    ("builtins", "int"): (_args_of(_NUMBER, _TEXT), "int() takes a number or text", None),
    ("builtins", "float"): (_args_of(_NUMBER, _TEXT), "float() takes a number or text", None),
    ("builtins", "complex"): (_args_of(_NUMBER, complex, str), "complex() takes numbers or text", None),
    ("builtins", "bool"): (_args_of(_NUMBER), "bool() takes a number", None),
    ("builtins", "slice"): (lambda a: a is None or (isinstance(a, int) and not isinstance(a, bool)),
                            "slice() takes ints or None", None),
    ("builtins", "range"): (lambda a: isinstance(a, int) and not isinstance(a, bool), "range() takes ints", None),
    ("builtins", "object"): (lambda a: False, "object() takes nothing", None),
    ("collections", "deque"): (_args_of(_CARRIED), _FROM_CARRIED, _no_nested_deque),
    ("collections", "Counter"): (_args_of(_CARRIED), _FROM_CARRIED, None),
    ("collections", "OrderedDict"): (_args_of(_CARRIED), _FROM_CARRIED, None),
    **{("datetime", n): (_args_of(_NUMBER, _TEXT, type(None), datetime.tzinfo, datetime.timedelta),
                         "datetime values take numbers, text and time zones", None)
       for n in ("datetime", "date", "time", "timedelta", "timezone")},
    ("torch", "Size"): (_args_of(list, tuple), "torch.Size() takes a list of ints", _sizes_only),
    ("torch", "device"): (_args_of(str, int), "torch.device() takes a name and an index", None),
}


def _set_module_metadata(od: collections.OrderedDict[Any, Any], state: Any) -> None:
    """The one state an honest pickle sets on an OrderedDict: a module's ``state_dict()`` carries
    ``_metadata``, each module's ``{"version": n}``. Set once, as a plain attribute."""
    def versions_only(entry: Any) -> bool:  # (other entries steer load_state_dict: assign_to_params_buffers)
        return type(entry) is dict and all(k == "version" and type(v) is int for k, v in entry.items())

    if not (type(state) is dict and list(state) == ["_metadata"]
            and type(state["_metadata"]) in (dict, collections.OrderedDict)
            and all(type(k) is str and versions_only(v) for k, v in state["_metadata"].items())):
        _refuse(f"an OrderedDict's state {_show(state)}: only a state dict's _metadata (each module's "
                f"version) is set")
    if "_metadata" in vars(od):
        _refuse("to set an OrderedDict's _metadata twice")
    od._metadata = state["_metadata"]  # type: ignore[attr-defined]


def _rebuild_tensor_checked(data: Any, dtype: Any, shape: Any, requires_grad: Any, was_cuda: Any) -> Any:
    if not isinstance(dtype, torch.dtype):
        _refuse(f"a tensor of dtype {_show(dtype)}")
    if not isinstance(data, _BUFFER):
        _refuse(f"a tensor over a {type(data).__name__}: its data must be bytes the payload carries")
    if not (isinstance(shape, tuple) and all(isinstance(n, int) and not isinstance(n, bool) for n in shape)):
        _refuse(f"a tensor of shape {_show(shape)}")
    if not (isinstance(requires_grad, bool) and isinstance(was_cuda, bool)):
        _refuse("a tensor whose flags aren't bools")
    return rebuild_tensor(data, dtype, shape, requires_grad, was_cuda)


def _rebuild_parameter_checked(data: Any, requires_grad: Any, backward_hooks: Any) -> Any:
    from torch._utils import _rebuild_parameter

    if not isinstance(data, torch.Tensor) or not isinstance(requires_grad, bool):
        _refuse("a parameter that isn't a tensor and a flag")
    if not isinstance(backward_hooks, dict) or backward_hooks:
        _refuse("a parameter with backward hooks (they would run in this process)")
    return _rebuild_parameter(data, requires_grad, collections.OrderedDict())  # type: ignore[no-untyped-call]


_TORCH_FUNCTIONS: dict[tuple[str, str], Callable[..., Any]] = {
    ("distcomm._wire.tensor_pickle", "rebuild_tensor"): _rebuild_tensor_checked,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter_checked,
}

# ---------------------------------------------------------------------------------- numpy
_NUMPY_MODULES = ("numpy", "numpy._core.multiarray", "numpy.core.multiarray", "numpy._core.numeric",
                  "numpy.core.numeric")
_NUMPY_NAMES = frozenset({"dtype", "ndarray", "_reconstruct", "scalar", "_frombuffer"})
_ALIGNED_STRUCT = 0x80  # numpy's NPY_ALIGNED_STRUCT flag: the struct was laid out with align=True


_NUMPY_OBJECTS: dict[str, Any] = {"dtype": np.dtype, "ndarray": np.ndarray, "scalar": _NP_CORE.multiarray.scalar,
                                  "_reconstruct": _NP_CORE.multiarray._reconstruct,
                                  "_frombuffer": _NP_CORE.numeric._frombuffer}
_NUMPY_BUILDERS = {"dtype": "_dtype", "ndarray": "_array", "_reconstruct": "_reconstruct", "scalar": "_scalar",
                   "_frombuffer": "_frombuffer"}  # the loader's methods that stand for them in calls


class _DtypeSpec:
    """What ``numpy.dtype(spec, align, copy)`` stands for until its BUILD; never seen by numpy."""

    __slots__ = ("memo_at", "spec")

    def __init__(self, spec: str) -> None:
        self.spec = spec
        self.memo_at: list[int] = []


def _real_dtype(value: Any, what: str, element: bool = False) -> np.dtype[Any]:
    """A dtype from this load, of plain data; ``element``: an array's or scalar's own dtype, which
    is never a subarray (numpy writes those as a longer shape; as an element, numpy reads past them)."""
    if not isinstance(value, np.dtype):
        _refuse(f"{what} with dtype {_show(value)}: not a numpy dtype (or one whose state isn't set yet)")
    if value.hasobject:
        _refuse(f"{what} of dtype {value}: object fields hold pointers, not data")
    if element and value.subdtype is not None:
        _refuse(f"{what} of subarray dtype {value}: numpy never writes one (only as a field's format)")
    return value


def _plain_elements(dtype: Any, shape: Any) -> np.dtype[Any]:
    """An array's dtype, checked; and elements that take memory (with an item size of 0, a shape of
    2**50 costs nothing to make, and everything that iterates the array pays instead)."""
    checked = _real_dtype(dtype, "a numpy array", element=True)
    if not (isinstance(shape, tuple) and all(type(n) is int and n >= 0 for n in shape)):
        _refuse(f"a numpy array of shape {_show(shape)}: a shape is a tuple of non-negative ints")
    if checked.itemsize == 0 and math.prod(shape) > 0:
        _refuse(f"a numpy array of {math.prod(shape)} elements of size 0")
    return checked


def _described(spec: str, state: Any) -> np.dtype[Any]:
    """The dtype numpy builds from the plain description that ``spec`` and ``state`` give."""
    if not (isinstance(state, tuple) and len(state) in (8, 9) and state[0] in (3, 4)
            and state[1] in ("<", ">", "|", "=") and all(isinstance(v, int) for v in state[5:8])):
        _refuse(f"a numpy dtype state that numpy doesn't write: {_show(state)}")
    endian, sub, names, fields, elsize = state[1:6]
    if sub is not None:
        if not (isinstance(sub, tuple) and len(sub) == 2 and isinstance(sub[1], tuple)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sub[1])):
            _refuse(f"a numpy subarray description {_show(sub)}")
        return np.dtype((_real_dtype(sub[0], "a numpy subarray"), sub[1]))
    if names is not None or fields is not None:
        if not (isinstance(names, tuple) and isinstance(fields, dict) and all(isinstance(n, str) for n in names)):
            _refuse("a numpy structured dtype whose names and fields aren't a tuple of str and a dict")
        described: dict[str, Any] = {"names": [], "formats": [], "offsets": [], "titles": [], "itemsize": elsize}
        for n in names:
            field = fields.get(n)
            if not (isinstance(field, tuple) and len(field) in (2, 3) and isinstance(field[1], int)
                    and (len(field) == 2 or isinstance(field[2], str))):
                _refuse(f"numpy field {n!r}: {_show(field)} is not (dtype, offset[, title])")
            described["names"].append(n)
            described["formats"].append(_real_dtype(field[0], f"numpy field {n!r}"))
            described["offsets"].append(field[1])
            described["titles"].append(field[2] if len(field) == 3 else None)
        return np.dtype(described, align=bool(state[7] & _ALIGNED_STRUCT))  # type: ignore[call-overload,no-any-return]
    base = np.dtype(spec)
    if base.kind in "mM" and len(state) == 9:
        meta = state[8]
        if not (isinstance(meta, tuple) and len(meta) == 2 and isinstance(meta[1], tuple) and len(meta[1]) == 4
                and isinstance(meta[1][0], bytes) and len(meta[1][0]) <= 3 and isinstance(meta[1][1], int)):
            _refuse(f"numpy datetime metadata {_show(meta)}")
        base = np.dtype(f"{base.char}8[{meta[1][1]}{meta[1][0].decode('ascii', 'replace')}]")
    return base.newbyteorder(endian) if endian in "<>" else base


# ---------------------------------------------------------------------------------- the loader
class _Loader(pickle._Unpickler):
    """Python's unpickler with the checks above."""

    dispatch: ClassVar[dict[int, Callable[..., None]]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # the unpickler's own, set as it loads
    metastack: list[Any]
    read: Callable[[int], bytes]
    readline: Callable[[], bytes]
    append: Callable[[Any], None]

    def __init__(self, file: io.BytesIO, buffers: Iterable[Any], allowed: frozenset[tuple[str, str]]) -> None:
        buffers = list(buffers)
        super().__init__(file, buffers=buffers)
        self._file = file
        self._allowed = allowed
        self._specs: dict[int, _DtypeSpec] = {}  # placeholders whose state is still to come
        self._fresh: dict[int, np.ndarray[Any, Any]] = {}  # arrays made here whose state is still to come
        self.memo: list[Any] = []  # indices are positions: 8 bytes an entry
        # the stream and the out-of-band buffers: a tensor over a buffer is charged the buffer's size
        received = file.getbuffer().nbytes + sum(memoryview(b).nbytes for b in buffers)
        self._budget = _CALL_BUDGET * received + (1 << 20)  # what calls may allocate
        self._hash_budget = _HASH_BUDGET * received + _HASH_FREE  # entries that hashing may visit
        # Values whose hash visits more than their own entries (tuples and frozensets with tuples or frozensets
        # inside or sharing parts, structured dtypes, long ints): (the value, how deep it nests tuples and
        # frozensets, how many entries hashing it visits).
        self._trees: dict[int, tuple[Any, int, int]] = {}
        self._costly = _COSTLY  # the types whose cost _trees may know
        self._calls: dict[int, tuple[Any, Callable[..., Any]]] = {}  # a global by id: (it, what a call of it runs)
        self._dtype_depth: dict[int, tuple[np.dtype[Any], int]] = {}  # structured dtypes with structured fields

    def _charge(self, nbytes: int, what: str) -> None:
        self._budget -= nbytes
        if self._budget < 0:
            _refuse(f"{what}(): the payload's calls would allocate more than {_CALL_BUDGET} bytes per byte received")

    def _hashed(self, entries: int, what: str) -> None:
        """Charge hashing ``entries`` (a key, a set's elements) to the load's budget."""
        self._hash_budget -= entries
        if self._hash_budget < 0:
            _refuse(f"{what}: hashing or comparing the payload's keys, set elements and dtypes would visit more "
                    f"than {_HASH_BUDGET} entries per byte received (a tuple or dtype that reuses its parts is "
                    f"walked along every path through them)")

    def _weight(self, value: Any) -> tuple[int, int]:
        """How deeply ``value`` (of a type in _COSTLY) nests tuples and frozensets, and how many entries
        hashing or comparing it visits (each part once per reference: hashes of tuples aren't cached)."""
        seen = self._trees.get(id(value))
        if seen is not None and seen[0] is value:
            return seen[1], seen[2]
        kind = type(value)  # a tuple or frozenset of items of one entry each, a torch.Size, a dtype or int
        return (1 if kind in _SIZED else 0), (1 + len(value) if kind in _LISTED else 1)

    def _keys_cost(self, keys: Iterable[Any]) -> int:
        """How many entries hashing ``keys`` visits, counting the keys that take more than one (each of the
        others costs an opcode of the payload)."""
        costly = self._costly
        return sum(self._weight(key)[1] for key in keys if type(key) in costly)

    def _items_cost(self, ctor: Any, arg: Any) -> int:
        """What hashing constructor ``ctor`` visits hashing the items of ``arg``."""
        if not isinstance(arg, (list, tuple, set, frozenset, dict)):
            return 0  # text: of characters or ints
        if ctor in (dict, collections.OrderedDict) and type(arg) in (list, tuple):  # pairs: (key, value)
            return sum(self._keys_cost(e) for e in arg if isinstance(e, (list, tuple, set, frozenset, dict))
                       and len(e) == 2)
        return self._keys_cost(arg)

    def _nested(self, made: Any, items: Iterable[Any]) -> Any:
        """Record how deeply ``made`` (a tuple or frozenset of ``items``) nests tuples and frozensets, and how
        many entries hashing or comparing it visits."""
        depth, extra, costly = 1, 0, self._costly
        for item in items:
            if type(item) in costly:
                inner, entries = self._weight(item)
                depth, extra = max(depth, 1 + inner), extra + entries - 1
        if depth > _MAX_NESTING:
            _refuse(f"tuples or frozensets nested over {_MAX_NESTING} deep (hashing them recurses without a guard)")
        if depth > 1 or extra:
            self._trees[id(made)] = (made, depth, 1 + len(made) + extra)
        return made

    def load(self) -> Any:
        """Python's load loop, reading the in-memory stream directly: a FRAME only announces how
        much follows, which a stream already in memory doesn't need."""
        file = self._file
        self.read, self.readinto, self.readline = file.read, file.readinto, file.readline
        self.metastack = []
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
            if self._specs:
                _refuse("a numpy dtype whose state never came")
            return stop.value

    # ------------------------------------------------------------------ globals
    def find_class(self, module: str, name: str) -> Any:
        """The global itself (a class kept as a value is the real one); what a call of it runs is recorded
        in _calls: its checked version, or itself for what the user registered."""
        key = (module, name)
        if module in _NUMPY_MODULES and name in _NUMPY_NAMES:
            found = _NUMPY_OBJECTS[name]
            if id(found) not in self._calls:
                self._calls[id(found)] = (found, getattr(self, _NUMPY_BUILDERS[name]))
            return found
        if key in self._allowed:
            found = super().find_class(module, name)
            self._calls[id(found)] = (found, found)
            return found
        if key in _CONSTRUCTORS:
            found = super().find_class(module, name)
            if id(found) not in self._calls:
                ok, why, also = _CONSTRUCTORS[key]
                self._calls[id(found)] = (found, _checked(found, f"{module}.{name}", ok, why, also, self))
            return found
        if key in _TORCH_FUNCTIONS:
            found = super().find_class(module, name)
            fn = _TORCH_FUNCTIONS[key]

            def call(*args: Any) -> Any:
                self._charge(_CALL_COST + sum(_size_of(a) for a in args), name)
                return fn(*args)

            self._calls[id(found)] = (found, call)
            return found
        if module == "torch" and name in _TORCH_DTYPES:  # (getattr(torch, name) could import a submodule)
            return vars(torch)[name]
        _refuse(f"to load global {module}.{name}: it is not on the allowlist "
                f"(register it with SafeSerializer(allow=[...]) if it is trusted)")

    def _call(self, func: Any, args: Sequence[Any]) -> Any:
        """``func(*args)``, for a global this load named: its checked version runs."""
        entry = self._calls.get(id(func))
        if entry is not None and entry[0] is func:
            return entry[1](*args)
        if self._registered(func):  # an instance of a registered class, called as pickle would
            return func(*args)
        _refuse(f"a call of {_show(func)}: a safe payload calls only the allowlisted globals it names")

    def _registered_global(self, cls: Any, what: str) -> None:
        entry = self._calls.get(id(cls))
        if entry is None or entry[0] is not cls or entry[1] is not cls:
            _refuse(f"{what} of {_show(cls)}: only registered classes are made that way")

    def _array(self, *args: Any, **kwargs: Any) -> Any:
        _refuse("numpy.ndarray(...): it allocates from a shape alone")

    def _dtype(self, spec: Any, align: Any = False, copy: Any = True) -> _DtypeSpec:
        if not isinstance(spec, str) or len(spec) > 32:
            _refuse(f"numpy.dtype({_show(spec)}): a safe payload names a dtype by its type string")
        try:
            made = np.dtype(spec)
        except (TypeError, ValueError) as e:
            raise UnsafePayloadError(f"SafeSerializer refused numpy.dtype({spec!r}): {e}") from e
        _real_dtype(made, f"numpy.dtype({spec!r})")
        placeholder = _DtypeSpec(spec)
        self._specs[id(placeholder)] = placeholder
        return placeholder

    def _reconstruct(self, subtype: Any, shape: Any, dtype: Any) -> Any:
        # numpy's own pickles call _reconstruct(ndarray, (0,), b'b') and then set the state, whose data the
        # payload carries; any other shape would allocate from the shape alone.
        if subtype is not np.ndarray or type(shape) is not tuple or shape != (0,) or dtype != b"b":
            _refuse(f"numpy _reconstruct({_show(subtype)}, {_show(shape)}, {_show(dtype)}): only numpy's own "
                    f"empty-then-filled form is allowed")
        self._charge(_CALL_COST, "numpy _reconstruct")
        made = np.ndarray.__new__(np.ndarray, (0,), "b")
        self._fresh[id(made)] = made
        return made

    def _scalar(self, dtype: Any, data: Any) -> Any:
        if not isinstance(data, bytes):
            _refuse(f"a numpy scalar over a {type(data).__name__}: its data must be bytes")
        self._charge(_CALL_COST + len(data), "numpy scalar")
        return _NP_CORE.multiarray.scalar(_real_dtype(dtype, "a numpy scalar", element=True), data)

    def _frombuffer(self, buf: Any, dtype: Any, shape: Any, order: Any) -> Any:
        if not isinstance(buf, _BUFFER):
            _refuse(f"a numpy array over a {type(buf).__name__}: its data must be bytes the payload carries")
        if not (isinstance(shape, tuple) and all(isinstance(n, int) and not isinstance(n, bool) for n in shape)
                and order in ("C", "F")):
            _refuse(f"a numpy array of shape {_show(shape)}, order {_show(order)}")
        self._charge(_CALL_COST, "numpy _frombuffer")
        return _NP_CORE.numeric._frombuffer(buf, _plain_elements(dtype, shape), shape, order)

    # ------------------------------------------------------------------ BUILD
    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        if type(inst) is _DtypeSpec:
            self.stack.pop()
            self._build_dtype(inst, state)
            return
        if isinstance(inst, np.ndarray):
            if self._fresh.pop(id(inst), None) is not inst:
                _refuse("to set the state of a numpy array twice, or of one not made by numpy's own form")
            if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[4], _BUFFER)
                    and isinstance(state[1], tuple)):
                _refuse(f"numpy array state {_show(state)}: its data must be bytes")
            _plain_elements(state[2], state[1])
            self._charge(_size_of(state[4]), "a numpy array")  # numpy copies the bytes
            super().load_build()  # type: ignore[misc]
            return
        if type(inst) is collections.OrderedDict:
            self.stack.pop()
            _set_module_metadata(inst, state)
            return
        cls = type(inst)
        if (cls.__module__, cls.__qualname__) not in self._allowed:
            _refuse(f"to set the state of a {cls.__module__}.{cls.__qualname__}: only numpy's, registered "
                    f"classes' and a state dict's metadata are set")
        for part in (state if type(state) is tuple and len(state) == 2 else (state,)):
            if isinstance(part, dict):  # set into the instance's __dict__: its keys are hashed again
                self._hashed(self._keys_cost(part), "an object's state")
        super().load_build()  # type: ignore[misc]

    dispatch[pickle.BUILD[0]] = load_build

    def _build_dtype(self, placeholder: _DtypeSpec, state: Any) -> None:
        try:
            made = _described(placeholder.spec, state)
        except (TypeError, ValueError, OverflowError) as e:
            raise UnsafePayloadError(f"SafeSerializer refused numpy dtype state {_show(state)}: {e}") from e
        made = _real_dtype(made, "a numpy dtype")
        inner = [f[0] for f in (made.fields or {}).values()] + ([made.subdtype[0]] if made.subdtype else [])
        depth = 1 + max((self._dtype_depth.get(id(d), (d, 1))[1] for d in inner), default=0)
        if depth > _MAX_DTYPE_NESTING:  # numpy's copies and casts recurse once per level
            _refuse(f"numpy dtypes nested over {_MAX_DTYPE_NESTING} deep")
        if depth > 1:
            self._dtype_depth[id(made)] = (made, depth)
        if inner:  # hashing, comparing or printing it walks its fields' dtypes, each once per reference
            cost = _DTYPE_ENTRY + sum(self._weight(d)[1] for d in inner)
            self._trees[id(made)] = (made, 0, cost)
            self._hashed(cost, "a numpy dtype")  # the comparison below, and numpy's checks of it, may walk it
        reduced: Any = made.__reduce__()
        if reduced[1][0] != placeholder.spec or reduced[2] != state:
            _refuse(f"numpy.dtype({placeholder.spec!r}) with state {_show(state)}: not the state numpy gives the "
                    f"dtype it describes (kind, flags, sizes or offsets that don't match)")
        del self._specs[id(placeholder)]
        self.stack[-1] = made  # the placeholder is replaced wherever it was kept
        for i in placeholder.memo_at:
            self.memo[i] = made

    # ------------------------------------------------------------------ memo, copies
    def _store(self, index: int) -> None:
        value = self.stack[-1]
        if index == len(self.memo):
            self.memo.append(value)
        elif 0 <= index < len(self.memo):
            self.memo[index] = value
        else:
            raise pickle.UnpicklingError(f"memo index {index} past the {len(self.memo)} objects stored so far")
        if type(value) is _DtypeSpec:
            value.memo_at.append(index)

    def _text_index(self) -> int:
        return int(self.readline()[:-1])

    def _byte_index(self) -> int:
        return self.read(1)[0]

    def _long_index(self) -> int:
        return int(struct.unpack("<I", self.read(4))[0])

    def _fetch(self, index: int) -> None:
        if not 0 <= index < len(self.memo):
            raise pickle.UnpicklingError(f"memo index {index} was never stored")
        value = self.memo[index]
        if type(value) is _DtypeSpec:
            _refuse("a second reference to a numpy dtype before its state is set")
        self.append(value)

    def load_dup(self) -> None:
        if type(self.stack[-1]) is _DtypeSpec:
            _refuse("a second reference to a numpy dtype before its state is set")
        self.append(self.stack[-1])

    dispatch[pickle.MEMOIZE[0]] = lambda u: u._store(len(u.memo))
    for _store_op, _fetch_op, _index in ((pickle.PUT, pickle.GET, _text_index),
                                         (pickle.BINPUT, pickle.BINGET, _byte_index),
                                         (pickle.LONG_BINPUT, pickle.LONG_BINGET, _long_index)):
        dispatch[_store_op[0]] = lambda u, index=_index: u._store(index(u))
        dispatch[_fetch_op[0]] = lambda u, index=_index: u._fetch(index(u))
    dispatch[pickle.DUP[0]] = load_dup
    del _store_op, _fetch_op, _index

    # ------------------------------------------------------------------ calls and containers
    def load_reduce(self) -> None:
        args = self.stack.pop()
        if type(args) is not tuple:  # func(*args) would iterate anything (a range, an array)
            _refuse(f"a call whose arguments are a {type(args).__name__}, not a tuple")
        self.stack[-1] = self._call(self.stack[-1], args)

    def load_newobj(self) -> None:
        args = self.stack.pop()
        if type(args) is not tuple:
            _refuse(f"NEWOBJ with arguments in a {type(args).__name__}, not a tuple")
        cls = self.stack.pop()
        self._registered_global(cls, "NEWOBJ")
        self.append(cls.__new__(cls, *args))

    def load_newobj_ex(self) -> None:
        kwargs, args = self.stack.pop(), self.stack.pop()
        if type(args) is not tuple or type(kwargs) is not dict:
            _refuse("NEWOBJ_EX with arguments that aren't a tuple and a dict")
        cls = self.stack.pop()
        self._registered_global(cls, "NEWOBJ_EX")
        self.append(cls.__new__(cls, *args, **kwargs))

    def _instantiate(self, klass: Any, args: list[Any]) -> None:  # INST and OBJ (protocols 0 and 1)
        entry = self._calls.get(id(klass))
        if entry is not None and entry[0] is klass and entry[1] is klass:  # registered: pickle's own way
            super()._instantiate(klass, args)  # type: ignore[misc]
        else:
            self.append(self._call(klass, args))

    def _registered(self, obj: Any) -> bool:
        return (type(obj).__module__, type(obj).__qualname__) in self._allowed

    def _into(self, target: Any, kinds: tuple[type, ...], what: str) -> None:
        if not isinstance(target, kinds) and not self._registered(target):
            _refuse(f"{what} a {type(target).__module__}.{type(target).__qualname__}")

    def load_append(self) -> None:
        value = self.stack.pop()
        self._append_all(self.stack[-1], [value])

    def load_appends(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        self._append_all(self.stack[-1], items)

    def _append_all(self, target: Any, items: list[Any]) -> None:
        self._into(target, (list, collections.deque), "items appended to")
        if isinstance(target, collections.deque) and any(isinstance(v, collections.deque) for v in items):
            _refuse("a deque inside a deque (freeing deeply nested ones recurses)")
        if isinstance(target, (list, collections.deque)):
            target.extend(items)
        else:
            extend = getattr(target, "extend", None)  # a registered class: pickle's own way
            if extend is not None:
                extend(items)
            else:
                for item in items:
                    target.append(item)

    def load_setitem(self) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._into(self.stack[-1], (dict,), "items set in")
        if type(key) in self._costly:
            self._hashed(self._weight(key)[1], "a dict key")
        self.stack[-1][key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        target = self.stack[-1]
        self._into(target, (dict,), "items set in")
        costly = self._costly
        for i in range(0, len(items), 2):
            key = items[i]
            if type(key) in costly:
                self._hash_budget -= self._weight(key)[1]
                if self._hash_budget < 0:
                    self._hashed(0, "a dict key")
            target[key] = items[i + 1]

    def load_dict(self) -> None:  # DICT (protocols 0 and 1)
        items = self.pop_mark()  # type: ignore[attr-defined]
        self._hashed(self._keys_cost(items[::2]), "dict keys")
        self.append({items[i]: items[i + 1] for i in range(0, len(items), 2)})

    def load_additems(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        self._into(self.stack[-1], (set,), "items added to")
        if not self._costly.isdisjoint(map(type, items)):
            self._hashed(self._keys_cost(items), "set elements")
        self.stack[-1].update(items)

    def load_tuple(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        self.append(self._nested(tuple(items), items))

    def load_tuple1(self) -> None:
        self.stack[-1] = self._nested((self.stack[-1],), self.stack[-1:])

    def load_tuple2(self) -> None:
        self.stack[-2:] = [self._nested(tuple(self.stack[-2:]), self.stack[-2:])]

    def load_tuple3(self) -> None:
        self.stack[-3:] = [self._nested(tuple(self.stack[-3:]), self.stack[-3:])]

    def load_frozenset(self) -> None:
        items = self.pop_mark()  # type: ignore[attr-defined]
        self._hashed(self._keys_cost(items), "frozenset elements")  # making it hashes each item
        self.append(self._nested(frozenset(items), items))

    for _op, _fn in ((pickle.REDUCE, load_reduce), (pickle.NEWOBJ, load_newobj), (pickle.NEWOBJ_EX, load_newobj_ex),
                     (pickle.APPEND, load_append), (pickle.APPENDS, load_appends), (pickle.SETITEM, load_setitem),
                     (pickle.SETITEMS, load_setitems), (pickle.DICT, load_dict), (pickle.ADDITEMS, load_additems),
                     (pickle.TUPLE, load_tuple),
                     (pickle.TUPLE1, load_tuple1), (pickle.TUPLE2, load_tuple2), (pickle.TUPLE3, load_tuple3),
                     (pickle.FROZENSET, load_frozenset)):
        dispatch[_op[0]] = _fn

    # ------------------------------------------------------------------ counted data, extensions
    def load_frame(self) -> None:
        self.read(8)

    def load_bytearray8(self) -> None:
        (size,) = struct.unpack("<Q", self.read(8))
        data = self.read(size)  # what is there, not what the count says
        if len(data) != size:
            raise pickle.UnpicklingError(f"BYTEARRAY8 of {size} bytes, {len(data)} left in the stream")
        self.append(bytearray(data))

    def load_long4(self) -> None:
        (size,) = struct.unpack("<i", self.read(4))
        data = self.read(size) if size >= 0 else b""
        if len(data) != size:
            raise pickle.UnpicklingError(f"LONG4 of {size} bytes, {len(data)} left in the stream")
        value = int.from_bytes(data, "little", signed=True)
        if size > _BIG_INT:  # hashing it reads all of it, each time
            self._trees[id(value)] = (value, 0, 1 + size // _INT_BYTES)
            self._costly = _COSTLY_AND_INT
        self.append(value)

    def load_ext(self) -> None:
        _refuse("an extension code: it names an object copyreg cached, outside the allowlist")

    for _op, _fn in ((pickle.FRAME, load_frame), (pickle.BYTEARRAY8, load_bytearray8), (pickle.LONG4, load_long4),
                     (pickle.EXT1, load_ext),
                     (pickle.EXT2, load_ext), (pickle.EXT4, load_ext)):
        dispatch[_op[0]] = _fn
    del _op, _fn


def load(stream: memoryview, buffers: Sequence[memoryview], allowed: frozenset[tuple[str, str]]) -> Any:
    """Load a stream with the checks above."""
    return _Loader(io.BytesIO(stream), buffers, allowed).load()
