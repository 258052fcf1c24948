"""distcomm.compat.mmengine against mmengine.dist (0.10.7) itself, on the same gloo ranks and in a
process without torch.distributed: every name's return value, its arguments after the call (in
place or not) and its errors compared value by value and dtype by dtype on every rank; a bad
argument on one rank raises mmengine's error type on every rank."""

from __future__ import annotations

import inspect
import os
import tempfile
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm.testing import spawn

from ._compat_diff import Case, compare, raised_alike

mmengine_dist = pytest.importorskip("mmengine.dist", reason="mmengine-lite is in the dev extra: pip install -e .[dev]")
import distcomm.compat.mmengine as compat  # noqa: E402

INTS, FLOATS = (torch.int64, torch.int32, torch.uint8), (torch.float32, torch.float64)


def _tensor(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.tensor([[1, 2, 3], [4, 5, 7]]) * (rank + 1) + rank).to(dtype)


def _all_reduce(op: str, dtype: torch.dtype) -> Case:
    def case(m: Any, rank: int, world: int) -> Any:
        data = _tensor(rank, dtype)
        return m.all_reduce(data, op), data
    return case


def _all_reduce_negative(m: Any, rank: int, world: int) -> Any:
    data = torch.tensor([-3, -4, 5], dtype=torch.int64) * (rank + 1)
    return m.all_reduce(data, "mean"), data


def _all_reduce_dict(op: str, dtypes: tuple[torch.dtype, ...]) -> Case:
    def case(m: Any, rank: int, world: int) -> Any:
        data = {f"k{i}": _tensor(rank, dt)[: i + 1] for i, dt in reversed(list(enumerate(dtypes)))}
        return m.all_reduce_dict(data, op), data
    return case


def _all_reduce_params(coalesce: bool, bucket_size_mb: int, op: str) -> Case:
    def case(m: Any, rank: int, world: int) -> Any:
        params = [_tensor(rank, dt) for dt in (torch.int64, torch.float32, torch.int64, torch.float64)]
        params += [torch.full((300_000,), float(rank + 1)), torch.nn.Parameter(torch.ones(3) * rank)]
        return m.all_reduce_params((p for p in params), coalesce=coalesce, bucket_size_mb=bucket_size_mb,
                                   op=op), params
    return case


def _tensor_calls(m: Any, rank: int, world: int) -> Any:
    t = _tensor(rank, torch.float32)
    gathered = m.gather(t, dst=1)
    if gathered:
        gathered[1].add_(100)  # mmengine's entries are copies: ``t`` stays as it was
    b0, b1 = _tensor(rank, torch.int64), _tensor(rank, torch.float64).t()  # non-contiguous too
    return (m.all_gather(t), m.gather(t), gathered, t, m.broadcast(b0, 0), b0, m.broadcast(b1, 1), b1)


def _objects(m: Any, rank: int, world: int) -> Any:
    obj = {"rank": rank, "t": torch.arange(3) * rank, "a": np.ones(2, np.float16) * rank}
    items = [obj, "x"] if rank == 1 else [None, None]
    return (m.all_gather_object(obj), m.gather_object(obj), m.gather_object(obj, dst=1),
            m.broadcast_object_list(items, src=1), items)


def _seed(m: Any, rank: int, world: int) -> Any:
    np.random.seed(1234 + rank)  # rank 0's draw is everyone's
    return m.sync_random_seed()


def _collect(size: int, device: str, parts: list[list[Any]], tmpdir: bool = False) -> Case:
    def case(m: Any, rank: int, world: int) -> Any:
        where = None
        if tmpdir:  # one directory on both ranks: mmengine writes there, and removes it on rank 0
            where = [tempfile.mkdtemp() if rank == 0 else None]
            m.broadcast_object_list(where)
        got = m.collect_results(parts[rank], size, device=device, tmpdir=None if where is None else where[0])
        m.barrier()
        return got, None if where is None else os.path.exists(where[0])
    return case


def _who(m: Any, rank: int, world: int) -> Any:
    import torch.distributed as dist

    @m.master_only
    def on_main(x: int) -> int:
        return x + 1

    return (m.get_dist_info(), m.get_rank(), m.get_world_size(), m.is_main_process(), m.is_distributed(),
            m.get_backend(), m.get_default_group() is dist.group.WORLD, m.get_comm_device(), on_main(1),
            m.barrier(), m.infer_launcher(), m.get_data_device({"a": torch.ones(1)}),
            m.cast_data_device([torch.ones(2, dtype=torch.int32)], torch.device("cpu")))


def _refused_by_both(m: Any, rank: int, world: int) -> Any:  # every rank passes it: no rank waits
    calls = {"all_reduce op": lambda: m.all_reduce(torch.ones(1), "avg"),
             "broadcast_object_list of a str": lambda: m.broadcast_object_list("foo"),
             "all_reduce_dict of a str": lambda: m.all_reduce_dict("foo"),
             "all_reduce_dict of {}": lambda: m.all_reduce_dict({}),
             "collect_results device": lambda: m.collect_results([1], 2, device="tpu"),
             "collect_results gpu with tmpdir": lambda: m.collect_results([1], 2, device="gpu", tmpdir="x"),
             "cast_data_device out of another type": lambda: m.cast_data_device([torch.ones(1)], "cpu", out=()),
             "get_data_device of nothing": lambda: m.get_data_device([])}
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "returned"
        except Exception as e:
            out[name] = next(c for c in type(e).__mro__ if c.__module__ == "builtins").__name__
    return out


CASES: dict[str, Case] = {
    **{f"all_reduce {op} {dt}": _all_reduce(op, dt) for op in ("sum", "mean", "product", "MIN", "max")
       for dt in INTS + FLOATS},
    **{f"all_reduce {op} {dt}": _all_reduce(op, dt) for op in ("band", "bor", "bxor") for dt in INTS},
    "all_reduce mean of negative ints (truncated)": _all_reduce_negative,
    **{f"all_reduce_dict {op} {dts}": _all_reduce_dict(op, dts) for op in ("sum", "mean", "max")
       for dts in ((torch.int64,), (torch.float32, torch.float32), (torch.int64, torch.float32))},
    **{f"all_reduce_params coalesce={c} bucket={b} {op}": _all_reduce_params(c, b, op)
       for c, b, op in ((True, -1, "sum"), (True, 1, "mean"), (False, -1, "mean"), (True, -1, "max"))},
    "all_gather, gather, broadcast": _tensor_calls,
    "object collectives": _objects,
    "sync_random_seed": _seed,
    "collect_results gpu": _collect(4, "gpu", [["foo", {1: 2}], [24, {"a": "b"}]]),
    "collect_results cpu padding dropped": _collect(3, "cpu", [["foo", 2], [24, "pad"]], tmpdir=True),
    "collect_results None dropped, uneven": _collect(9, "gpu", [[None, 1, 2], [3]]),
    "who and where": _who,
    "refused by both": _refused_by_both,
}


def _differential(comm: distcomm.Communicator) -> dict[str, Any]:
    import mmengine.dist

    return compare(CASES, mmengine.dist, compat, comm.rank, comm.world_size)


@pytest.fixture(scope="module")
def gloo_results() -> list[dict[str, Any]]:
    return spawn(_differential, 2, timeout=240)


@pytest.mark.parametrize("case", list(CASES))
def test_compat_matches_mmengine_on_every_rank(gloo_results: list[dict[str, Any]], case: str) -> None:
    assert [got[case] for got in gloo_results] == [None, None]


SINGLE = {name: CASES[name] for name in ("all_reduce mean torch.int64", "all_reduce_dict mean (torch.int64,)",
                                         "all_reduce_params coalesce=True bucket=1 mean", "object collectives",
                                         "sync_random_seed", "collect_results gpu", "refused by both",
                                         "collect_results cpu padding dropped")}


TORCHRUN_RANK_1 = {"TORCHELASTIC_RUN_ID": "r", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}


@pytest.mark.parametrize("started_by", ["python", "torchrun, before init_dist"])
def test_compat_matches_mmengine_without_torch_distributed(monkeypatch: pytest.MonkeyPatch, started_by: str) -> None:
    """mmengine answers as a world of one whenever torch.distributed is not initialized; under a
    launcher, before init_dist, half of compat did and half raised CommunicatorStateError."""
    import torch.distributed as dist

    if started_by != "python":
        for var, value in TORCHRUN_RANK_1.items():
            monkeypatch.setenv(var, value)
    assert not dist.is_initialized()
    assert compare(SINGLE, mmengine_dist, compat, 0, 1) == dict.fromkeys(SINGLE)
    assert (compat.get_dist_info(), compat.is_distributed(), compat.get_backend(), compat.get_local_group(),
            compat.get_local_rank(), compat.get_local_size()) == ((0, 1), False, None, None, 0, 1)


@pytest.mark.parametrize("name", mmengine_dist.__all__)
def test_every_name_with_mmengines_signature(name: str) -> None:
    ours, theirs = inspect.signature(getattr(compat, name)), inspect.signature(getattr(mmengine_dist, name))
    assert list(ours.parameters) == list(theirs.parameters), name
    assert [p.default for p in ours.parameters.values()] == [p.default for p in theirs.parameters.values()]
    assert sorted(compat.__all__) == sorted(mmengine_dist.__all__)


def _refused_on_one_rank(comm: distcomm.Communicator) -> dict[str, Any]:
    r = comm.rank
    return {  # rank 1 alone passes what mmengine refuses (mmengine raises there and leaves rank 0 waiting)
        "broadcast_object_list": raised_alike(lambda: compat.broadcast_object_list("foo" if r else [1]),
                                              AssertionError),
        "all_reduce_dict": raised_alike(lambda: compat.all_reduce_dict("foo" if r else {"x": torch.ones(1)}),
                                        AssertionError),
        "all_reduce_dict empty": raised_alike(lambda: compat.all_reduce_dict({} if r else {"x": torch.ones(1)}),
                                              ValueError),
        "all_reduce_dict values": raised_alike(
            lambda: compat.all_reduce_dict({"x": 1.0 if r else torch.ones(1)}), TypeError),
        "collect_results device": raised_alike(lambda: compat.collect_results([1], 2, "tpu" if r else "cpu"),
                                               NotImplementedError),
        "collect_results tmpdir": raised_alike(
            lambda: compat.collect_results([1], 2, "gpu", tmpdir="x" if r else None), AssertionError),
        "after": compat.all_gather_object(r),  # the communicator goes on
    }


def test_a_refused_argument_raises_mmengines_error_on_every_rank() -> None:
    got = spawn(_refused_on_one_rank, 2, timeout=120)
    for case in got[0]:
        if case != "after":
            assert got[0][case] == got[1][case] and "rank 1" in got[0][case][1], (case, got)
    assert got[0]["after"] == [0, 1]


def test_init_dist_refuses_what_it_cant_start() -> None:
    with pytest.raises(ValueError, match="Invalid launcher type: local"):
        compat.init_dist("local", backend="gloo")
    with pytest.raises(TypeError, match="timeout in seconds"):
        compat.init_dist("pytorch", backend="gloo", timeout="30")
    with pytest.raises(ValueError, match="init_backend='torch' only"):
        compat.init_dist("pytorch", init_backend="deepspeed")


@pytest.mark.parametrize("launcher, env, inferred", [
    ("slurm", {"SLURM_JOB_ID": "9", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_NTASKS": "4",
               "SLURM_NODELIST": "n[1-2]", "SLURM_LOCALID": "1", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_NODEID": "1"},
     "slurm"),
    ("mpi", {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
             "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "MASTER_ADDR": "h0", "MASTER_PORT": "1234"}, "mpi"),
    ("pytorch", {"TORCHELASTIC_RUN_ID": "r", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                 "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}, "pytorch"),
])
def test_init_dist_starts_from_the_launchers_variables(monkeypatch: pytest.MonkeyPatch, launcher: str,
                                                       env: dict[str, str], inferred: str) -> None:
    """Read as distcomm.from_env reads them: nothing copied into os.environ (mmengine copies
    Slurm's and Open MPI's into torchrun's), but an explicit port, as mmengine writes it."""
    for var in list(os.environ):
        if var.startswith(("SLURM_", "OMPI_", "PMI_", "MV2_", "TORCHELASTIC_")) or var in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    started = []
    monkeypatch.setattr(compat, "from_env", lambda backend, timeout: started.append((backend, timeout)))
    before = dict(os.environ)
    compat.init_dist(launcher, backend="gloo", timeout=30)
    assert started == [("gloo", 30)] and dict(os.environ) == before
    assert compat.infer_launcher() == inferred
    if launcher == "slurm":  # mmengine's _init_dist_slurm alone takes a port
        compat.init_dist(launcher, backend="gloo", port=29555)
        assert os.environ["MASTER_PORT"] == "29555"
        return
    # mmengine passes it on to init_process_group, which refuses it; under torchrun, writing it
    # over the agent's MASTER_PORT left every rank waiting for the timeout
    with pytest.raises(TypeError, match=f"init_dist\\('{launcher}'\\) takes no port"):
        compat.init_dist(launcher, backend="gloo", port=29555)
    assert dict(os.environ) == before and started == [("gloo", 30)]


@pytest.mark.parametrize("kwarg", ["init_method", "world_size", "rank", "store", "group_name", "pg_options",
                                   "device_id", "prot"])
def test_init_dist_refuses_what_it_would_drop(monkeypatch: pytest.MonkeyPatch, kwarg: str) -> None:
    """mmengine passes its other keyword arguments to init_process_group; distcomm starts from the
    launcher's variables, and dropped them without a word."""
    monkeypatch.setattr(compat, "from_env", lambda backend, timeout: pytest.fail("started"))
    with pytest.raises(TypeError, match=f"init_dist takes timeout.*not {kwarg}="):
        compat.init_dist("pytorch", backend="gloo", timeout=30, **{kwarg: 1})


def test_before_init_dist_under_a_launcher_it_answers_as_mmengine(monkeypatch: pytest.MonkeyPatch) -> None:
    """mmengine answers (0, 1) until init_dist; distcomm's own helpers refuse a silent world of one."""
    for var, value in TORCHRUN_RANK_1.items():
        monkeypatch.setenv(var, value)
    assert (compat.get_dist_info(), compat.is_main_process(), compat.is_distributed()) == ((0, 1), True, False)
    assert compat.barrier() is None


def _outside_cases(g: Any) -> dict[str, Case]:
    """Calls over ``g`` (global ranks 0 and 1): on rank 2, outside it, torch's get_world_size is -1."""
    def t(rank: int) -> torch.Tensor:
        return torch.tensor([1.0, 2.0]) * (rank + 1)

    def in_place(call: Callable[[Any, torch.Tensor], Any]) -> Case:
        def case(m: Any, rank: int, world: int) -> Any:
            data = t(rank)
            return call(m, data), data
        return case

    def seed(m: Any, rank: int, world: int) -> Any:
        np.random.seed(1234 + rank)
        return m.sync_random_seed(g)

    def items(m: Any, rank: int, world: int) -> Any:
        data = [rank, "x"]
        return m.broadcast_object_list(data, 1, g), data

    def as_dict(m: Any, rank: int, world: int) -> Any:
        data = {"a": t(rank), "b": torch.tensor([rank])}
        return m.all_reduce_dict(data, "mean", g), data

    return {
        "all_reduce": in_place(lambda m, d: m.all_reduce(d, "sum", g)),
        "all_reduce mean": in_place(lambda m, d: m.all_reduce(d, "mean", g)),
        "broadcast": in_place(lambda m, d: m.broadcast(d, 1, g)),
        "all_reduce_params": in_place(lambda m, d: m.all_reduce_params([d], group=g)),
        "all_reduce_dict": as_dict,
        "broadcast_object_list": items,
        "barrier": lambda m, rank, world: m.barrier(g),
        "all_gather_object": lambda m, rank, world: m.all_gather_object(rank, g),
        "gather_object": lambda m, rank, world: m.gather_object(rank, 0, g),
        "all_gather": lambda m, rank, world: m.all_gather(t(rank), g),
        "gather": lambda m, rank, world: m.gather(t(rank), 0, g),
        "sync_random_seed": seed,
        "who": lambda m, rank, world: (m.get_dist_info(g), m.is_main_process(g), m.get_backend(g)),
    }


def _outside_a_group(comm: distcomm.Communicator) -> dict[str, Any]:
    import mmengine.dist
    import torch.distributed as dist

    g = dist.new_group([0, 1])
    return compare(_outside_cases(g), mmengine.dist, compat, comm.rank, comm.world_size)


def test_a_rank_outside_the_group_does_as_mmengine() -> None:
    """torch's get_world_size(group) is -1 there: mmengine's in-place calls return, its object
    calls return empty answers; compat raised "Invalid process group specified"."""
    got = spawn(_outside_a_group, 3, timeout=240)
    assert got == [dict.fromkeys(_outside_cases(None))] * 3


def test_install_puts_mmengines_own_calls_on_distcomm() -> None:
    """The one-line swap reaches the job's own calls only: mmengine's sampler, evaluator and
    master_only wrappers kept calling mmengine.dist (a world of one here, torch.distributed off)."""
    import mmengine.dataset.sampler as sampler
    import mmengine.dist.dist
    import mmengine.dist.utils
    import mmengine.evaluator.metric as metric

    from distcomm.testing import FakeCommunicator

    @mmengine_dist.master_only  # mmengine's wrapper, made before install()
    def on_main() -> str:
        return "ran"

    originals = {name: getattr(mmengine_dist, name) for name in mmengine_dist.__all__}
    fake = FakeCommunicator(1, 2)
    uninstall = compat.install()
    try:
        assert compat.install() is uninstall
        with distcomm.use(fake):
            data = {"a": torch.tensor(1.0)}
            got = (sampler.get_dist_info(), mmengine.dist.utils.get_world_size(), mmengine_dist.is_distributed(),
                   mmengine_dist.all_gather_object("x"), metric.collect_results(["r"], 2), on_main(),
                   mmengine.dist.dist.all_reduce_dict(data, "sum"), data["a"].item())
        assert got == ((1, 2), 2, True, ["x", "x"], None, None, None, 2.0)
        assert [c.op for c in fake.calls] == ["all_gather", "gather", "all_reduce"]
        assert all(getattr(mmengine_dist, name) is getattr(compat, name) for name in mmengine_dist.__all__)
    finally:
        uninstall()
    assert {name: getattr(mmengine_dist, name) for name in mmengine_dist.__all__} == originals
    assert sampler.get_dist_info is originals["get_dist_info"] and metric.collect_results is originals[
        "collect_results"] and mmengine.dist.utils.is_main_process is originals["is_main_process"]
    with distcomm.use(fake):
        assert sampler.get_dist_info() == (0, 1) and on_main() == "ran"  # mmengine's own again


def test_install_reaches_modules_imported_afterwards() -> None:
    """In a fresh interpreter: install() before mmengine's sampler and evaluator are imported."""
    import subprocess
    import sys

    script = (
        "import distcomm.compat.mmengine as dist\n"
        "dist.install()\n"
        "import mmengine.dataset.sampler as s, mmengine.evaluator.metric as m, mmengine.model.base_module as b\n"
        "import mmengine.dist\n"
        "assert s.get_dist_info is dist.get_dist_info and s.sync_random_seed is dist.sync_random_seed\n"
        "assert m.collect_results is dist.collect_results and b.master_only is dist.master_only\n"
        "assert mmengine.dist.init_dist is dist.init_dist\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("launcher", ["torchrun", "distcomm run", "slurm", "openmpi", "mpich", "mvapich", "pals",
                                      "lsf", "kubeflow", "env", "python"])
def test_every_launcher_distcomm_detects_has_mmengines_name(monkeypatch: pytest.MonkeyPatch, launcher: str) -> None:
    """mmengine knows four launchers; each of distcomm's is one of them (PBS's and LSF's raised KeyError)."""
    monkeypatch.setattr(compat, "detect", lambda: types.SimpleNamespace(launcher=launcher))
    assert compat.infer_launcher() in ("pytorch", "slurm", "mpi", "none")
