"""SafeSerializer's loader: bounded work (hashing what a payload builds), globals that load as themselves."""

from __future__ import annotations

import collections
import datetime
import os
import pickle
import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import torch

import distcomm

P5 = b"\x80\x05"


def glob(module: str, name: str) -> bytes:  # STACK_GLOBAL
    return b"\x8c" + bytes([len(module)]) + module.encode() + b"\x8c" + bytes([len(name)]) + name.encode() + b"\x93"


def doubled(levels: int) -> bytes:
    """T[k] = (T[k-1], T[k-1]) with DUP: two bytes a level, 2**levels entries to hash."""
    return b")" + b"2\x86" * levels


T40 = doubled(40)
BOMBS = {  # each hashes T40 (2**40 entries: hours) on the way
    "dict key": P5 + b"}" + T40 + b"Ns.",
    "dict keys": P5 + b"}(" + T40 + b"Nu.",
    "set element": P5 + b"\x8f(" + T40 + b"\x90.",
    "frozenset element": P5 + b"(" + T40 + b"\x91.",
    "a key inside a key": P5 + b"}" + T40 + b"\x85Ns.",
    "protocol 0 dict": b"(" + T40 + b"Nd.",
    "set()": P5 + glob("builtins", "set") + b"(" + T40 + b"l\x85R.",
    "frozenset()": P5 + glob("builtins", "frozenset") + b"(" + T40 + b"l\x85R.",
    "dict()": P5 + glob("builtins", "dict") + b"(" + T40 + b"N\x86l\x85R.",
    "OrderedDict()": P5 + glob("collections", "OrderedDict") + b"(" + T40 + b"N\x86l\x85R.",
    "Counter()": P5 + glob("collections", "Counter") + b"(" + T40 + b"l\x85R.",
}

_CHILD = r"""
import pickle, resource, sys, time
import numpy as np
import distcomm
sys.path.insert(0, sys.argv[1])
from test_safe_loader import BOMBS

def dtype_bomb(levels):  # a structured dtype whose two fields share one dtype, 31 times over
    d = np.dtype("u1")
    for _ in range(levels):
        d = np.dtype({"names": ["a", "b"], "formats": [d, d], "offsets": [0, 0], "itemsize": 1})
    return d

d = dtype_bomb(31)
as_list = pickle.dumps([d, 1], protocol=5)  # then made a dict: pickling {d: 1} would hash d here
i = as_list.index(b"]")
payloads = dict(BOMBS)
payloads["dtype as a dict key"] = as_list[:i] + b"}" + as_list[i + 1:-2] + b"u."
payloads["that dtype"] = pickle.dumps(d, protocol=5)  # anything the user does with it walks it too
soft, hard = resource.getrlimit(resource.RLIMIT_AS)  # numpy's dtype hash lists every path: bound the miss
vm = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (vm + (2 << 30), hard))
for name, raw in payloads.items():
    began = time.perf_counter()
    try:
        distcomm.SafeSerializer().loads([memoryview(raw)])
        outcome = "LOADED"
    except distcomm.UnsafePayloadError as e:
        outcome = "refused: " + str(e)
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    print(f"{name} ({len(raw)} bytes) in {time.perf_counter() - began:.3f} s {outcome}"[:300], flush=True)
"""


@pytest.mark.timeout(120)
def test_a_payload_that_hashes_exponentially_is_refused_at_once() -> None:
    """An 88-byte tuple that reuses its halves 40 times over (CPython caches no tuple hash) as a dict key,
    a set or frozenset element, through each constructor that hashes; a structured dtype that reuses its
    fields 31 times over. Each is refused by the loader's own error within a second. In a child: a miss
    hashes for hours in C, where no timeout of this process can stop it."""
    here = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", _CHILD, here], capture_output=True, text=True,
                         timeout=90)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert len(lines) == len(BOMBS) + 2, out.stdout
    for line in lines:
        assert "refused: SafeSerializer refused" in line and "would visit more than" in line, line
        seconds = float(line.split(" in ")[1].split(" s ")[0])
        assert seconds < 1.0, line
    assert all(len(BOMBS[name]) <= 120 for name in BOMBS)
    assert len(BOMBS["dict keys"]) == 88


@pytest.mark.timeout(20)
def test_deep_but_small_structures_still_load() -> None:
    """What the budget allows: a 2**40-entry tuple kept as a value (nothing hashes it), shared keys
    within the budget, tuple keys and frozensets as honest pickles send them."""
    tree: Any = ()
    for _ in range(40):
        tree = (tree, tree)
    key: Any = (1, "a")
    for _ in range(12):
        key = (key, key)  # 8,191 entries
    sent = {"tree": tree, "trees": [tree, tree], key: 1, "keys": {(i, i + 1): i for i in range(2000)},
            "fs": frozenset({(1, 2), (3, (4, 5))}), "fskey": {frozenset({(1, 2)}): 1},
            "od": collections.OrderedDict([((1, 2), 3)]), "c": collections.Counter([(1, 2), (1, 2)]),
            "s": {(1, (2, 3))}, "many": [{key: i} for i in range(200)]}
    ser = distcomm.SafeSerializer()
    for protocol in (3, 5):  # 3: sets and frozensets through their constructors
        raw = pickle.dumps(sent, protocol=protocol)
        got = ser.loads([memoryview(raw)])
        assert got["tree"][0][1][0] is got["tree"][1][0][1]  # the sharing survives
        assert got[key] == 1 and got["keys"] == sent["keys"] and got["fs"] == sent["fs"]
        assert got["od"] == sent["od"] and got["c"] == sent["c"] and got["s"] == sent["s"]
        assert got["fskey"] == sent["fskey"] and got["many"] == sent["many"]
    got = ser.loads(ser.dumps({"tree": tree}))  # through SafeSerializer's own dumps
    node, levels = got["tree"], 0
    while node:  # (comparing it with the tree sent would walk all 2**40 entries)
        assert node[0] is node[1]
        node, levels = node[0], levels + 1
    assert levels == 40


@pytest.mark.parametrize("cls", [float, list, dict, bytes, collections.OrderedDict, collections.deque,
                                 datetime.datetime, datetime.timedelta, torch.Size, torch.device, np.ndarray,
                                 np.dtype])
def test_an_allowlisted_class_loads_as_itself(cls: type) -> None:
    ser = distcomm.SafeSerializer()
    assert ser.loads(ser.dumps(cls)) is cls
    got = ser.loads(ser.dumps({"cast": cls, "kinds": (cls, int)}))
    assert got["cast"] is cls and got["kinds"] == (cls, int)


def test_a_loaded_class_is_the_users_own_to_call() -> None:
    """Not a wrapper that keeps the loader and charges its budget: the 2,000th call works as the first."""
    ser = distcomm.SafeSerializer()
    got = ser.loads(ser.dumps({"cast": float, "container": list}))
    assert isinstance(1.5, got["cast"]) and got["container"] is list
    for i in range(2000):
        assert got["cast"](str(i)) == float(i)
        assert got["container"]((i,)) == [i]


def test_classes_loaded_as_values_are_still_called_only_through_their_checks() -> None:
    """A class on the stack is the real one, but a call of it (REDUCE, NEWOBJ, INST) still goes through
    its checked version, or is refused."""
    ser = distcomm.SafeSerializer()
    big = b"J" + (1 << 30).to_bytes(4, "little")  # BININT 2**30
    for raw in (P5 + glob("builtins", "bytearray") + big + b"\x85R.",  # REDUCE: checked
                P5 + glob("builtins", "bytes") + big + b"\x85\x81.",  # NEWOBJ: bytes.__new__(bytes, 2**30)
                P5 + glob("builtins", "tuple") + glob("builtins", "range") + big + b"\x85R\x85\x81.",
                P5 + glob("numpy", "ndarray") + b"K\x01\x85\x85R.",  # ndarray(shape)
                b"(cbuiltins\nbytes\nI1073741824\no.",  # OBJ: bytes(2**30)
                b"(I1073741824\nibuiltins\nbytearray\n.",  # INST: bytearray(2**30)
                P5 + b"]" + b")R."):  # a list called
        with pytest.raises(distcomm.UnsafePayloadError, match="refused"):
            ser.loads([memoryview(raw)])
    with pytest.raises(distcomm.UnsafePayloadError, match="not on the allowlist"):
        ser.loads([memoryview(pickle.dumps({"f": os.getcwd}, protocol=5))])
