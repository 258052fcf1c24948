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
import contextlib
import contextvars
import copyreg
import hmac
import io
import linecache
import marshal
import os
import pickle
import socket
import types
from collections import ChainMap
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import cloudpickle
import torch

from .._errors import SerializationError, UnsafePayloadError
from .._trust.key import KEY_VAR, job_key
from . import safe as _safe
from .memory import GCPause
from .tensor_pickle import reduce_tensor

if TYPE_CHECKING:
    from .._communicator import Communicator

__all__ = ["AuthenticatedSerializer", "PickleSerializer", "SafeSerializer", "Serializer", "carry_serializer",
           "default_serializer", "dumps_code", "serializer_for", "serializing_with"]

_R = TypeVar("_R")

DEFAULT_OOB_THRESHOLD = 64 * 1024

_TABLE: dict[type, Callable[[Any], Any]] = {torch.Tensor: reduce_tensor}


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


# ------------------------------------------------------------------ the function payload of launch() and spawn()
_SOURCE_LIMIT = 1 << 20  # source text shipped along for a file that isn't on disk (an IPython cell), at most


def _load_code(data: bytes, filename: str, lines: list[str] | None) -> types.CodeType:
    """The inverse of ``_reduce_code``: the code object, and its source for ``linecache`` when the
    file it names can't be read here (tracebacks then show its lines, as they would locally)."""
    code = marshal.loads(data)  # noqa: S302 - our own payload, from this process's parent
    if lines is not None and filename not in linecache.cache and not os.path.exists(filename):
        linecache.cache[filename] = (sum(map(len, lines)), None, lines, filename)
    return code  # type: ignore[no-any-return]


def _reduce_code(code: types.CodeType) -> Any:
    """A code object with its real ``co_filename`` (cloudpickle puts ``<dynamic-code>`` there).

    marshal keeps every field, the nested code objects' too; its format belongs to this Python
    version, which is fine for a payload only this machine's processes, started from the same
    interpreter, load.
    """
    filename = code.co_filename
    lines = None
    if not os.path.exists(filename):
        cached = linecache.getlines(filename)  # an IPython cell, or source that registered itself
        if cached and sum(map(len, cached)) <= _SOURCE_LIMIT:
            lines = list(cached)
    return _load_code, (marshal.dumps(code), filename, lines)


_SOURCE_TABLE: Any = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


class _SourcePickler(cloudpickle.Pickler):  # type: ignore[misc]
    dispatch_table = _SOURCE_TABLE


def dumps_code(obj: Any) -> bytes:
    """``cloudpickle.dumps(obj)`` for launch()'s and spawn()'s functions: code pickled by value (a
    function of the launching script) keeps its file name, so remote tracebacks show
    ``File "train.py", line 5`` with the line's text, and call sites read ``train.py:140``, not
    ``<dynamic-code>``. Load it with ``cloudpickle.loads`` (or ``pickle.loads``) in a process of
    this machine started from the same interpreter."""
    bio = io.BytesIO()
    _SourcePickler(bio, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(obj)
    return bio.getvalue()


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


class SafeSerializer(PickleSerializer):
    """A serializer whose ``loads`` can't run code: it builds only allowlisted types.

    Allowed: builtin containers and scalars, a few stdlib value types (OrderedDict, deque, Counter,
    datetime), numpy arrays, scalars and dtypes (plain data: no object fields, each dtype state
    checked against the dtype numpy builds from its description), torch tensors, dtypes, Size and
    device, plus what you pass in ``allow`` (classes, functions, or "module.Name" strings). A
    refused global raises UnsafePayloadError naming it; nothing is built. Loads run on Python's own
    unpickler (about 1 µs per opcode), whose memory use is bounded by the bytes received. ``dumps``
    uses plain pickle (no cloudpickle: a peer's SafeSerializer would refuse code anyway).

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
        return _safe.load(segments[0], segments[1:], self.allowed)

    def __repr__(self) -> str:
        names = sorted(f"{m}.{n}" for m, n in self.allowed)
        return f"SafeSerializer(allow={names})"


_SERIALIZING_WITH: contextvars.ContextVar[Serializer | None] = contextvars.ContextVar("distcomm_serializing_with",
                                                                                default=None)


@contextlib.contextmanager
def serializing_with(serializer: Serializer) -> Iterator[None]:
    """The calls made inside (on this thread, and the async ones it starts) serialize and load with
    ``serializer`` instead of their communicator's: ``sync_state`` moves state with the safe loader,
    whatever serializer the user chose."""
    token = _SERIALIZING_WITH.set(serializer)
    try:
        yield
    finally:
        _SERIALIZING_WITH.reset(token)


def serializer_for(comm: Communicator) -> Serializer:
    """What serializes and loads the objects of ``comm``'s current call."""
    return _SERIALIZING_WITH.get() or comm.serializer


def dumps_for(comm: Communicator, obj: Any) -> list[memoryview]:
    """``obj`` serialized as ``comm``'s current call serializes it. Where it holds many objects (a
    rank's evaluation results), with the collector paused: the pickler keeps what it made of each
    until it ends, and the collections those start (and the full ones they lead to, 50 ms in a
    process that imported torch) would walk them again and again for nothing."""
    serializer = serializer_for(comm)
    if not _holds_many(obj):
        return serializer.dumps(obj)
    with GCPause():
        return serializer.dumps(obj)


_CONTAINERS = (list, tuple, dict, set, frozenset)
_MANY = 256


def _holds_many(obj: Any) -> bool:
    """Whether ``obj`` is a container of at least ``_MANY`` items, or a few containers that hold as
    many together (``{"preds": [...], "ids": [...]}``): checked in a fraction of a microsecond."""
    if type(obj) not in _CONTAINERS:
        return False
    if len(obj) >= _MANY:
        return True
    if len(obj) > 8:
        return False
    values = obj.values() if type(obj) is dict else obj
    return sum(len(v) for v in values if type(v) in _CONTAINERS) >= _MANY


def carry_serializer(fn: Callable[[], _R]) -> Callable[[], _R]:
    """``fn`` to run on another thread with the serializer the caller set (``serializing_with``), if any."""
    chosen = _SERIALIZING_WITH.get()
    if chosen is None:
        return fn

    def run() -> _R:
        with serializing_with(chosen):
            return fn()

    return run


def failure_text(serializer: Serializer, obj: Any, error: Exception, name: str = "obj") -> str:
    """``error`` as a message, with where in ``obj`` the first value ``serializer`` can't handle sits
    (``obj['cfg'].loader[2]``). Found by serializing the parts again: error paths only."""
    text = f"{type(error).__name__}: {error}"
    budget = [2000]  # serializations at most, so that a huge object can't make the error path slow

    def fails(value: Any) -> bool:  # with the same kind of error: a part that fails otherwise is not it
        budget[0] -= 1
        try:
            serializer.dumps(value)
        except Exception as e:
            return type(e) is type(error)
        return False

    def parts(value: Any) -> list[tuple[str, Any]]:
        if isinstance(value, dict):
            return [(f"[{k!r}]", v) for k, v in value.items()] + [(f" (a key: {k!r:.40})", k) for k in value]
        if isinstance(value, (list, tuple)):
            return [(f"[{i}]", v) for i, v in enumerate(value)]
        if isinstance(value, (set, frozenset)):
            return [(f" (an element: {v!r:.40})", v) for v in value]
        if isinstance(value, types.FunctionType):  # pickled by value: what its closure and globals hold
            cells = zip(value.__code__.co_freevars, value.__closure__ or (), strict=False)
            named = [(n, value.__globals__[n]) for n in value.__code__.co_names if n in value.__globals__]
            return [(f" (captured {n!r})", _cell(c)) for n, c in cells] + [(f" (global {n!r})", v) for n, v in named]
        try:  # what pickle takes of it: an object that refuses (a communicator) is itself the culprit
            reduced = value.__reduce_ex__(5)
        except Exception:
            return []
        state = reduced[2] if isinstance(reduced, tuple) and len(reduced) > 2 else None
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        args = reduced[1] if isinstance(reduced, tuple) and len(reduced) > 1 and isinstance(reduced[1], tuple) else ()
        found = [(f" (argument {i})", a) for i, a in enumerate(args)]
        if isinstance(state, dict):
            found += [(f".{k}", v) for k, v in state.items()]
        return found

    path, value = name, obj
    for _ in range(64):
        for label, child in parts(value):
            if budget[0] <= 0:
                break
            if fails(child):
                path, value = path + label, child
                break
        else:
            break
    if path == name:
        return text
    return f"{text} (at {path}, a {type(value).__module__}.{type(value).__qualname__})"


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


class AuthenticatedSerializer(Serializer):
    """Another serializer's payloads, each carrying a MAC under the job's key, checked before the
    inner serializer sees a byte: someone on the path between two ranks can't make one load bytes
    of its choosing (it can still hold back or replay a payload a member sent). For networks where
    someone could sit on the path; it costs an HMAC-SHA256 of each payload where it is made and
    where it is loaded (docs/trust-model.md). Tensor collectives' tensors are not covered.

    Args:
        inner: the serializer whose payloads it authenticates (default ``PickleSerializer()``).
        key: the job's key (default: this process's, ``DISTCOMM_JOB_KEY`` or its file).
    """

    def __init__(self, inner: Serializer | None = None, *, key: str | None = None) -> None:
        self.inner = PickleSerializer() if inner is None else inner
        if isinstance(self.inner, AuthenticatedSerializer):
            raise TypeError("AuthenticatedSerializer over an AuthenticatedSerializer: give the inner one")
        made = job_key({KEY_VAR: key}) if key else job_key()  # (checked alike: 16 characters or more)
        if made is None:
            raise ValueError(f"AuthenticatedSerializer needs the job's key: give every process the same {KEY_VAR} "
                             f"(16 or more characters); python -m distcomm run, launch() and testing.spawn() make one")
        self._key = made
        self.name = f"authenticated {self.inner.name}"

    def around(self, inner: Serializer) -> AuthenticatedSerializer:
        """``inner``'s payloads, authenticated with this one's key."""
        other = AuthenticatedSerializer.__new__(AuthenticatedSerializer)
        other.inner, other._key, other.name = inner, self._key, f"authenticated {inner.name}"
        return other

    def dumps(self, obj: Any) -> list[memoryview]:
        segments = self.inner.dumps(obj)
        return [*segments, memoryview(self._key.mac(b"payload", *segments))]

    def loads(self, segments: Sequence[memoryview]) -> Any:
        if len(segments) < 2 or not hmac.compare_digest(bytes(segments[-1]),
                                                        self._key.mac(b"payload", *segments[:-1])):
            raise UnsafePayloadError("AuthenticatedSerializer refused a payload whose MAC doesn't match the job's "
                                     "key: it was changed on the way, or doesn't come from a process of the job")
        return self.inner.loads(segments[:-1])

    def __repr__(self) -> str:
        return f"AuthenticatedSerializer({self.inner!r})"


def default_serializer() -> Serializer:
    """The serializer named by DISTCOMM_SERIALIZER ("pickle", the default, "safe", or either
    authenticated: "authenticated" or "authenticated-safe")."""
    choice = os.environ.get("DISTCOMM_SERIALIZER", "pickle").strip().lower()
    inner, authenticated = choice.removeprefix("authenticated").lstrip("-"), choice.startswith("authenticated")
    if inner in ("", "pickle", "safe"):
        made: Serializer = SafeSerializer() if inner == "safe" else PickleSerializer()
        return AuthenticatedSerializer(made) if authenticated else made
    raise ValueError(f"DISTCOMM_SERIALIZER={choice!r}: expected 'pickle', 'safe', 'authenticated' or "
                     f"'authenticated-safe'")
