"""NcclCommunicator on real GPUs: `make test-gpu` (skips with a reason where there is no CUDA).

World size = the number of visible CUDA devices (one rank per device; 1 is enough to check device
binding, the gloo side group for objects, CUDA tensors inside objects and reduce_dict on CUDA).
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch

import distcomm
from distcomm.testing import spawn
from tests._helpers import count_exchanges
from tests.contract import check, exercise

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and NCCL (no CUDA device here)"),
]


def world() -> int:
    return max(1, torch.cuda.device_count())


def nccl_checks(comm: distcomm.Communicator) -> dict[str, Any]:
    assert isinstance(comm, distcomm.NcclCommunicator)
    r, n = comm.rank, comm.world_size
    dev = comm.device
    out: dict[str, Any] = {"device": str(dev), "current": torch.cuda.current_device()}
    # CUDA tensors inside objects travel through CPU and land on the receiver's own device
    got = comm.all_gather({"t": torch.full((1000,), float(r), device=dev)})
    out["devices"] = [str(g["t"].device) for g in got]
    out["sums"] = [float(g["t"].sum()) for g in got]
    cpu_side = distcomm.NcclCommunicator(device=dev, receive_cuda_on="cpu")
    out["cpu_devices"] = [str(g["t"].device) for g in cpu_side.all_gather({"t": torch.ones(3, device=dev)})]
    cpu_side.close()
    # reduce_dict on CUDA scalars runs over NCCL and stays on the device
    red = comm.all_reduce_dict({"loss": torch.tensor(float(r), device=dev)}, average=False)
    out["reduced"] = (float(red["loss"]), str(red["loss"].device))
    comm.synchronize()  # barrier with device_ids
    out["contract"] = exercise(comm)
    out["n"] = n
    return out


def test_nccl_communicator() -> None:
    n = world()
    results = spawn(nccl_checks, n, backend="nccl", timeout=300)
    for r, out in enumerate(results):
        assert out["device"] == f"cuda:{r}" and out["current"] == r
        assert out["devices"] == [f"cuda:{r}"] * n
        assert out["sums"] == [1000.0 * i for i in range(n)]
        assert out["cpu_devices"][r] == f"cuda:{r}" and all(d == "cpu" for i, d in enumerate(out["cpu_devices"])
                                                           if i != r)
        assert out["reduced"] == (float(sum(range(n))), f"cuda:{r}")
        check(out["contract"], local=(r, n))


def test_nccl_bad_device() -> None:
    def fn(comm: distcomm.Communicator) -> str:
        try:
            distcomm.NcclCommunicator(device=torch.cuda.device_count() + 3)
            return "no error"
        except ValueError as e:
            return str(e)

    assert all("does not exist" in msg for msg in spawn(fn, 1, backend="nccl", timeout=120))


def helper_over_an_nccl_group(comm: distcomm.Communicator) -> Any:
    import torch.distributed as dist

    group = dist.new_group(list(range(comm.world_size)), backend="nccl")
    got = distcomm.all_gather({"r": comm.rank}, group=group)
    child = comm._children[group]
    return got, type(child).__name__, str(child.device)


def test_module_helpers_over_an_nccl_group_use_an_nccl_communicator() -> None:
    n = world()
    for r, (got, kind, device) in enumerate(spawn(helper_over_an_nccl_group, n, backend="nccl", timeout=300)):
        assert got == [{"r": i} for i in range(n)]
        assert kind == "NcclCommunicator" and device == f"cuda:{r}"


def per_step_on_the_device(comm: distcomm.Communicator) -> dict[str, Any]:
    """The per-step calls agree in one NCCL all_reduce, with no exchange over the gloo side group;
    a mismatch still raises the same error on every rank (through that exchange)."""
    exchanges = count_exchanges(comm)
    dev = comm.device
    comm.synchronize()
    comm.all_reduce_dict({"loss": torch.tensor(1.0, device=dev)})
    comm.all_reduce(torch.ones(4, device=dev))
    out: dict[str, Any] = {"exchanges": exchanges[0]}
    try:
        comm.all_reduce_dict({f"k{comm.rank}": torch.tensor(1.0, device=dev)})
        out["mismatch"] = "no error" if comm.world_size > 1 else "one rank"
    except distcomm.CollectiveMismatchError as e:
        out["mismatch"] = str(e)
    return out


def test_nccl_per_step_calls_agree_on_the_device() -> None:
    results = spawn(per_step_on_the_device, world(), backend="nccl", timeout=300)
    for out in results:
        assert out["exchanges"] == 0
        assert out["mismatch"] == results[0]["mismatch"] != "no error"


def test_from_env_under_torchrun_picks_nccl(tmp_path: Any) -> None:
    """distcomm.from_env() under torchrun on a CUDA machine: NCCL, one device per local rank."""
    n = world()
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, distcomm\n"
        "with distcomm.from_env(timeout=120) as comm, distcomm.use(comm):\n"
        "    t = torch.full((4,), float(comm.rank), device=comm.device)\n"
        "    comm.all_reduce(t)\n"
        "    print('NCCL', type(comm).__name__, comm.launcher, comm.device, float(t[0]), flush=True)\n")
    out = _torchrun(script, n)
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("NCCL"))
    assert lines == sorted(f"NCCL NcclCommunicator torchrun cuda:{r} {float(sum(range(n)))}" for r in range(n))


def test_a_shrink_that_lost_no_one_remakes_the_nccl_group(tmp_path: Any) -> None:
    """shrink() and admit() on NCCL: the new membership's NCCL group made afresh on the same device
    (one GPU: nobody can be lost; the kill tests of several ranks wait for a machine with two)."""
    n = world()
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, distcomm\n"
        "comm = distcomm.from_env(timeout=120)\n"
        "new = comm.shrink()\n"
        "assert new.admit() is new\n"
        "t = torch.full((4,), float(new.rank), device=new.device)\n"
        "new.all_reduce(t)\n"
        "print('SHRUNK', type(new).__name__, new.device, new.membership.job_ranks, float(t[0]), flush=True)\n"
        "new.close()\n")
    out = _torchrun(script, n)
    lines = sorted(line for line in out.stdout.splitlines() if line.startswith("SHRUNK"))
    assert lines == sorted(f"SHRUNK NcclCommunicator cuda:{r} {tuple(range(n))} {float(sum(range(n)))}"
                           for r in range(n))


def test_an_fsdp_mesh_follows_a_shrink_on_nccl(tmp_path: Any) -> None:
    """comm.device_mesh() on NCCL: FSDP2 over the mesh steps on the GPU, and again after a shrink
    (that lost no one: one GPU) remade the mesh's NCCL groups under it, FSDP untouched."""
    n = world()
    script = tmp_path / "job.py"
    script.write_text(
        "import torch, distcomm\n"
        "from torch.distributed.fsdp import fully_shard\n"
        "comm = distcomm.from_env(timeout=120)\n"
        "mesh = comm.device_mesh((1, comm.world_size), ('replicate', 'shard'))\n"
        "model = torch.nn.Linear(16, 16, device=comm.device)\n"
        "fully_shard(model, mesh=mesh)\n"
        "opt = torch.optim.Adam(model.parameters())\n"
        "def step():\n"
        "    model(torch.randn(8, 16, device=comm.device)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "step()\n"
        "comm = comm.shrink()\n"
        "comm.sync_state(model, opt)\n"
        "step()\n"
        "comm.check_identical(model, opt)\n"
        "print('MESH', mesh.device_type, mesh.get_group('shard').size(), comm.membership.job_ranks, flush=True)\n"
        "comm.close()\n")
    out = _torchrun(script, n)
    lines = [line for line in out.stdout.splitlines() if line.startswith("MESH")]
    assert lines == [f"MESH cuda {n} {tuple(range(n))}"] * n


def _torchrun(script: Any, n: int) -> subprocess.CompletedProcess[str]:
    """``script`` under torchrun with ``n`` processes on this machine; it must succeed."""
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--master-addr",
                          "127.0.0.1", "--master-port", str(distcomm.free_port()), str(script)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def cpu_tensors_beside_cuda_ones(comm: distcomm.Communicator) -> dict[str, Any]:
    """CPU tensors handed to an NcclCommunicator travel over its gloo side group (as with torch's
    default group, cpu:gloo,cuda:nccl), beside CUDA tensors over NCCL, checked and unchecked."""
    r, n, dev = comm.rank, comm.world_size, comm.device
    out: dict[str, Any] = {}
    counter = torch.tensor([r + 1], dtype=torch.int64)
    comm.all_reduce(counter)
    out["all_reduce"] = (counter.tolist(), str(counter.device))
    fast = torch.ones(3)
    comm.all_reduce(fast, check=False)
    out["unchecked"] = fast.tolist()
    mean = torch.full((2,), float(r))
    comm.all_reduce(mean, "mean")
    out["mean"] = mean.tolist()
    gathered = comm.all_gather_tensor(torch.full((r + 1, 2), float(r)))  # uneven rows
    out["gather"] = (gathered.shape[0], str(gathered.device))
    b = torch.full((4,), float(r))
    comm.broadcast_tensor(b, src=0)
    out["broadcast"] = b.tolist()
    scattered = comm.reduce_scatter_tensor(torch.ones(2 * n))
    out["reduce_scatter"] = (scattered.tolist(), str(scattered.device))
    on_gpu = torch.ones(2, device=dev)
    comm.all_reduce(on_gpu)
    out["cuda"] = (on_gpu.tolist(), str(on_gpu.device))
    out["dict"] = {k: (float(v), str(v.device)) for k, v in comm.all_reduce_dict({"cpu": torch.tensor(1.0)},
                                                                                  average=False).items()}
    return out


def test_nccl_takes_cpu_tensors_over_its_gloo_group() -> None:
    n = world()
    for out in spawn(cpu_tensors_beside_cuda_ones, n, backend="nccl", timeout=300):
        assert out["all_reduce"] == ([n * (n + 1) // 2], "cpu")
        assert out["unchecked"] == [float(n)] * 3
        assert out["mean"] == [sum(range(n)) / n] * 2
        assert out["gather"] == (n * (n + 1) // 2, "cpu")
        assert out["broadcast"] == [0.0] * 4
        assert out["reduce_scatter"] == ([float(n)] * 2, "cpu")
        assert out["cuda"][0] == [float(n)] * 2 and out["cuda"][1].startswith("cuda")
        assert out["dict"] == {"cpu": (float(n), "cpu")}
