"""The communicator of whatever launcher started this process (``from_env``), and how
``launch()`` fits a launcher's world: run here, start this machine's processes, or refuse."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._communicator import DEFAULT_TIMEOUT
from .._context import use
from .._defaults import set_default
from .._errors import CommunicatorStateError
from .._local import LocalCommunicator
from .._torch import GlooCommunicator, NcclCommunicator
from .._wire.memory import seconds as _seconds
from .launchers import TORCHRUN_LIKE, LaunchEnv, detect
from .rendezvous import parse_url, unreachable_here
from .start import start_from, url_host

__all__ = ["communicator_class", "from_env", "machines_under", "run_here"]


def from_env(backend: str | None = None, *, timeout: float | datetime.timedelta | None = None,
             **kwargs: Any) -> Any:
    """The communicator of this process, set up from whatever launcher started it.

    torchrun (restarts included), Slurm's srun and sbatch, Open MPI's mpirun, MPICH / Intel MPI and
    MVAPICH are understood, and explicit RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT win; under
    plain ``python`` it is a LocalCommunicator (a world of one), so one script runs everywhere::

        with distcomm.from_env() as comm, distcomm.use(comm):
            ...

    The communicator becomes the process-wide default until it is closed; ``comm.launcher`` says
    what started the process.

    Args:
        backend: "gloo" or "nccl"; default nccl where CUDA is available, else gloo. Given under
            plain python, a torch.distributed world of one with that backend.
        timeout: seconds (or a timedelta) the rendezvous and collectives wait for peers.
        kwargs: the communicator's settings (serializer, max_bytes, ...; see ``Communicator``).

    Raises:
        ValueError: the launcher's variables contradict each other or don't parse; a bad backend.
        CommunicatorStateError: torch.distributed is already initialized, or no rendezvous host is
            known (mpirun across machines without MASTER_ADDR: the error says what to set).
        CollectiveTimeoutError: ranks didn't reach the rendezvous within ``timeout``; names them.
    """
    env = detect()
    if backend is None and not env.started_by_launcher:
        seconds = _seconds(timeout, DEFAULT_TIMEOUT)
        comm = LocalCommunicator(timeout=seconds, **kwargs)
        comm._launcher = env.launcher
        set_default(comm)
        return comm
    return start_from(communicator_class(backend), env, timeout=timeout, **kwargs)


def communicator_class(backend: str | None) -> type[GlooCommunicator] | type[NcclCommunicator]:
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    return NcclCommunicator if backend == "nccl" else GlooCommunicator


def machines_under(env: LaunchEnv, per_machine: int, num_machines: int, machine_rank: int,
                    dist_url: str | None) -> tuple[int, int, str] | None:
    """How launch() fits a launcher's world: None to run here (it started this machine's processes),
    else (machines, this machine's rank, URL) to start ``per_machine`` here (it started one)."""
    saw = f"{env.launcher} started this process as {env.describe()}"
    for name, given, launchers, default in (("num_machines", num_machines, env.num_nodes, 1),
                                            ("machine_rank", machine_rank, env.node_rank, 0)):
        if given != default and launchers is not None and given != launchers:
            raise ValueError(f"launch(..., {name}={given}) contradicts the launcher: {saw}")
    if not env.even:  # some machines would run main here, others start processes: two worlds
        raise ValueError(f"launch() needs the same number of processes on every machine, but {saw}, and "
                         f"{env.launcher} started other counts on other machines")
    if env.local_size is None:
        raise ValueError(f"launch() can't tell how many processes {env.launcher} started on this machine ({saw}): "
                         f"set LOCAL_WORLD_SIZE")
    if env.local_size == per_machine:
        return None
    if env.local_size != 1 or env.node_rank is None:
        raise ValueError(
            f"launch() was asked for {per_machine} processes per machine, but {saw}: start {per_machine} "
            f"per machine with the launcher (torchrun --nproc-per-node {per_machine}, srun --ntasks-per-node "
            f"{per_machine}, mpirun --npernode {per_machine}), or one per machine and let launch() start them")
    if env.launcher in TORCHRUN_LIKE:  # its agent holds MASTER_PORT, and starts processes itself
        raise ValueError(f"launch() was asked for {per_machine} processes per machine, but {saw}: "
                         f"run {env.launcher} --nproc-per-node {per_machine} instead")
    if dist_url in (None, "auto") or num_machines == 1:
        if env.master_addr is None or env.master_port is None:
            raise ValueError(f"launch() can't start this machine's processes: {env.address_problem}")
        dist_url = f"tcp://{url_host(env.master_addr)}:{env.master_port}"
    problem = unreachable_here(parse_url(dist_url)[0])
    if problem:  # refused before starting anything: each of gloo's connections would wait for the timeout
        raise CommunicatorStateError(f"launch() under {env.launcher} across machines: {problem}")
    return env.world_size, env.node_rank, dist_url


def run_here(env: LaunchEnv, main_func: Callable[..., Any], args: Sequence[Any], seconds: float,
              backend: str) -> None:
    """``main_func`` in this process, over the communicator the launcher's variables describe."""
    with start_from(communicator_class(backend), env, timeout=seconds) as comm, use(comm):
        main_func(*args)
