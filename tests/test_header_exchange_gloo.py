"""The header exchange over blocks in gloo worlds of 6: results, errors and bytes whatever the
blocks, results that outlive its reused buffers, small broadcasts carried in its summary."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm._transfer.header_exchange import SUMMARY_CARRY, SUMMARY_CARRY_ACROSS
from distcomm.testing import spawn
from tests._helpers import _header_bytes
from tests.contract import header_blocks

LAYOUTS = {  # the header exchange's blocks in a gloo world of 6 (see header_blocks)
    "one machine": [[0, 1, 2, 3, 4, 5]],
    "hosts of one rank": [[0], [1, 2, 3], [4, 5]],
    "machines of 2": [[0, 1], [2, 3], [4, 5]],
    "uneven": [[0, 1], [2], [3, 4, 5]],
}


@contextlib.contextmanager
def _header_layout(comm: distcomm.Communicator, layout: str) -> Iterator[None]:
    """Lay the header exchange out as ``layout`` for the block's duration; then back as it was."""
    c: Any = comm
    if layout == "machines of 2":  # as set-up lays out machines of two ranks each, their groups reused
        c._set_machines([[0, 1], [2, 3], [4, 5]])
        try:
            assert c._blocks == LAYOUTS[layout] and c._block_group is c._local_group
            yield
        finally:
            c._set_machines([list(range(6))])
        return
    with header_blocks(comm, LAYOUTS[layout]):
        yield


def _headers_in(comm: distcomm.Communicator, layout: str) -> dict[str, Any]:
    """Beyond 4 ranks the gloo communicator exchanges header slots in native gathers and broadcasts
    over blocks of ranks: the same results and errors whatever the blocks, and the bytes they cost."""
    with _header_layout(comm, layout):
        r = comm.rank
        comm.reset_stats()
        comm.synchronize()
        st = comm.stats["synchronize"]
        out: dict[str, Any] = {"barrier": (st.bytes_sent, st.bytes_received)}
        got = comm.all_gather({"r": r, "s": "x" * r})
        out["all_gather"] = (got, comm.stats["all_gather"].bytes_received)
        out["broadcast"] = comm.broadcast({"from": r} if r == 3 else None, src=3)
        out["gather"] = comm.gather(r * 10, dst=2)
        out["scatter"] = comm.scatter([f"part {i}" for i in range(6)] if r == 4 else None, src=4)
        out["reduce_dict"] = {k: float(v) for k, v in comm.reduce_dict({"a": torch.tensor(float(r))}).items()}
        try:  # rank 0 calls another collective than its peers: every rank raises the same error
            comm.gather(r) if r == 0 else comm.all_gather(r)
        except distcomm.CollectiveMismatchError as e:
            out["mismatch"] = str(e)
        try:  # rank 5 alone calls another collective: the one odd slot, in the summary
            comm.gather(r) if r == 5 else comm.all_gather(r)
        except distcomm.CollectiveMismatchError as e:
            out["odd mismatch"] = str(e)
        out["after"] = comm.all_gather(r)
        return out


# each layout but one machine makes groups of its own, so the next test starts a world of 6 (10 s on
# 2 cores): hosts of one rank (the two levels) in make test, the others in make test-slow
@pytest.mark.parametrize("layout", [_l if _l == "hosts of one rank" else pytest.param(_l, marks=pytest.mark.slow)
                                    for _l in LAYOUTS])
def test_header_exchange_over_blocks_gloo(layout: str) -> None:
    n, blocks = 6, LAYOUTS[layout]
    carry = SUMMARY_CARRY_ACROSS if layout == "machines of 2" else SUMMARY_CARRY  # (machines, or one machine)
    results = spawn(lambda comm: _headers_in(comm, layout), n, timeout=120)
    for r, got in enumerate(results):
        assert got["barrier"] == _header_bytes(r, n, blocks, carry=carry)
        assert got["all_gather"][0] == [{"r": i, "s": "x" * i} for i in range(n)]
        assert got["all_gather"][1] >= _header_bytes(r, n, blocks, table=True, carry=carry)[1]  # (the sizes differ)
        assert got["broadcast"] == {"from": 3}
        assert got["gather"] == ([i * 10 for i in range(n)] if r == 2 else [])
        assert got["scatter"] == f"part {r}"
        assert got["reduce_dict"] == ({"a": 15 / n} if r == 0 else {"a": float(r)})
        assert got["mismatch"] == results[0]["mismatch"] and "rank 0" in got["mismatch"]
        assert got["odd mismatch"] == results[0]["odd mismatch"] and "rank 5" in got["odd mismatch"]
        assert got["after"] == list(range(n))


_TINY_OOB = distcomm.PickleSerializer(oob_threshold=1)


def _results_outlive_the_header_buffers(comm: distcomm.Communicator) -> Any:
    """What each call returned stays as it was after later calls reuse the header exchange's
    buffers, with every array out of band (a 1-byte threshold: a stream and a 4-byte buffer per
    object, the most segments a 64-byte slot's table holds)."""
    r = comm.rank
    # a timeout of each call's own, as a deadline gives: the exchange's calls take it up each time
    kept = [comm.all_gather(np.array([r * 10 + i], dtype=np.int32), timeout=60 + i) for i in range(3)]
    kept.append(comm.broadcast(np.array([7], dtype=np.int32) if r == 0 else None))
    comm.all_gather(np.array([-1], dtype=np.int32))  # one more call over the same buffers
    return [[int(a[0]) for a in got] for got in kept[:3]], int(kept[3][0])


@pytest.mark.slow  # worlds of 6 of their own (10 s each on 2 cores)
@pytest.mark.parametrize("layout", ["one machine", "hosts of one rank", "machines of 2"])
def test_results_outlive_the_reused_header_buffers(layout: str) -> None:
    def fn(comm: distcomm.Communicator) -> Any:
        with _header_layout(comm, layout):
            return _results_outlive_the_header_buffers(comm)

    for gathered, sent in spawn(fn, 6, timeout=120, serializer=_TINY_OOB):
        assert gathered == [[q * 10 + i for q in range(6)] for i in range(3)] and sent == 7


def _sized(comm: distcomm.Communicator, n: int) -> bytes:
    """A bytes object whose serialized segments add up to exactly ``n`` bytes."""
    k = n
    while sum(s.nbytes for s in comm.serializer.dumps(b"x" * k)) > n:
        k -= 1
    obj = b"x" * k
    assert sum(s.nbytes for s in comm.serializer.dumps(obj)) == n
    return obj


def _carried_broadcasts(comm: distcomm.Communicator, room: int) -> dict[str, Any]:
    """Broadcasts of small payloads beyond 4 ranks, where the summary has ``room`` bytes for them:
    what each rank got, and its bytes for each call beside a barrier's (the header exchange alone)."""
    r = comm.rank
    assert comm._summary_carry == room  # type: ignore[attr-defined]
    cases: dict[str, tuple[Any, int]] = {
        "fits": (_sized(comm, room), 0),
        "one byte over": (_sized(comm, room + 1), 0),
        "from rank 3": (_sized(comm, 100), 3),
        "out of band": ({"a": np.arange(9, dtype=np.int16), "s": "seed"}, 0),  # a stream and a buffer
        "seed": (None, 0),
    }
    comm.reset_stats()
    comm.synchronize()
    out: dict[str, Any] = {"barrier": (comm.stats["synchronize"].bytes_sent, comm.stats["synchronize"].bytes_received)}
    kept = []
    for name, (obj, root) in cases.items():
        comm.reset_stats()
        if name == "seed":
            got = comm.shared_random_seed()
            st = comm.stats["shared_random_seed"]
            kept.append(got)
            out[name] = (comm.all_gather(got), (st.bytes_sent, st.bytes_received))
            continue
        got = comm.broadcast(obj if r == root else None, src=root)
        st = comm.stats["broadcast"]
        kept.append(got)
        value = got if not isinstance(got, dict) else (got["a"].tolist(), got["s"])
        out[name] = (value, (st.bytes_sent, st.bytes_received))
    comm.all_gather(b"y" * room)  # later calls reuse the summary: the results are the ranks' own
    comm.broadcast(b"z" * 200 if r == 0 else None)
    out["kept"] = [k if not isinstance(k, dict) else (k["a"].tolist(), k["s"]) for k in kept]
    out["sizes"] = {name: sum(s.nbytes for s in comm.serializer.dumps(obj)) for name, (obj, _) in cases.items()}
    # a rank in another collective: the summary is the same size in every op, so every rank learns it
    for other in (lambda: comm.gather(r), lambda: comm.broadcast(b"s", src=5)):
        try:
            other() if r == 5 else comm.broadcast(b"s" * 10 if r == 0 else None)
        except distcomm.CollectiveMismatchError as e:
            out.setdefault("mismatch", []).append("rank 5: " in str(e))
    try:  # rank 0 alone broadcasts (its payload in the summary's room), the others in a barrier
        comm.broadcast(b"s" * 10) if r == 0 else comm.synchronize()
    except distcomm.CollectiveMismatchError as e:
        out.setdefault("mismatch", []).append("rank 0: broadcast" in str(e))
    out["after"], out["room"] = comm.all_gather(r), room
    return out


@pytest.mark.slow  # worlds of 6 of their own (10 s each on 2 cores)
@pytest.mark.parametrize("layout", ["one machine", "hosts of one rank", "machines of 2"])
def test_small_broadcast_from_rank_0_rides_in_the_header_summary(layout: str) -> None:
    """A broadcast from rank 0 whose segments fit the summary's room (``SUMMARY_CARRY`` on one
    machine, ``SUMMARY_CARRY_ACROSS`` across machines) travels in the header exchange's summary: no
    rank sends or receives more than in a barrier. One byte more, or another root, and it goes in a
    broadcast of its own after the exchange. Every rank gets the payload either way."""
    def fn(comm: distcomm.Communicator) -> Any:
        if layout == "machines of 2":  # declared machines: the summary crosses the network
            comm.create_local_groups(2)
            return _carried_broadcasts(comm, SUMMARY_CARRY_ACROSS)
        with _header_layout(comm, layout):  # blocks laid out so, on this one machine
            return _carried_broadcasts(comm, SUMMARY_CARRY)

    results = spawn(fn, 6, timeout=120, serializer=_TINY_OOB)
    want = results[0]
    assert want["fits"][0] == b"x" * len(want["fits"][0]) and want["out of band"][0] == (list(range(9)), "seed")
    seeds = {got["seed"][0][0] for got in results}
    assert len(seeds) == 1 and results[0]["seed"][0] == [seeds.pop()] * 6
    for r, got in enumerate(results):
        assert got["mismatch"] == [True, True, True] and got["after"] == list(range(6)), r
        for name in ("fits", "one byte over", "from rank 3", "out of band"):
            assert got[name][0] == want[name][0], (r, name)
        assert got["kept"] == [want[k][0] for k in ("fits", "one byte over", "from rank 3", "out of band")] + \
            [want["seed"][0][0]]
        for name, root in (("fits", 0), ("one byte over", 0), ("from rank 3", 3), ("out of band", 0), ("seed", 0)):
            sent, received = got[name][1]
            if name == "seed" or (root == 0 and want["sizes"][name] <= want["room"]):
                assert (sent, received) == got["barrier"], (r, name)  # carried: the exchange's bytes, no more
            elif r == root:  # a broadcast of its own after the exchange
                assert sent > got["barrier"][0] and received == got["barrier"][1], (r, name)
            else:
                assert received == got["barrier"][1] + want["sizes"][name], (r, name)
    assert want["sizes"]["out of band"] > SUMMARY_CARRY_ACROSS  # (carried on one machine only)
