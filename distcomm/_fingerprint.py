"""Fingerprints of training state: equal on two processes exactly when their states are equal.

A state (a ``state_dict()``, or a dict of the user's) is a tree of mappings, lists and tuples with
tensors, arrays and plain values at its leaves. Its entries are every node's path (the keys on the
way, with their types: ``{0: t}`` is not ``{"0": t}``, nor ``{"a": {"b": 1}}`` ``{"a.b": 1}``) and
a digest of what is there: a leaf's value, or a container's kind, so that ``{"a": {}}`` is not
``{"a": []}`` and an empty list is not the same as no key. A mapping's order is not state (equal
dicts are equal whatever order their keys came in); a list's is, by its indices.

What follows the process is kept out: sets (as values or keys) are digested in an order of their
own, not the interpreter's hash order, and keys that are no plain value by their pickle, not a
repr that may carry an address. Every kind of tensor (sparse and compressed layouts, nested ones,
quantized, conjugate or negative views, meta, a lazy module's uninitialized parameters) and every
array (of objects too) is digested by what it holds; a DTensor by its layout and this rank's shard.
A set inside an object that is pickled whole (a dataclass's field) still follows the hash seed:
such a state differs from process to process.

Digests are SHA-256, cut to 128 bits: any accidental difference (a bit flipped anywhere) changes
them. Large buffers are hashed in chunks on a few threads (hashlib lets go of the GIL while it
hashes), so that a holder's fingerprint of a large state costs a fraction of copying it.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch.nn.parameter import is_lazy

from ._sharded import is_dtensor, layout_of, local_of

__all__ = ["Path", "entries", "fingerprint", "fingerprints", "path_text", "shown"]

Path = tuple[Any, ...]
"""The keys (and list indices) from the state's root to a node."""

_DIGEST_BYTES = 16
_CHUNK = 1 << 20
"""Buffers larger than this are hashed as the digests of their chunks of this size, on threads."""
_THREADS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def fingerprint(state: Any) -> bytes:
    """One digest of the whole state: its entries' paths and digests, in the order of their paths
    (a mapping's order is not state)."""
    return _combined((text, rep + (shard or b"")) for text, rep, shard in _texts(state, True))


def fingerprints(state: Any, sharded: bool = True) -> tuple[bytes, bytes | None]:
    """The state's two parts' digests: its *replicated* part (everything but DTensors' shards: the
    structure, plain values, plain tensors, each DTensor's layout), alike on every rank of the job,
    and its *sharded* part (the DTensors' local shards), alike only within a shard class; the second
    only where ``sharded`` (None else: hashing the shards is the cost, skipped where unused)."""
    texts = list(_texts(state, sharded))
    rep = _combined((text, digest) for text, digest, _ in texts)
    return rep, _combined((text, s) for text, _, s in texts if s is not None) if sharded else None


def _texts(state: Any, sharded: bool) -> Iterator[tuple[str, bytes, bytes | None]]:
    return ((path_text(path), rep, shard) for path, rep, shard in entries(state, sharded=sharded))


def _combined(items: Iterable[tuple[str, bytes]]) -> bytes:
    h = _hasher()
    for text, digest in sorted(items):
        h.update(text.encode())
        h.update(digest)
    return h.digest()


def entries(state: Any, path: Path = (), sharded: bool = True) -> Iterator[tuple[Path, bytes, bytes | None]]:
    """Every node of ``state`` (containers first, then what they hold) with its path, its replicated
    digest (a DTensor's: its layout) and, for a DTensor, its shard's digest (where ``sharded``)."""
    if isinstance(state, Mapping):
        yield path, _tagged(b"mapping"), None
        for k, v in state.items():
            yield from entries(v, (*path, k), sharded)
    elif isinstance(state, (list, tuple)):
        yield path, _tagged(type(state).__name__.encode()), None
        for i, v in enumerate(state):
            yield from entries(v, (*path, i), sharded)
    elif is_dtensor(state):  # (its layout is alike on every rank; its shard, within its class)
        layout = _tagged(f"dtensor:{state.dtype}:{layout_of(state)}".encode())
        yield path, layout, _leaf_digest(state) if sharded else b""
    else:
        yield path, _leaf_digest(state), None


def path_text(path: Path) -> str:
    """A path as text alike in every process: each key's type and value (a plain key's repr, any
    other's digest)."""
    return repr(tuple(f"{type(k).__name__}:{k!r}" if isinstance(k, _PLAIN) else
                      f"{type(k).__name__}#{_leaf_digest(k).hex()}" for k in path))


def shown(path: Path) -> str:
    """A path as a user reads it: its keys joined with dots (``state.0.exp_avg``)."""
    return ".".join(map(str, path))


def _hasher(data: bytes | memoryview = b"") -> hashlib._Hash:
    return hashlib.sha256(data)


def _tagged(tag: bytes) -> bytes:
    return bytes(_hasher(tag).digest()[:_DIGEST_BYTES])


def _leaf_digest(leaf: Any) -> bytes:
    h = _hasher()
    _digest_into(h, leaf)
    return bytes(h.digest()[:_DIGEST_BYTES])


def _bytes_into(h: Any, data: memoryview) -> None:
    """``data`` into ``h``: itself where small, else its chunks' digests, hashed on threads."""
    if data.nbytes <= _CHUNK or _THREADS == 1:
        h.update(data)
        return
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(_THREADS, thread_name_prefix="distcomm-fingerprint")
    chunks = (data[i:i + _CHUNK] for i in range(0, data.nbytes, _CHUNK))
    h.update(b"chunked")
    for digest in _pool.map(lambda chunk: _hasher(chunk).digest(), chunks):
        h.update(digest)


def _digest_into(h: Any, value: Any) -> None:
    """A value's bytes into ``h``: a tensor's or an array's by what it holds; a plain value's repr (a
    repr of anything else may be cut short, as numpy's, or carry an address: its pickle)."""
    if isinstance(value, torch.Tensor):
        _tensor_into(h, value)
    elif isinstance(value, np.ndarray):
        h.update(f"ndarray{value.dtype}{value.shape}".encode())
        if value.dtype.hasobject:  # (references, not values: each element's own digest)
            for item in value.ravel().tolist():
                h.update(_leaf_digest(item))
        else:
            _bytes_into(h, np.ascontiguousarray(value).view(np.uint8).data)
    elif isinstance(value, _PLAIN):
        h.update(f"{type(value).__name__}:{value!r}".encode())
    elif isinstance(value, (set, frozenset)):  # (its pickle follows the interpreter's hash seed)
        h.update(f"{type(value).__name__}:{len(value)}".encode())
        for digest in sorted(_leaf_digest(v) for v in value):
            h.update(digest)
    elif isinstance(value, (list, tuple)):  # (inside a set)
        h.update(f"{type(value).__name__}:{len(value)}".encode())
        for v in value:
            h.update(_leaf_digest(v))
    else:
        try:
            h.update(pickle.dumps(value, protocol=4))
        except Exception:  # (not picklable: what it says of itself)
            h.update(f"{type(value).__name__}:{value!r}".encode())


def _tensor_into(h: Any, t: torch.Tensor) -> None:
    """A tensor's dtype, shape and values (its layout's own parts where it isn't strided; a
    DTensor's layout and this rank's shard)."""
    if is_dtensor(t):
        h.update(f"dtensor:{layout_of(t)}".encode())
        t = local_of(t)
    if is_lazy(t):  # (a lazy module before its first forward: no shape yet)
        h.update(f"uninitialized:{t.dtype}".encode())
        return
    t = t.detach()
    if t.is_nested:  # (its shape has ragged dimensions: its components, one by one)
        h.update(f"nested:{t.dtype}:{t.layout}".encode())
        for part in t.unbind():
            _tensor_into(h, part)
        return
    h.update(f"{t.dtype}{tuple(t.shape)}{t.layout}".encode())
    if t.is_meta:  # (no values to read)
        return
    if t.layout == torch.sparse_coo:
        t = t.coalesce()
        _tensor_into(h, t.indices())
        _tensor_into(h, t.values())
    elif t.layout != torch.strided:  # the compressed layouts: the same values as coordinates
        _tensor_into(h, t.to_sparse())
    elif t.is_quantized:
        h.update(str(t.qscheme()).encode())
        if t.qscheme() in (torch.per_tensor_affine, torch.per_tensor_symmetric):
            h.update(f"{t.q_scale()}:{t.q_zero_point()}".encode())
        else:
            h.update(f"axis {t.q_per_channel_axis()}".encode())
            _tensor_into(h, t.q_per_channel_scales())
            _tensor_into(h, t.q_per_channel_zero_points())
        _tensor_into(h, t.int_repr())
    elif t.numel():
        values = t.resolve_conj().resolve_neg().cpu().contiguous().reshape(-1)
        _bytes_into(h, values.view(torch.uint8).numpy().data)
