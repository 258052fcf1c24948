"""Fuzz SafeSerializer.loads: honest pickles mutated (bytes flipped, inserted, deleted, cut), random
opcode sequences, and crafted payloads. Run as a child process by tests/test_fuzz.py (a miss is a
segfault, which must not take the test session with it).

For each payload a load must either raise or return objects of allowlisted types (or the allowlisted
classes and functions themselves) only, allocate at most 150 bytes per byte received plus 1 MiB
(tracemalloc), with the process's peak RSS (which sees torch's allocator too) never growing by 256 MiB,
and finish within a time budget (a payload that reuses its parts can make hashing exponential). A
watchdog process stops a load that runs far past it (a hash in C can't be interrupted) and names the
payload. Prints one line per failure and a summary.

    python tests/fuzz_safe.py SEED COUNT
"""

from __future__ import annotations

import collections
import datetime
import mmap
import os
import pickle
import pickletools
import random
import resource
import struct
import subprocess
import sys
import tempfile
import time
import tracemalloc
import warnings
from typing import Any

import numpy as np
import torch

import distcomm

warnings.simplefilter("ignore")

_ALLOWED_TYPES = (dict, list, tuple, set, frozenset, str, bytes, bytearray, int, float, complex, bool, type(None),
                  slice, range, object, collections.OrderedDict, collections.deque, collections.Counter,
                  datetime.datetime, datetime.date, datetime.time, datetime.timedelta, datetime.timezone,
                  np.ndarray, np.generic, np.dtype, torch.Tensor, torch.dtype, torch.Size, torch.device)
_NP_CORE: Any = getattr(np, "_core", None) or np.core
_ALLOWED_GLOBALS = {id(g) for g in (*_ALLOWED_TYPES[:-4], torch.Size, torch.device, np.ndarray, np.dtype,
                                     _NP_CORE.multiarray._reconstruct, _NP_CORE.multiarray.scalar,
                                     _NP_CORE.numeric._frombuffer, torch._utils._rebuild_parameter,
                                     distcomm._wire.tensor_pickle.rebuild_tensor)}
_TIME_BUDGET = 2.0  # seconds a load of a fuzzed payload (a few hundred bytes) may take
_HANG = 30.0  # seconds after which the watchdog stops the fuzzer and names the payload
_SLOT = 4096  # bytes of the current payload the watchdog can show


def _doubled(body: bytes, levels: int) -> bytes:
    """A tuple that reuses its halves ``levels`` times (DUP, TUPLE2), as ``body`` uses it."""
    return b"\x80\x05" + body.replace(b"T", b")" + b"2\x86" * levels)


def _timing_seeds() -> list[bytes]:
    """Payloads whose work a few repeated bytes multiply: tuples that reuse their parts as dict keys,
    set elements and frozenset elements; a structured dtype that reuses its field's dtype."""
    out = [_doubled(body, 6) for body in (b"}TNs.", b"}(TNu.", b"\x8f(T\x90.", b"(T\x91.", b"(TNd.")]
    d = np.dtype("u1")
    for _ in range(3):
        d = np.dtype({"names": ["a", "b"], "formats": [d, d], "offsets": [0, 0], "itemsize": 1})
    out.append(pickle.dumps([d, np.zeros(1, dtype=d)], protocol=5))
    return out


def seeds() -> list[bytes]:
    objs: list[Any] = [
        {"loss": 1.5, "acc": 0.25, "n": 3}, [1, "a", b"b", (2.5, None)], {1, 2}, frozenset({"x"}),
        collections.OrderedDict(a=1), collections.deque([1, 2], maxlen=3), collections.Counter("aab"),
        datetime.datetime(2024, 1, 2, 3, 4, 5), datetime.timedelta(seconds=3), range(3), slice(1, 5, 2),
        np.arange(6, dtype=np.float32).reshape(2, 3), np.float64(2.5), np.dtype("f4"),
        np.zeros(2, dtype=[("x", "<f4"), ("y", "<i8")]),
        np.zeros(2, dtype=np.dtype([("a", "u1"), ("b", "<f8")], align=True)),
        np.array(["ab", "c"]), np.array(["2020-01-01"], dtype="M8[ns]"), np.zeros(3, dtype=("f4", (2,))),
        torch.arange(4, dtype=torch.int64), torch.ones(2, 2, requires_grad=True), torch.float16, torch.Size([2, 3]),
        torch.device("cpu"), bytearray(b"xyz"), 10**40, -(2**70), 1 + 2j, "é" * 5,
    ]
    out = []
    for obj in objs:
        for protocol in (2, 4, 5):
            out.append(pickle.dumps(obj, protocol=protocol))
        segs = distcomm.PickleSerializer(oob_threshold=0).dumps(obj)
        out.append(bytes(segs[0]))
    return out


def mutate(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(6)
        if kind == 0 and b:  # flip a byte
            b[rng.randrange(len(b))] = rng.randrange(256)
        elif kind == 1:  # insert bytes
            i = rng.randrange(len(b) + 1)
            b[i:i] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif kind == 2 and b:  # delete a run
            i = rng.randrange(len(b))
            del b[i:i + rng.randint(1, 8)]
        elif kind == 3:  # cut
            del b[rng.randrange(len(b) + 1):]
        elif kind == 4 and b:  # a run repeated (a level of nesting, a reference, again and again)
            i = rng.randrange(len(b))
            run = bytes(b[i:i + rng.randint(1, 4)])
            b[i:i] = run * rng.randint(1, 40)
        else:  # a large count where a count was
            i = rng.randrange(len(b) + 1)
            b[i:i] = rng.choice([b"\xff\xff\xff\x7f", b"\x00\x00\x00\x40", b"\xff" * 8])
    return bytes(b)


_OPS = [op for op in pickletools.opcodes]


def random_ops(rng: random.Random) -> bytes:
    """A random opcode sequence with arguments of plausible form."""
    out = bytearray(b"\x80\x05")
    for _ in range(rng.randint(1, 40)):
        op = rng.choice(_OPS)
        out += op.code.encode("latin-1")
        arg = op.arg
        if arg is None:
            continue
        if arg.n > 0:
            out += bytes(rng.randrange(256) for _ in range(arg.n))
        elif arg.n == pickletools.UP_TO_NEWLINE:
            out += rng.choice([b"0", b"123", b"builtins", b"numpy", b"-1", b"99999999999"]) + b"\n"
            if op.name in ("GLOBAL", "INST"):
                out += rng.choice([b"dict", b"eval", b"dtype", b"_reconstruct"]) + b"\n"
        else:  # counted: 1, 4 or 8 length bytes, then (some of) the data
            width = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
                     pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}.get(arg.n, 1)
            text = rng.choice([b"numpy", b"dtype", b"builtins", b"os", b"system", b"V16", b"f8", b"\x00" * 8])
            out += len(text).to_bytes(width, "little") + text
    return bytes(out + b".")


def allowed(obj: Any, seen: set[int], depth: int = 0) -> bool:
    if id(obj) in seen or depth > 200:
        return True
    seen.add(id(obj))
    if id(obj) in _ALLOWED_GLOBALS:  # an allowlisted class or function itself, kept as a value
        return True
    if not isinstance(obj, _ALLOWED_TYPES):
        return False
    if isinstance(obj, np.ndarray):
        return not obj.dtype.hasobject
    if isinstance(obj, dict):
        return all(allowed(k, seen, depth + 1) and allowed(v, seen, depth + 1) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
        return all(allowed(v, seen, depth + 1) for v in obj)
    return True


_WATCHDOG = r"""
import os, signal, struct, sys, time
pid, path, hang = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
last, since = 0, time.monotonic()
while True:
    time.sleep(0.25)
    try:
        os.kill(pid, 0)
    except OSError:
        break  # the fuzzer ended
    with open(path, "rb") as f:
        head = f.read(16)
        seq, n = struct.unpack("<qq", head) if len(head) == 16 else (0, 0)
        data = f.read(n)
    if seq < 0:
        break
    if seq != last:
        last, since = seq, time.monotonic()
    elif seq and time.monotonic() - since > hang:
        print(f"FAIL a load ran over {hang:.0f} s and was stopped: {data!r:.300}", flush=True)
        os.kill(pid, signal.SIGKILL)
        break
"""


class _Watchdog:
    """A process that kills this one if a load runs over _HANG seconds, and prints its payload."""

    def __init__(self) -> None:
        fd, self.path = tempfile.mkstemp(prefix="fuzz_safe_")
        os.write(fd, bytes(16 + _SLOT))
        self.map = mmap.mmap(fd, 16 + _SLOT)
        os.close(fd)
        self.proc = subprocess.Popen([sys.executable, "-c", _WATCHDOG, str(os.getpid()), self.path, str(_HANG)])

    def loading(self, seq: int, payload: bytes) -> None:
        head = payload[:_SLOT]
        self.map[16:16 + len(head)] = head
        self.map[:16] = struct.pack("<qq", seq, len(head))

    def done(self) -> None:
        self.map[:16] = struct.pack("<qq", -1, 0)
        self.proc.wait()
        self.map.close()
        os.unlink(self.path)


def main(seed: int, count: int) -> int:
    rng = random.Random(seed)
    base, timing = seeds(), _timing_seeds()
    loader = distcomm.SafeSerializer()
    failures = loaded = refused = 0
    for payload in base + timing:  # warm up what loading honest payloads allocates once (imports, caches)
        try:
            loader.loads([memoryview(payload)])
        except Exception:  # _codecs.encode (protocol 2 bytes) is refused; streams with out-of-band buffers miss them
            pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB; sees torch's allocator, which tracemalloc doesn't
    watchdog = _Watchdog()
    tracemalloc.start()
    for i in range(count):
        payload = random_ops(rng) if i % 3 == 0 else mutate(rng, rng.choice(timing if i % 6 == 1 else base))
        tracemalloc.reset_peak()
        start = tracemalloc.get_traced_memory()[0]
        watchdog.loading(i + 1, payload)
        began = time.perf_counter()
        try:
            result = loader.loads([memoryview(payload)])
        except (Exception, RecursionError):
            refused += 1
            result = None
        else:
            loaded += 1
            if not allowed(result, set()):
                failures += 1
                print(f"FAIL built a {type(result).__name__} outside the allowlist from {payload!r}")
        took = time.perf_counter() - began
        if took > _TIME_BUDGET:
            failures += 1
            print(f"FAIL took {took:.1f} s (budget {_TIME_BUDGET} s) to load {len(payload)} bytes: {payload!r:.300}")
        grown = tracemalloc.get_traced_memory()[1] - start
        if grown > 150 * len(payload) + (1 << 20):
            failures += 1
            print(f"FAIL allocated {grown} bytes from {len(payload)}: {payload!r:.300}")
        del result
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if peak > rss + 256 * 1024:
            failures += 1
            print(f"FAIL the process's peak RSS grew by {(peak - rss) >> 10} MiB, at {payload!r:.300}")
            rss = peak
    watchdog.done()
    print(f"fuzzed {count} payloads: {loaded} loaded, {refused} refused, {failures} failures")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
