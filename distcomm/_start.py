"""Starting a job's default group: from a launcher's environment, a URL, or a world of one.

``start_from`` turns what ``detect()`` found into a rendezvous and a communicator; ``start_world``
is the one place that initializes torch.distributed's default group (``from_env``, ``launch`` and
``distcomm.testing.spawn`` all come here).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ._communicator import DEFAULT_TIMEOUT
from ._defaults import set_default
from ._errors import CommunicatorStateError
from ._launchers import LaunchEnv
from ._memory import seconds as _seconds
from ._rendezvous import open_store, parse_url, unreachable_here

if TYPE_CHECKING:
    from ._torch import _TorchCommunicator

__all__ = ["free_port", "start_from", "start_world", "unreachable", "url_host"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (bind to 0, read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def url_host(addr: str) -> str:
    """``addr`` as the host part of a tcp:// URL: an IPv6 address goes in brackets."""
    return f"[{addr}]" if ":" in addr else addr


def unreachable(master: str) -> str:
    """Why peers on other machines couldn't reach this process with ``master`` as the rendezvous
    host, or "". A loopback ``master`` (IPv6's ::1 too: the name lookup behind ``unreachable_here``
    knows IPv4 only) means every rank runs on this machine, whatever the launcher's local size says."""
    try:
        if ipaddress.ip_address(master.strip("[]")).is_loopback:
            return ""
    except ValueError:
        pass  # a host name: the lookup decides
    return unreachable_here(master)


def start_from(cls: type[_TorchCommunicator], env: LaunchEnv, *,
               timeout: float | datetime.timedelta | None = None, **kwargs: Any) -> Any:
    """A ``cls`` communicator over a new default group, for the process ``env`` describes."""
    if dist.is_initialized():
        raise CommunicatorStateError(
            f"torch.distributed is already initialized; use {cls.__name__}() to adopt its default group")
    if env.master_addr is None or (env.master_port is None and env.world_size > 1):
        raise CommunicatorStateError(f"{cls.__name__}.from_env(): {env.address_problem or 'set MASTER_PORT'}")
    spans_machines = env.local_size is not None and env.local_size < env.world_size
    problem = unreachable(env.master_addr) if spans_machines else ""
    if problem:  # refused before connecting: otherwise each of gloo's connections waits for the timeout
        raise CommunicatorStateError(f"{cls.__name__}.from_env() under {env.launcher} across machines: {problem}")
    port = env.master_port or free_port()  # a world of one: any free port
    if env.node_rank is not None:
        kwargs.setdefault("machine", env.node_rank)
    url = f"tcp://{url_host(env.master_addr)}:{port}"
    return start_world(cls, url, env.rank, env.world_size, env.local_rank, timeout=timeout, scope=env.job,
                       hosted=not env.launcher_store, launcher=env.launcher, **kwargs)


def start_world(
    cls: type[_TorchCommunicator], url: str, rank: int, world: int, local_rank: int, *,
    timeout: float | datetime.timedelta | None = None, scope: str = "", hosted: bool = True,
    launcher: str | None = None, **kwargs: Any,
) -> Any:
    """Initialize torch.distributed's default group and return a ``cls`` communicator that owns it.

    The one place that starts a job's group: used by ``from_env``, ``launch`` and
    ``distcomm.testing.spawn``. ``url`` (tcp://host:port), ``scope`` and ``hosted`` say where the
    ranks meet (see ``open_store``); ``launcher`` names what started the process. For NCCL it binds
    ``cuda:<local_rank % device_count>`` first. If the communicator can't be built, the group is
    destroyed again. The communicator becomes the process-wide default (``distcomm.current()`` in
    every thread) until it is closed.
    """
    seconds = _seconds(timeout, DEFAULT_TIMEOUT)
    assert seconds is not None
    td = datetime.timedelta(seconds=seconds)
    host, port = parse_url(url)
    store = open_store(host, port, rank, world, seconds, scope=scope, hosted=hosted,
                       what=f"{launcher}'s rendezvous" if launcher else "the rendezvous")
    if cls.backend == "nccl":
        if not torch.cuda.is_available():
            raise CommunicatorStateError(
                "NcclCommunicator needs CUDA and NCCL, and this machine has no CUDA device; "
                "use GlooCommunicator on CPU")
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world, timeout=td, device_id=device)
        kwargs.setdefault("device", device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=td)
    try:
        comm = cls(None, timeout=timeout, _owns_default=True, **kwargs)
        comm._machines_declared = True  # the job's launcher knows its machines (the reference's launch())
        comm._launcher = launcher
        comm._store_by_rank0 = hosted
        set_default(comm)  # every thread of the process sees it
        return comm
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
