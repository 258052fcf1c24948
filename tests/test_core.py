"""The active communicator, the module-level helpers, construction errors and the public surface."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import multiprocessing as mp
import threading

import pytest
import torch

import distcomm
from distcomm.testing import FakeCommunicator, spawn


def test_all_is_sorted_and_complete() -> None:
    assert list(distcomm.__all__) == sorted(distcomm.__all__)
    for name in distcomm.__all__:
        assert hasattr(distcomm, name), name
    public = {n for n, v in vars(distcomm).items()
              if n[0].isalpha() and not inspect.ismodule(v) and n != "annotations"}
    assert public <= set(distcomm.__all__), public - set(distcomm.__all__)
    assert list(distcomm.testing.__all__) == sorted(distcomm.testing.__all__)


def test_error_hierarchy() -> None:
    for name in ("CollectiveError", "SerializationError", "CollectiveMismatchError", "CollectiveTimeoutError",
                 "PayloadTooLargeError", "PeerError", "FrameError", "UnsafePayloadError"):
        assert issubclass(getattr(distcomm, name), distcomm.CollectiveError), name
    assert issubclass(distcomm.CollectiveError, distcomm.DistCommError)
    assert issubclass(distcomm.UnsafePayloadError, distcomm.SerializationError)


def test_current_defaults_to_local() -> None:
    comm = distcomm.current()
    assert isinstance(comm, distcomm.LocalCommunicator)
    assert (distcomm.get_rank(), distcomm.get_world_size(), distcomm.get_local_rank(), distcomm.get_local_size()) \
        == (0, 1, 0, 1)
    assert distcomm.is_main_process()
    x = object()
    assert distcomm.all_gather(x)[0] is x
    assert distcomm.gather(x) == [x]
    assert distcomm.broadcast(x) is x
    assert distcomm.scatter([x]) is x
    d = {"b": torch.tensor(1.0), "a": torch.tensor(2.0)}
    assert list(distcomm.reduce_dict(d)) == ["a", "b"]
    assert 0 <= distcomm.shared_random_seed() < 2**31
    distcomm.synchronize()


def test_use_nests_and_restores_after_exception() -> None:
    a, b = FakeCommunicator(0, 2), FakeCommunicator(1, 3)
    with distcomm.use(a):
        assert distcomm.current() is a
        with pytest.raises(RuntimeError):
            with distcomm.use(b):
                assert distcomm.current() is b
                assert distcomm.get_rank() == 1 and distcomm.get_world_size() == 3
                raise RuntimeError("boom")
        assert distcomm.current() is a
    assert isinstance(distcomm.current(), distcomm.LocalCommunicator)
    with pytest.raises(TypeError, match="Communicator"):
        with distcomm.use("not a communicator"):  # type: ignore[arg-type]
            pass


def test_use_is_per_thread_and_per_task() -> None:
    seen: dict[str, int] = {}
    barrier = threading.Barrier(2)

    def worker(rank: int) -> None:
        with distcomm.use(FakeCommunicator(rank, 2)):
            barrier.wait()
            seen[f"thread{rank}"] = distcomm.get_rank()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen == {"thread0": 0, "thread1": 1}

    async def task(rank: int) -> int:
        with distcomm.use(FakeCommunicator(rank, 4)):
            await asyncio.sleep(0.01)
            return distcomm.get_rank()

    async def main() -> list[int]:
        return list(await asyncio.gather(*(task(r) for r in range(4))))

    assert asyncio.run(main()) == [0, 1, 2, 3]


def test_helpers_delegate_to_active() -> None:
    comm = FakeCommunicator(1, 3)
    with distcomm.use(comm):
        assert distcomm.get_rank() == 1 and distcomm.get_world_size() == 3 and not distcomm.is_main_process()
        assert distcomm.all_gather("x") == ["x", "x", "x"]
        assert distcomm.gather("x") == []
        assert distcomm.gather("x", dst=1) == ["x", "x", "x"]
        assert distcomm.broadcast("y", src=2) == "y"
        assert distcomm.scatter(["a", "b", "c"], src=0) == "b"
        out = distcomm.all_reduce_dict({"l": torch.tensor(2.0)}, average=False)
        assert float(out["l"]) == 6.0
        distcomm.synchronize()
    assert [c.op for c in comm.calls] == ["all_gather", "gather", "gather", "broadcast", "scatter",
                                          "all_reduce_dict", "synchronize"]


def test_helper_signatures_match_the_reference() -> None:
    want = {
        "get_world_size": [], "get_rank": [], "get_local_rank": [], "get_local_size": [], "is_main_process": [],
        "synchronize": [], "shared_random_seed": [],
        "all_gather": [("data", inspect.Parameter.empty), ("group", None)],
        "gather": [("data", inspect.Parameter.empty), ("dst", 0), ("group", None)],
        "reduce_dict": [("input_dict", inspect.Parameter.empty), ("average", True)],
    }
    for name, params in want.items():  # the reference's parameters first; anything added is optional
        got = list(inspect.signature(getattr(distcomm, name)).parameters.values())
        assert [(p.name, p.default) for p in got[: len(params)]] == params, name
        assert all(p.default is not inspect.Parameter.empty for p in got[len(params) :]), name


def test_gloo_before_init_says_how_to_start() -> None:
    with pytest.raises(distcomm.CommunicatorStateError, match=r"from_env\(\).*launch.*init_process_group"):
        distcomm.GlooCommunicator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_nccl_without_cuda_names_cuda() -> None:
    with pytest.raises(distcomm.CommunicatorStateError, match="CUDA and NCCL"):
        distcomm.NcclCommunicator()


def test_bad_arguments_are_clear() -> None:
    with pytest.raises(ValueError, match="timeout"):
        distcomm.LocalCommunicator(timeout=-1)
    with pytest.raises(TypeError, match="timeout"):
        distcomm.LocalCommunicator(timeout="soon")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_bytes"):
        distcomm.LocalCommunicator(max_bytes=-5)
    with pytest.raises(ValueError, match="slot_bytes"):
        distcomm.LocalCommunicator(slot_bytes=10)
    with pytest.raises(TypeError, match="serializer"):
        distcomm.LocalCommunicator(serializer="pickle")  # type: ignore[arg-type]
    comm = distcomm.LocalCommunicator()
    with pytest.raises(ValueError, match="dst=1 is out of range"):
        comm.gather(1, dst=1)
    with pytest.raises(ValueError, match="src=-1 is out of range"):
        comm.broadcast(1, src=-1)
    with pytest.raises(TypeError, match="dst must be an int"):
        comm.gather(1, dst="0")  # type: ignore[arg-type]
    with pytest.raises(distcomm.CollectiveError, match="got 2 objects for world_size 1"):  # as at world 2
        comm.scatter([1, 2])
    with pytest.raises(TypeError, match="dict of tensors"):
        comm.reduce_dict([1, 2])  # type: ignore[arg-type]
    with pytest.raises(distcomm.CollectiveError, match="not a tensor or a number"):
        comm.reduce_dict({"a": "1.0"})
    with pytest.raises(ValueError, match="op must be one of 'sum', 'mean', 'max', 'min'"):
        comm.all_reduce_dict({"a": 1.0}, op="prod")
    with pytest.raises(TypeError, match="average must be a bool"):
        comm.all_reduce_dict({"a": 1.0}, average="mean")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size must be"):
        FakeCommunicator(0, 0)
    with pytest.raises(ValueError, match="rank=3 is out of range"):
        FakeCommunicator(3, 2)


def test_closed_communicator_refuses() -> None:
    comm = distcomm.LocalCommunicator()
    with comm:
        assert comm.all_gather(1) == [1]
    with pytest.raises(distcomm.CommunicatorStateError, match="closed"):
        comm.all_gather(1)
    comm.close()  # idempotent


def _use_in_child(comm: distcomm.Communicator, q: mp.Queue) -> None:  # type: ignore[type-arg]
    try:
        comm.all_gather(1)
        q.put("no error")
    except distcomm.CommunicatorStateError as e:
        q.put(str(e))


@pytest.mark.skipif(not hasattr(mp, "get_context") or "fork" not in mp.get_all_start_methods(), reason="needs fork")
def test_refuses_to_work_after_fork() -> None:
    comm = distcomm.LocalCommunicator()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_use_in_child, args=(comm, q))
    p.start()
    msg = q.get(timeout=30)
    p.join(10)
    assert "forked process" in msg


def _implicit(comm: distcomm.Communicator) -> dict[str, object]:
    # a fresh context has no active communicator: the helpers adopt the default group
    def body() -> dict[str, object]:
        adopted = distcomm.current()
        return {"type": type(adopted).__name__, "rank": distcomm.get_rank(), "world": distcomm.get_world_size(),
                "all": distcomm.all_gather(comm.rank * 10), "same": distcomm.current() is adopted,
                "gather": distcomm.gather(comm.rank, group=comm.group)}  # type: ignore[attr-defined]

    return contextvars.Context().run(body)


def test_helpers_adopt_the_default_group() -> None:
    out = spawn(_implicit, 2, timeout=120)
    for r, o in enumerate(out):
        assert o == {"type": "GlooCommunicator", "rank": r, "world": 2, "all": [0, 10], "same": True,
                     "gather": [0, 1] if r == 0 else []}


def _local_info(comm: distcomm.Communicator) -> tuple[int, int, int, bool]:
    return comm.local_rank, comm.local_size, comm.world_size, comm.is_main_process


def test_gloo_subgroup_and_machine_names() -> None:
    def fn(comm: distcomm.Communicator) -> object:
        import torch.distributed as dist

        sub = dist.new_group([1, 2])
        out: object = None
        if comm.rank in (1, 2):
            with distcomm.GlooCommunicator(sub, machine=f"m{comm.rank}") as c:
                out = (c.rank, c.world_size, c.local_rank, c.local_size, c.all_gather(comm.rank))
        comm.synchronize()
        return out

    assert spawn(fn, 3, timeout=120) == [None, (0, 2, 0, 1, [1, 2]), (1, 2, 0, 1, [1, 2])]


def test_module_helpers_over_another_gloo_group() -> None:
    """``group=`` a torch group: a communicator of the group's backend, kept by the active one."""
    def fn(comm: distcomm.Communicator) -> object:
        import torch.distributed as dist

        pair = dist.new_group([0, 2])
        out: object = None
        if comm.rank in (0, 2):
            out = (distcomm.all_gather(comm.rank, group=pair), type(comm._children[pair]).__name__)
        comm.synchronize()
        return out

    assert spawn(fn, 3, timeout=120, reuse=False) == [([0, 2], "GlooCommunicator"), None,
                                                      ([0, 2], "GlooCommunicator")]


def test_spawn_reuses_a_world_only_while_it_is_intact() -> None:
    import os as _os

    def pid_and_state(comm: distcomm.Communicator) -> tuple[int, int, list[str]]:
        seen = getattr(comm, "_alltoall_copy_bytes")
        comm._alltoall_copy_bytes = 7  # type: ignore[misc] # a setting this call changes: reset for the next
        comm.all_gather(1)
        return _os.getpid(), seen, sorted(comm.stats)

    def fails_on_rank_1(comm: distcomm.Communicator) -> None:
        if comm.rank == 1:
            raise ValueError("once")

    first = spawn(pid_and_state, 2, timeout=60, reuse=True)
    second = spawn(pid_and_state, 2, timeout=60, reuse=True)
    assert [p for p, _, _ in first] == [p for p, _, _ in second]  # the same processes
    assert {s for _, s, _ in second} == {distcomm.Communicator._alltoall_copy_bytes}
    assert all(names == ["all_gather"] for _, _, names in first + second)  # stats start empty each call
    with pytest.raises(distcomm.RankFailedError, match="rank 1"):
        spawn(fails_on_rank_1, 2, timeout=60, reuse=True)
    third = spawn(pid_and_state, 2, timeout=60, reuse=True)
    assert not {p for p, _, _ in third} & {p for p, _, _ in first}  # a fresh world after a failure

    def changes_a_setting(comm: distcomm.Communicator) -> int:
        comm.create_local_groups(1)  # a state a fresh world wouldn't have: the world isn't kept
        return _os.getpid()

    changed = spawn(changes_a_setting, 2, timeout=60, reuse=True)
    fourth = spawn(pid_and_state, 2, timeout=60, reuse=True)
    assert not set(changed) & {p for p, _, _ in fourth}


def test_main_process_flag_travels_as_a_plain_bool() -> None:
    comm = FakeCommunicator(0, 2, serializer=distcomm.SafeSerializer())
    assert comm.is_main_process is True
    got = comm.all_gather({"main": comm.is_main_process})
    assert got[1] == {"main": True} and type(got[1]["main"]) is bool


def _mismatched_with_small_slots(comm: distcomm.Communicator) -> str:
    r = comm.rank
    try:
        comm.gather(r) if r == 0 else comm.all_gather(r)
    except distcomm.CollectiveMismatchError as e:
        return f"{e} ranks={e.ranks}"
    return "no error"


@pytest.mark.slow  # a gloo world of its own
def test_mismatch_report_survives_the_call_sites_exchange_at_any_slot_size() -> None:
    """The call sites travel in an exchange of 256-byte slots: with slot_bytes=256 it reuses the
    slots' buffer, and the report still names each rank's own call."""
    for text in spawn(_mismatched_with_small_slots, 3, timeout=120, slot_bytes=256):
        assert "rank 0: gather root=0 (call #1) at test_core.py" in text, text
        assert "ranks 1-2: all_gather (call #1) at test_core.py" in text and text.endswith("ranks=(0,)"), text
