"""launch(): start this machine's processes, one communicator each, and run a function in them."""

from __future__ import annotations

import ctypes
import datetime
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing as mp

from ._communicator import DEFAULT_TIMEOUT
from ._context import clear_default, set_default, use
from ._errors import RankFailedError
from ._local import LocalCommunicator
from ._memory import seconds as _seconds

__all__ = ["free_port", "launch"]

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _die_with(parent: int) -> None:
    """Ask the kernel to kill this process when its parent dies (Linux), so that a launcher killed
    with SIGKILL leaves no orphan behind; exit now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl: the launcher's own cleanup still ends us
            pass
    if os.getppid() != parent:
        os._exit(1)


def _end(processes: Sequence[Any], grace: float = 3.0) -> None:
    """Stop every process still running: SIGTERM, then SIGKILL after ``grace`` seconds."""
    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in alive:
        p.join(max(deadline - time.monotonic(), 0.0))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _worker(
    local_rank: int, payload: bytes, per_machine: int, num_machines: int, machine_rank: int,
    url: str, backend: str, timeout: float, parent: int,
) -> None:
    from ._torch import GlooCommunicator, NcclCommunicator, start_world

    _die_with(parent)
    main_func, args = cloudpickle.loads(payload)
    cls = NcclCommunicator if backend == "nccl" else GlooCommunicator
    comm = start_world(cls, url, machine_rank * per_machine + local_rank, per_machine * num_machines, local_rank,
                       timeout=timeout, machine=machine_rank)
    with comm, use(comm):
        main_func(*args)


def launch(
    main_func: Callable[..., Any],
    num_processes_per_machine: int | None = None,
    num_machines: int = 1,
    machine_rank: int = 0,
    dist_url: str | None = None,
    args: Sequence[Any] = (),
    timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
    *,
    backend: str | None = None,
    num_gpus_per_machine: int | None = None,
) -> None:
    """Start this machine's processes and run ``main_func(*args)`` in each.

    The positional order is detectron2's ``launch(main_func, num_gpus_per_machine, num_machines,
    machine_rank, dist_url, args, timeout)``, so a call written for it runs unchanged.

    Each process initializes torch.distributed, builds the matching communicator (gloo or nccl)
    with its local rank and size, installs it with ``use()``, calls ``main_func(*args)``, and
    cleans up. ``main_func`` may be a lambda or closure (cloudpickle). A job of one process on one
    machine runs ``main_func`` in the calling process, with a LocalCommunicator installed: no
    process is started, nothing is pickled, breakpoints work.

    Args:
        main_func: the function each process runs.
        num_processes_per_machine: processes on this machine (alias: ``num_gpus_per_machine=``).
        num_machines: machines in the job (each calls launch() with its machine_rank).
        machine_rank: this machine's index.
        dist_url: "tcp://host:port" of machine 0; None or "auto" picks a free local port (one
            machine only).
        args: arguments for main_func.
        timeout: seconds (or a timedelta) collectives and set-up wait for peers; default 600 s
            (detectron2's is 30 minutes).
        backend: "gloo" or "nccl"; default nccl when CUDA is available, else gloo.

    Raises:
        RankFailedError: a process raised (its rank and remote traceback are attached) or died.
        RuntimeError: launch() was called while a spawned process imported the script (no
            ``if __name__ == "__main__":`` guard around the call).
    """
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # a started process importing the script
        raise RuntimeError(
            "distcomm.launch() was called while a process it started imported your script: put the call "
            "under `if __name__ == \"__main__\":` (each process imports the script to find main_func)")
    if not callable(main_func):
        raise TypeError(f"main_func must be callable, got {type(main_func).__name__}")
    if num_gpus_per_machine is not None:
        if num_processes_per_machine is not None and num_processes_per_machine != num_gpus_per_machine:
            raise TypeError("pass num_processes_per_machine or its alias num_gpus_per_machine, not both")
        num_processes_per_machine = num_gpus_per_machine
    if num_processes_per_machine is None:
        raise TypeError("launch() needs num_processes_per_machine (or num_gpus_per_machine)")
    for name, value, low in (("num_processes_per_machine", num_processes_per_machine, 1),
                             ("num_machines", num_machines, 1), ("machine_rank", machine_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if machine_rank >= num_machines:
        raise ValueError(f"machine_rank={machine_rank} is out of range for num_machines={num_machines}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' needs CUDA and this machine has no CUDA device; use backend='gloo'")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list of main_func's arguments, got {type(args).__name__}")
    seconds = _seconds(timeout, DEFAULT_TIMEOUT)
    assert seconds is not None
    if num_machines == 1 and num_processes_per_machine == 1:
        with LocalCommunicator(timeout=seconds) as comm, use(comm):
            set_default(comm)  # helper threads see it too, as in a job of many processes
            try:
                main_func(*args)
            finally:
                clear_default(comm)
        return
    if dist_url in (None, "auto"):
        if num_machines != 1:
            raise ValueError("dist_url='auto' only works with num_machines=1; pass machine 0's tcp://host:port")
        dist_url = f"tcp://127.0.0.1:{free_port()}"
    assert dist_url is not None
    payload = cloudpickle.dumps((main_func, tuple(args)))
    first = machine_rank * num_processes_per_machine
    context = None
    try:
        context = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _worker,
            args=(payload, num_processes_per_machine, num_machines, machine_rank, dist_url, backend, seconds,
                  os.getpid()),
            nprocs=num_processes_per_machine,
            join=False,
            start_method="spawn",
        )
        # Join in one-second slices, so that Ctrl-C (or SIGINT sent to this process alone) is seen at
        # once; on every way out, processes still running are ended.
        while not context.join(1.0):
            pass
    except mp.ProcessRaisedException as e:  # type: ignore[attr-defined]
        rank = first + e.error_index
        text = str(e.msg).strip()
        last = text.splitlines()[-1] if text else "an exception"
        raise RankFailedError(f"rank {rank} raised {last}\n--- rank {rank} traceback ---\n{text}", rank=rank,
                              remote_traceback=text) from None
    except mp.ProcessExitedException as e:  # type: ignore[attr-defined]
        rank = first + e.error_index
        how = f"was killed by {e.signal_name}" if e.signal_name else f"exited with code {e.exit_code}"
        raise RankFailedError(f"rank {rank} (pid {e.error_pid}) {how} before main_func returned", rank=rank) from None
    finally:  # (processes started before an interrupt inside start_processes die with this one: PDEATHSIG)
        if context is not None:
            _end(context.processes)
