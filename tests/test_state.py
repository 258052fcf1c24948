"""sync_state and check_identical: the whole training state (a model, Adam, a dict) on every member,
fingerprints first; refusals alike on every rank."""

from __future__ import annotations

import enum
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded, spawn

from ._helpers import count_calls
from ._jobs import ended, job_key_for


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A small model and its Adam after one step, both differing by ``seed``."""
    numbers = torch.Generator().manual_seed(seed)  # (not the global one: threaded ranks share it)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=numbers))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 4, generator=numbers)).sum().backward()
    opt.step()
    return model, opt


def _differ_then_sync(comm: distcomm.Communicator) -> dict[str, Any]:
    """Ranks 0 and 1 alike, the others not: who differs and where, then one state everywhere."""
    sends = count_calls(comm, "isend")
    model, opt = _trained(seed=max(comm.rank - 1, 0))
    progress = {"step": 10 + max(comm.rank - 1, 0)}
    with pytest.raises(distcomm.CollectiveMismatchError) as caught:
        comm.check_identical(model, opt, progress)
    comm.sync_state(model, opt, progress)
    sent = sends[0]
    comm.check_identical(model, opt, progress)
    comm.sync_state(model, opt, progress)  # all agree now: fingerprints only
    return {"error": str(caught.value), "ranks": caught.value.ranks, "progress": progress, "sent": sent,
            "sent_again": sends[0] - sent, "weight": next(model.parameters()).sum().item(),
            "adam_step": float(opt.state_dict()["state"][0]["step"])}


def _check_differ_then_sync(results: list[dict[str, Any]]) -> None:
    n = len(results)
    for r, got in enumerate(results):
        assert got["error"] == results[0]["error"], (r, got)
        assert got["ranks"] == tuple(range(2, n)), got
        assert "first at object 0 (Sequential), key '0.weight'" in got["error"], got
        assert got["progress"] == {"step": 10}, got
        assert got["weight"] == results[0]["weight"] and got["adam_step"] == 1.0, got
        assert got["sent_again"] == 0, (r, got)
    # one copy per rank that differs, striped over the two that hold the first member's state
    receivers = list(range(2, n))
    assert [got["sent"] for got in results] == [len(receivers[0::2]), len(receivers[1::2])] + [0] * (n - 2), results


def test_members_that_differ_are_named_then_given_the_first_members_state_threaded() -> None:
    _check_differ_then_sync(run_threaded(_differ_then_sync, 4, timeout=60))


def test_members_that_differ_are_named_then_given_the_first_members_state_gloo() -> None:
    _check_differ_then_sync(spawn(_differ_then_sync, 3, timeout=120))


def test_a_first_key_that_only_some_have_is_named() -> None:
    def fn(comm: distcomm.Communicator) -> str:
        state = {"a": torch.zeros(2), **({"b": torch.ones(1)} if comm.rank == 1 else {})}
        with pytest.raises(distcomm.CollectiveMismatchError) as caught:
            comm.check_identical(state)
        return str(caught.value)

    for got in run_threaded(fn, 2, timeout=60):
        assert "key 'b', which rank 0 lacks" in got, got


def test_what_is_no_state_is_refused_on_every_rank() -> None:
    def fn(comm: distcomm.Communicator) -> str:
        with pytest.raises(TypeError) as caught:
            comm.sync_state(torch.nn.Linear(1, 1), [1, 2] if comm.rank == 2 else {})
        return str(caught.value)

    for got in run_threaded(fn, 3, timeout=60):
        assert got.endswith("rank 2: object 1 is a list"), got


def test_different_numbers_of_objects_are_a_mismatch_on_every_rank() -> None:
    def fn(comm: distcomm.Communicator) -> tuple[int, ...]:
        with pytest.raises(distcomm.CollectiveMismatchError) as caught:
            comm.check_identical(*[{"x": torch.zeros(1)}] * (1 + (comm.rank == 1)))
        return caught.value.ranks

    assert run_threaded(fn, 3, timeout=60) == [(1,)] * 3


def _state_calls_crossed(comm: distcomm.Communicator) -> tuple[str, tuple[int, ...]]:
    model = _trained(comm.rank)[0]  # states that differ: check_identical would go on to a second exchange
    with pytest.raises(distcomm.CollectiveMismatchError) as caught:
        if comm.rank == 0:
            comm.sync_state(model)  # a newcomer's first call, beside members that left their loop
        else:
            comm.check_identical(model)
    return str(caught.value), caught.value.ranks


@pytest.mark.parametrize("run", ["threads", "gloo"])
def test_sync_state_beside_check_identical_is_a_mismatch_on_every_rank(run: str) -> None:
    """Both meet in one all_gather first: without naming the call, they waited in different ones."""
    outs = run_threaded(_state_calls_crossed, 2, timeout=60) if run == "threads" else \
        spawn(_state_calls_crossed, 2, timeout=60)
    for text, ranks in outs:
        assert ranks == (1,), outs
        assert "rank 0: sync_state (call #" in text, text
        assert "rank 1: check_identical (call #" in text and text.count(" at test_state.py:") == 2, text


def test_the_doubles_agree_with_themselves() -> None:
    """A world of one, and a fake whose peers echo its own calls, hold one state."""
    model, opt = _trained(seed=0)
    for comm in (distcomm.LocalCommunicator(), FakeCommunicator(rank=1, world_size=3)):
        comm.sync_state(model, opt)
        comm.check_identical(model, opt)


@pytest.mark.parametrize(("ours", "theirs"), [
    ({"step": 5, "pending": []}, {"step": 5}),
    ({0: torch.ones(1)}, {"0": torch.ones(1)}),
    ({"a": {"b": 1}}, {"a.b": 1}),
    ({"a": {}}, {"a": []}),
    ({"a": (1, 2)}, {"a": [1, 2]}),
])
def test_states_that_differ_in_structure_alone_differ(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """Equal leaves under different keys, key types or containers are different state: a rank that
    lacked "pending" would lack it after sync_state too."""
    def fn(comm: distcomm.Communicator) -> tuple[str, tuple[int, ...], Any]:
        state = dict(ours if comm.rank == 0 else theirs)
        with pytest.raises(distcomm.CollectiveMismatchError) as caught:
            comm.check_identical(state)
        comm.sync_state(state)
        comm.check_identical(state)
        return str(caught.value), caught.value.ranks, sorted(map(repr, state))

    outs = run_threaded(fn, 2, timeout=60)
    assert outs[0] == outs[1], outs
    text, ranks, keys = outs[0]
    assert ranks == (1,) and "differs from rank 0's; first at object 0 (dict)" in text, text
    assert keys == sorted(map(repr, ours)), keys


def test_a_missing_key_is_named_and_handed_over_between_processes() -> None:
    def fn(comm: distcomm.Communicator) -> tuple[str, dict[str, Any]]:
        state: dict[str, Any] = {"step": 5, **({"pending": []} if comm.rank == 0 else {})}
        with pytest.raises(distcomm.CollectiveMismatchError) as caught:
            comm.check_identical(state)
        comm.sync_state(state)
        return str(caught.value), state

    for text, state in spawn(fn, 2, timeout=60):
        assert text.endswith("first at object 0 (dict), key 'pending' (rank(s) [1])"), text
        assert state == {"step": 5, "pending": []}, state


_SETS_OF_STRINGS = """
    import json, distcomm
    comm = distcomm.from_env()
    state = {"tags": {f"tag {i}" for i in range(40)}, "seen": frozenset({"a", "b", "c"}), "step": 3,
             frozenset({"x", "y", "z"}): 1}  # (a key too)
    sent = []
    real_isend = comm.isend
    comm.isend = lambda *a, **k: sent.append(1) or real_isend(*a, **k)
    comm.check_identical(state)
    comm.sync_state(state)
    print(json.dumps({"order": list(state["tags"]), "sent": len(sent)}), flush=True)
    comm.close()
"""


def test_equal_sets_are_equal_state_in_processes_of_different_hash_seeds(tmp_path: Path) -> None:
    """Each process orders a set of strings by its own hash seed (its pickle too): equal sets are
    still equal state, and nothing is sent for them."""
    script = tmp_path / "sets.py"
    script.write_text(textwrap.dedent(_SETS_OF_STRINGS))
    port = distcomm.free_port()
    procs = {r: subprocess.Popen(
        [sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONHASHSEED": str(r + 1), "RANK": str(r),
             "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
             "DISTCOMM_JOB_KEY": job_key_for(port)}) for r in range(2)}
    out = ended(procs)
    for rc, lines, stderr in out.values():
        assert rc == 0 and lines, stderr
    (_, [first], _), (_, [second], _) = out[0], out[1]
    assert first["order"] != second["order"], "the two processes ordered the set alike: the test shows nothing"
    assert first["sent"] == second["sent"] == 0, (first, second)


def _odd_tensors() -> dict[str, Any]:
    return {"sparse": torch.eye(3).to_sparse(), "csr": torch.eye(3).to_sparse_csr(),
            "conj": torch.tensor([1 + 2j]).conj(), "neg": torch.ones(2)._neg_view(),
            "meta": torch.empty(2, device="meta"), "lazy": torch.nn.LazyLinear(2).state_dict(),
            "nested": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]),
            "objects": np.array([1, "a", None], dtype=object)}


def test_every_kind_of_tensor_has_a_fingerprint() -> None:
    """Sparse, compressed, conjugate and negative views, meta and a lazy module's parameters: each
    fingerprinted by the values it holds (a view's, not its memory's), on every rank alike."""
    def fn(comm: distcomm.Communicator) -> str:
        comm.check_identical(_odd_tensors())  # alike on every rank
        resolved = {**_odd_tensors(), "conj": torch.tensor([1 - 2j]), "neg": -torch.ones(2)}
        comm.check_identical(resolved if comm.rank else _odd_tensors())  # the same values
        differ = {**_odd_tensors(), "conj": torch.tensor([1 + 2j])}
        with pytest.raises(distcomm.CollectiveMismatchError) as caught:
            comm.check_identical(differ if comm.rank else _odd_tensors())
        return str(caught.value)

    for text in spawn(fn, 2, timeout=60):
        assert text.endswith("key 'conj' (rank(s) [1])"), text


def test_a_lazy_module_not_run_yet_is_handed_the_trained_state() -> None:
    """torch loads a trained state into a lazy module; a rank whose module hasn't run is a rank
    whose state differs, not one whose fingerprint fails while the others wait."""
    def fn(comm: distcomm.Communicator) -> list[int]:
        model = torch.nn.Sequential(torch.nn.LazyLinear(3))
        if comm.rank == 0:
            model(torch.ones(1, 4))
        with pytest.raises(distcomm.CollectiveMismatchError):
            comm.check_identical(model)
        comm.sync_state(model)
        comm.check_identical(model)
        return list(model[0].weight.shape)

    assert spawn(fn, 2, timeout=60) == [[3, 4]] * 2


class _Unreadable(torch.nn.Module):
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise RuntimeError("this rank's buffers are gone")


def test_a_state_one_rank_cannot_read_fails_the_call_on_every_rank() -> None:
    def fn(comm: distcomm.Communicator) -> tuple[str, str, tuple[int, ...]]:
        model = _Unreadable() if comm.rank == 1 else torch.nn.Linear(1, 1)
        with pytest.raises(distcomm.CollectiveError) as caught:
            comm.sync_state(model)
        return type(caught.value).__name__, str(caught.value), caught.value.ranks

    for name, text, ranks in spawn(fn, 2, timeout=60):
        assert (name, ranks) == ("CollectiveError", (1,)), text
        assert text == ("sync_state: rank(s) [1] could not read their state; rank 1: RuntimeError: this rank's "
                        "buffers are gone"), text


def _state_call_beside_all_gather(comm: distcomm.Communicator) -> tuple[str, tuple[int, ...]]:
    with pytest.raises(distcomm.CollectiveMismatchError) as caught:
        if comm.rank == 0:
            comm.check_identical({"step": 1})
        else:
            comm.all_gather({"step": 1})
    return str(caught.value), caught.value.ranks


@pytest.mark.parametrize("run", ["threads", "gloo"])
def test_a_state_call_beside_an_all_gather_is_a_mismatch_naming_both(run: str) -> None:
    """The state calls' exchanges are their own: an all_gather on another rank doesn't return the
    state call's fingerprints as rank 0's object."""
    outs = run_threaded(_state_call_beside_all_gather, 2, timeout=60) if run == "threads" else \
        spawn(_state_call_beside_all_gather, 2, timeout=60)
    for text, ranks in outs:
        assert ranks == (1,), outs
        assert "rank 0: check_identical (call #" in text, text
        assert "rank 1: all_gather (call #" in text and text.count(" at test_state.py:") == 2, text


def test_equal_dicts_are_equal_state_whatever_order_their_keys_came_in() -> None:
    def fn(comm: distcomm.Communicator) -> int:
        state = {"a": 1, "b": torch.ones(2)} if comm.rank else {"b": torch.ones(2), "a": 1}
        sends = count_calls(comm, "isend")
        comm.check_identical(state)
        comm.sync_state(state)
        return sends[0]

    assert run_threaded(fn, 2, timeout=60) == [0, 0]


class Color(enum.Enum):
    RED = 1


def test_keys_of_the_users_own_classes_are_compared_and_named() -> None:
    """check_identical sends the keys of a state that differs as text: the safe loader never meets
    the user's classes there (a state keyed by an enum raised UnsafePayloadError)."""
    def fn(comm: distcomm.Communicator) -> str:
        state = {Color.RED: torch.full((2,), float(comm.rank))}
        with pytest.raises(distcomm.CollectiveMismatchError) as caught:
            comm.check_identical(state)
        return str(caught.value)

    for text in spawn(fn, 2, timeout=60):
        assert text.endswith("key 'Color.RED' (rank(s) [1])"), text


def test_the_state_calls_on_a_closed_communicator_are_refused_as_any_call() -> None:
    def fn(comm: distcomm.Communicator) -> list[str]:
        sub = comm.split(0)
        sub.close()
        said = []
        for call in (sub.sync_state, sub.check_identical, sub.all_gather):
            with pytest.raises(distcomm.CommunicatorStateError) as caught:
                call({"step": 1})
            said.append(str(caught.value))
        return said

    for run in (run_threaded, spawn):
        for said in run(fn, 2, timeout=60):
            assert all("is closed" in s for s in said), said


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("this rank's handle can't be pickled")


class _LoadFails(torch.nn.Module):
    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        raise AssertionError("a check of the user's")


@pytest.mark.parametrize("where", ["sender", "receiver"])
def test_a_state_that_cant_be_sent_or_loaded_fails_the_call_on_every_rank(where: str) -> None:
    """The source can't serialize the state, or a rank's load_state_dict raises what it likes: every
    rank raises SerializationError in the call (the others waited until the timeout)."""
    def fn(comm: distcomm.Communicator) -> tuple[str, str]:
        if comm.rank == 0:
            model: Any = {"handle": _Unpicklable()} if where == "sender" else {"w": torch.ones(1)}
        else:
            model = _LoadFails() if where == "receiver" else {"handle": None}
            comm._holds_state = False  # (a newcomer: rank 0 is the source)
        with pytest.raises(distcomm.SerializationError) as caught:
            comm.sync_state(model)
        return type(caught.value).__name__, str(caught.value)

    for _, text in spawn(fn, 2, timeout=60):
        assert "could not send or load the state rank 0 holds" in text, text
        assert ("can't serialize" in text) if where == "sender" else ("AssertionError: a check of the user's" in text)
