"""mmengine.dist (0.10.7), every name of its ``__all__``, over the current communicator.

    import distcomm.compat.mmengine as dist        # was: import mmengine.dist as dist

The signatures, return values and in-place conventions are mmengine's: ``all_reduce``,
``broadcast``, ``all_reduce_dict`` and ``all_reduce_params`` work in place and return None;
``gather_object`` and ``collect_results`` return None off the destination; an integer mean is
truncated back into the integer tensor; ``group=`` is a torch process group, ``src``/``dst`` global
ranks. Behind them, ``distcomm.current()`` (or a communicator over ``group``): objects travel
through distcomm's pipeline, tensors through its checked tensor collectives, so a rank with a
mismatched tensor or an unpicklable object makes every rank raise instead of hanging. What
differs from mmengine: docs/migration.md. ``install()`` puts mmengine's own modules (its Runner,
samplers, hooks, evaluators) on these functions too.
"""

from __future__ import annotations

import datetime
import functools
import importlib
import itertools
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._api import get_local_rank as _local_rank
from .._api import get_local_size as _local_size
from .._api import get_rank as _rank
from .._api import get_world_size as _world_size
from .._calls import Op
from .._communicator import Communicator
from .._context import active, current
from .._launching.from_env import from_env
from .._launching.launchers import detect
from .._local import LocalCommunicator
from .._ops import op_name
from . import torch as _objects
from ._common import communicator, refuse, root_rank, translated

__all__ = [
    "all_gather_object", "all_reduce", "all_gather", "all_reduce_dict", "collect_results", "collect_results_cpu",
    "collect_results_gpu", "gather", "broadcast", "gather_object", "sync_random_seed", "broadcast_object_list",
    "get_dist_info", "init_dist", "init_local_group", "get_backend", "get_world_size", "get_rank", "get_local_size",
    "get_local_group", "get_local_rank", "is_main_process", "master_only", "barrier", "is_distributed",
    "get_default_group", "all_reduce_params", "get_data_device", "get_comm_device", "cast_data_device",
    "infer_launcher",
]

_F = TypeVar("_F", bound=Callable[..., Any])

# ---------------------------------------------------------------------------------- who and where


def is_distributed() -> bool:
    """Whether a world of more than one process is set up: a communicator installed (other than
    a LocalCommunicator), or torch.distributed initialized."""
    comm = active()
    if comm is not None:
        return not isinstance(comm, LocalCommunicator)
    return dist.is_available() and dist.is_initialized()


# Outside a distributed job (before init_dist too, where a launcher started the process and
# distcomm's own helpers refuse a silent world of one), mmengine answers as a world of one.

def get_world_size(group: Any = None) -> int:
    """The number of ranks of the current communicator (1 outside a distributed job), or of ``group``."""
    if group is not None:
        return dist.get_world_size(group)
    return _world_size() if is_distributed() else 1


def get_rank(group: Any = None) -> int:
    """This process's rank in the current communicator (0 outside a distributed job), or in ``group``."""
    if group is not None:
        return dist.get_rank(group)
    return _rank() if is_distributed() else 0


def get_dist_info(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` of the current communicator, or of ``group``."""
    return get_rank(group), get_world_size(group)


def is_main_process(group: Any = None) -> bool:
    """Whether this is rank 0 of the current communicator, or of ``group``."""
    return get_rank(group) == 0


def master_only(func: _F) -> _F:
    """Decorate ``func`` to run on rank 0 only; it returns None elsewhere."""

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return func(*args, **kwargs) if is_main_process() else None

    return wrapper  # type: ignore[return-value]


def _outside(group: Any) -> bool:
    """Whether this rank is outside ``group``: torch's world size is -1 there, and mmengine's calls
    over it return (in-place ones leaving the data as it was, ``all_gather_object`` an empty list)."""
    return group is not None and get_world_size(group) < 0


def _comm(group: Any) -> Communicator:
    """The communicator of ``group``, or a world of one where mmengine answers as one: before
    ``init_dist`` (no communicator, torch.distributed not initialized: also where a launcher
    started this process, which ``distcomm.current()`` refuses) and on a rank outside ``group``."""
    if _outside(group):
        return LocalCommunicator()
    if group is None and not is_distributed():
        return active() or LocalCommunicator()  # (an installed LocalCommunicator, or a new one)
    return communicator(group)


def get_local_size() -> int:
    """The number of ranks on this machine (1 outside a distributed job)."""
    return _local_size() if is_distributed() else 1


def get_local_rank() -> int:
    """This process's rank on its machine (0 outside a distributed job)."""
    return _local_rank() if is_distributed() else 0


def get_local_group() -> Any:
    """The torch process group of the ranks on this machine (None outside a distributed job)."""
    return current().local_group if is_distributed() else None


def init_local_group(node_rank: int, num_gpus_per_node: int) -> None:
    """Group the ranks by machine as ``rank // num_gpus_per_node`` (``node_rank`` is this
    machine's index in that grouping). Collective."""
    current().create_local_groups(num_gpus_per_node)


def get_default_group() -> Any:
    """The torch process group of the current communicator (None where it has none)."""
    comm = active()
    if comm is None and dist.is_available() and dist.is_initialized():
        return dist.distributed_c10d._get_default_group()
    return current().group


def get_backend(group: Any = None) -> str | None:
    """The backend of ``group`` or of the current communicator ("gloo", "nccl"; None outside a
    distributed job or where the communicator has no torch group)."""
    if not is_distributed():
        return None
    group = get_default_group() if group is None else group
    return None if group is None else str(dist.get_backend(group))


def get_comm_device(group: Any = None) -> torch.device:
    """The device the tensor collectives of ``group`` (or of the current communicator) run on."""
    if group is None and not is_distributed():
        return torch.device("cpu")
    if get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def get_data_device(data: torch.Tensor | Mapping[Any, Any] | Iterable[Any]) -> torch.device:
    """The one device of the tensors in ``data`` (a tensor, or a dict or sequence of them).

    Raises:
        ValueError: the tensors are on different devices, or ``data`` holds none.
        TypeError: ``data`` is none of these.
    """
    if isinstance(data, torch.Tensor):
        return data.device
    if isinstance(data, Mapping):
        items: Iterable[Any] = data.values()
    elif isinstance(data, Iterable) and not isinstance(data, str):
        items = data
    else:
        raise TypeError(f"data should be a Tensor, sequence of tensor or dict, but got {data}")
    devices = {get_data_device(item) for item in items}
    if len(devices) > 1:
        raise ValueError(f"device type in data should be consistent, but got {' and '.join(map(str, devices))}")
    if not devices:
        raise ValueError("data should not be empty.")
    return devices.pop()


def cast_data_device(data: Any, device: torch.device, out: Any = None) -> Any:
    """``data`` with its tensors moved to ``device`` (those already there kept), of ``data``'s types;
    with ``out`` (of the same structure), also copied into ``out``'s tensors.

    Raises:
        TypeError: ``data`` holds something else than tensors, dicts and sequences; ``out`` is of
            another type than ``data``, or a set.
        ValueError: ``data`` is empty, or ``out`` a dict of another length.
    """
    if out is not None and type(data) is not type(out):
        raise TypeError(f"out should be the same type with data, but got data is {type(data)} and out is "
                        f"{type(out)}")
    if isinstance(out, set):
        raise TypeError("out should not be a set")
    if isinstance(data, torch.Tensor):
        moved = data if data.device == device else data.to(device)
        if out is not None:
            out.copy_(moved)
        return moved
    if isinstance(data, Mapping):
        if out is not None and len(data) != len(out):
            raise ValueError(f"length of data and out should be same, but got {len(data)} and {len(out)}")
        casted = {k: cast_data_device(v, device, None if out is None else out[k]) for k, v in data.items()}
    elif isinstance(data, Iterable) and not isinstance(data, (str, np.ndarray)):
        pairs = zip(data, out, strict=False) if out is not None else ((v, None) for v in data)
        casted = [cast_data_device(v, device, o) for v, o in pairs]  # type: ignore[assignment]
    else:
        raise TypeError(f"data should be a Tensor, list of tensor or dict, but got {data}")
    if not casted:
        raise ValueError("data should not be empty")
    return type(data)(casted)


# ---------------------------------------------------------------------------------- starting a job


# distcomm's launcher names as mmengine's
_MMENGINE_LAUNCHERS = {"torchrun": "pytorch", "distcomm run": "pytorch", "env": "pytorch", "kubeflow": "pytorch",
                       "slurm": "slurm", "openmpi": "mpi", "mpich": "mpi", "mvapich": "mpi", "pals": "mpi",
                       "lsf": "mpi", "python": "none"}


def infer_launcher() -> str:
    """Who started this process: "pytorch" (torchrun, ``distcomm run``, a Kubeflow PyTorchJob, or
    RANK / WORLD_SIZE set), "slurm" (srun), "mpi" (Open MPI, MPICH, Intel MPI, MVAPICH, PBS's
    mpiexec, LSF's jsrun) or "none", as ``distcomm.from_env`` finds it."""
    return _MMENGINE_LAUNCHERS[detect().launcher]


def init_dist(launcher: str, backend: str = "nccl", init_backend: str = "torch", **kwargs: Any) -> None:
    """Start this process's communicator from its launcher's environment, as the process-wide default.

    Args:
        launcher: "pytorch" (torchrun), "slurm" or "mpi". The variables are read as
            ``distcomm.from_env`` reads them whatever this says (every launcher it knows, explicit
            MASTER_ADDR / MASTER_PORT winning), so nothing is copied into ``os.environ``.
        backend: "nccl" or "gloo".
        init_backend: "torch" only (mmengine also takes "deepspeed" and "colossalai").
        kwargs: ``timeout`` in seconds (the rendezvous's and the collectives'); ``port`` for
            "slurm" only, as mmengine takes it: the rendezvous port (written to MASTER_PORT, as
            mmengine does; else one derived from the job id).

    As mmengine's, it makes "spawn" multiprocessing's start method when none is set.

    Raises:
        TypeError: ``port`` for "pytorch" or "mpi" (mmengine hands it to init_process_group, which
            refuses it; under torchrun the agent's MASTER_PORT is the rendezvous port, and another
            would leave every rank waiting), or another of init_process_group's arguments
            (``init_method``, ``rank``, ``store``...), which the launcher's variables decide here.
    """
    timeout = kwargs.pop("timeout", None)
    if timeout is not None and not isinstance(timeout, (int, float, datetime.timedelta)):
        raise TypeError(f"Timeout for distributed training must be provided as timeout in seconds, but we've "
                        f"received the type {type(timeout)}. Please specify the timeout like this: "
                        f"dist_cfg=dict(backend='nccl', timeout=1800)")
    if init_backend != "torch":
        raise ValueError(f"distcomm starts jobs with init_backend='torch' only, got {init_backend!r}")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"distcomm's backends are 'nccl' and 'gloo', got {backend!r}")
    if launcher not in ("pytorch", "slurm", "mpi"):
        raise ValueError(f"Invalid launcher type: {launcher}")
    port = kwargs.pop("port", None)
    if port is not None and launcher != "slurm":
        raise TypeError(f"init_dist({launcher!r}) takes no port: the rendezvous port is the launcher's MASTER_PORT "
                        f"(torchrun's --master-port), as in mmengine, whose init_process_group refuses port=")
    if kwargs:  # (mmengine passes them to init_process_group: dropping them would change the job unseen)
        raise TypeError(f"init_dist takes timeout (and port for 'slurm'), not "
                        f"{', '.join(f'{k}=' for k in sorted(kwargs))}: distcomm starts the job from the "
                        f"launcher's variables (see distcomm.from_env)")
    if mp.get_start_method(allow_none=True) is None:
        mp.set_start_method("spawn")
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    from_env(backend, timeout=timeout)


# ---------------------------------------------------------------------------------- tensors, in place

# mmengine's op names (any case) as distcomm's; the bitwise ones fold the tensors in rank order
_OPS = {"sum": "sum", "mean": "mean", "product": "prod", "min": "min", "max": "max", "band": "band", "bor": "bor",
        "bxor": "bxor"}
_BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


def _reduce_op(op: Any) -> str:
    name = _OPS.get(op.lower()) if isinstance(op, str) else op_name(op)  # (torch's ReduceOp too)
    if name is None:
        raise ValueError(f"reduce op should be one of {list(_OPS)}, but got {op}")
    return name


def _all_reduce(comm: Communicator, data: torch.Tensor, name: str) -> None:
    """Reduce ``data`` in place with distcomm's op ``name``; "mean" as mmengine takes it: the sum
    divided, an integer tensor getting the quotient truncated."""
    if name in _BITWISE:
        data.copy_(comm.all_reduce_object(data, _BITWISE[name]))
        return
    comm.all_reduce(data, "sum" if name == "mean" else name)
    if name == "mean":
        data.copy_(torch.true_divide(data, comm.world_size))


def all_reduce(data: torch.Tensor, op: str = "sum", group: Any = None) -> None:
    """Reduce ``data`` across ranks, in place. ``op``: "sum", "mean", "product", "min", "max",
    "band", "bor", "bxor" (any case) or torch's ReduceOp. Outside a distributed job or ``group``: nothing."""
    if get_world_size(group) <= 1:
        return
    _all_reduce(communicator(group), data, _reduce_op(op))


def all_gather(data: torch.Tensor, group: Any = None) -> list[torch.Tensor]:
    """Every rank's tensor (of one shape and dtype on every rank), by rank, on every rank."""
    if get_world_size(group) == 1:
        return [data]
    with torch.no_grad():  # (mmengine's result takes no part in autograd)
        rows = communicator(group).all_gather_tensor(data.unsqueeze(0))
    return list(rows.unbind(0))


def gather(data: torch.Tensor, dst: int = 0, group: Any = None) -> list[torch.Tensor]:
    """Every rank's tensor, by rank, on ``dst`` (a global rank); ``[]`` elsewhere."""
    if get_world_size(group) == 1:
        return [data]
    comm = communicator(group)
    out = comm.gather(data, root_rank(group, dst, None))
    if out:
        out[comm.rank] = data.clone()  # (a copy, as mmengine's)
    return out


def broadcast(data: torch.Tensor, src: int = 0, group: Any = None) -> None:
    """Copy ``src``'s tensor (a global rank) into every rank's ``data``, in place (outside ``group``: nothing)."""
    if get_world_size(group) <= 1:
        return
    communicator(group).broadcast_tensor(data, root_rank(group, src, None))


def sync_random_seed(group: Any = None) -> int:
    """A random int in [0, 2**31) drawn on rank 0, the same on every rank."""
    seed = np.random.randint(2**31)
    if get_world_size(group) == 1:
        return seed
    comm = communicator(group)
    # an int32 tensor on every rank, as mmengine makes (its tests fix the seed by patching torch.tensor)
    mine = torch.tensor(seed if comm.rank == 0 else 0, dtype=torch.int32)
    return int(comm.broadcast(int(mine), 0))


def all_reduce_dict(data: dict[Any, torch.Tensor], op: str = "sum", group: Any = None) -> None:
    """Reduce every value of ``data`` across ranks (the same keys and shapes on every rank); the
    values are replaced in place by the reduced ones, in the dtype the values share. Outside
    ``group``: nothing."""
    comm = _comm(group)
    if not isinstance(data, dict):
        refuse(comm, Op.ALL_REDUCE, -1, AssertionError, f"data must be a dict, got {type(data).__name__}")
    if comm.world_size == 1:
        return
    if not data:  # (mmengine's torch.cat of no tensors raises ValueError)
        refuse(comm, Op.ALL_REDUCE, -1, ValueError, "torch.cat(): expected a non-empty list of Tensors")
    name = _reduce_op(op)
    keys = sorted(data)
    try:
        flat = torch.cat([data[k].flatten() for k in keys])  # one dtype: torch.cat's promotion
    except Exception as e:
        refuse(comm, Op.ALL_REDUCE, -1, TypeError, f"the values must be tensors: {e}")
    translated(_all_reduce, comm, flat, name)
    for k, value in zip(keys, torch.split(flat, [data[k].numel() for k in keys]), strict=True):
        data[k] = value.reshape(data[k].shape)


def _buckets(tensors: list[torch.Tensor], bucket_size_mb: int) -> Iterable[list[torch.Tensor]]:
    """The tensors by type (dtype and device), in order; in buckets of at most ``bucket_size_mb``
    MiB where it is positive (a larger tensor alone)."""
    by_type: dict[str, list[torch.Tensor]] = {}
    for t in tensors:
        by_type.setdefault(t.type(), []).append(t)
    limit = bucket_size_mb << 20 if bucket_size_mb > 0 else None
    for group in by_type.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for t in group:
            nbytes = t.numel() * t.element_size()
            if bucket and limit is not None and size + nbytes > limit:
                yield bucket
                bucket, size = [], 0
            bucket.append(t)
            size += nbytes
        yield bucket


def all_reduce_params(params: Iterable[torch.Tensor], coalesce: bool = True, bucket_size_mb: int = -1,
                      op: str = "sum", group: Any = None) -> None:
    """Reduce a model's parameters or buffers in place, one flat tensor per type (``coalesce``,
    in buckets of ``bucket_size_mb``), else one by one. Outside a distributed job or ``group``: nothing."""
    if get_world_size(group) <= 1:
        return
    comm, name = communicator(group), _reduce_op(op)
    tensors = [p.data for p in params]
    if not coalesce:
        for t in tensors:
            _all_reduce(comm, t, name)
        return
    for bucket in _buckets(tensors, bucket_size_mb):
        flat = torch.cat([t.reshape(-1) for t in bucket])
        _all_reduce(comm, flat, name)
        for t, value in zip(bucket, torch.split(flat, [t.numel() for t in bucket]), strict=True):
            t.copy_(value.view_as(t))


# ---------------------------------------------------------------------------------- objects


def all_gather_object(data: Any, group: Any = None) -> list[Any]:
    """Every rank's object, by rank, on every rank (this rank's: ``data`` itself); ``[]`` outside ``group``."""
    if _outside(group):
        return []
    return _comm(group).all_gather(data)


def gather_object(data: Any, dst: int = 0, group: Any = None) -> list[Any] | None:
    """Every rank's object, by rank, on ``dst`` (a global rank); None elsewhere (outside ``group`` too)."""
    if _outside(group):
        return None
    comm = _comm(group)
    if comm.world_size == 1:  # (whatever ``dst``, as mmengine)
        return [data]
    root = root_rank(group, dst, None)
    out = comm.gather(data, root)
    return out if comm.rank == root else None


def broadcast_object_list(data: list[Any], src: int = 0, group: Any = None) -> None:
    """Copy ``src``'s list items (a global rank) into every rank's ``data`` (as long), in place
    (outside ``group``: nothing)."""
    comm = _comm(group)
    if not isinstance(data, list):
        refuse(comm, Op.BROADCAST, root_rank(group, src, None), AssertionError,
               f"data must be a list, got {type(data).__name__}")
    if comm.world_size > 1:
        _objects.broadcast_object_list(data, src, group)


def collect_results(results: list[Any], size: int, device: str = "cpu", tmpdir: str | None = None) -> list[Any] | None:
    """Every rank's results on rank 0 in a sampler's interleaved order (rank 0's first, rank 1's
    first, ..., then their second), results that are None dropped, cut to ``size`` (the sampler's
    padding dropped); None on the other ranks. ``device`` ("cpu", "gpu", "npu") changes nothing:
    the results travel through the current communicator. ``tmpdir``, where given, is removed on
    rank 0 afterwards, as mmengine removes its scratch directory."""
    comm = _comm(None)
    if device not in ("gpu", "cpu", "npu"):
        refuse(comm, Op.GATHER, 0, NotImplementedError, f"device must be 'cpu' , 'gpu' or 'npu', but got {device}")
    if device != "cpu" and tmpdir is not None:
        refuse(comm, Op.GATHER, 0, AssertionError, f"tmpdir should be None when device is {device}")
    if comm.world_size == 1:
        return results[:size]
    parts = translated(comm.gather, results, 0)
    if comm.rank != 0:
        return None
    ordered = [r for r in itertools.chain.from_iterable(itertools.zip_longest(*parts)) if r is not None]
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)
    return ordered[:size]


def collect_results_cpu(result_part: list[Any], size: int, tmpdir: str | None = None) -> list[Any] | None:
    """``collect_results(result_part, size, "cpu", tmpdir)``."""
    return collect_results(result_part, size, "cpu", tmpdir)


def collect_results_gpu(result_part: list[Any], size: int) -> list[Any] | None:
    """``collect_results(result_part, size, "gpu")``."""
    return collect_results(result_part, size, "gpu")


def barrier(group: Any = None) -> None:
    """Wait for every rank of the current communicator (or ``group``). Outside a distributed job or
    ``group``: nothing."""
    if get_world_size(group) <= 1:
        return
    communicator(group).synchronize()


# ---------------------------------------------------------------------------------- the whole framework


def install() -> Callable[[], None]:
    """Put mmengine itself on distcomm: its Runner, samplers, hooks, evaluators, logger and
    checkpoint code call ``mmengine.dist``'s functions by the names they imported, which the
    one-line swap (``import distcomm.compat.mmengine as dist``) doesn't reach. After this, every
    name of ``mmengine.dist.__all__`` is this module's, in ``mmengine.dist``, in the submodules
    that define them (``mmengine.dist.dist``, ``mmengine.dist.utils``: they call each other there,
    and mmengine's ``master_only`` wrappers ask for ``is_main_process`` there) and in every loaded
    mmengine module that imported one by name; a module loaded later imports this module's.

        import distcomm.compat.mmengine as dist
        uninstall = dist.install()      # at the start of the script, before Runner.from_cfg(...)

    Returns the function that puts mmengine's own functions back (a second call while installed
    returns the same one). mmengine code that calls ``torch.distributed`` directly (its DDP
    wrappers, ``SyncBuffersHook``'s buffers, ``get_device``) still needs torch.distributed's
    default group: ``init_dist``, ``distcomm.launch()`` and ``spawn()`` set it up.
    """
    from ._install import swap

    package = importlib.import_module("mmengine.dist")  # (imported here: distcomm doesn't need mmengine)
    return swap("mmengine", package, sys.modules[__name__], __all__)
