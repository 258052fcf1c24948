"""The rendezvous: the key-value store a job's processes meet at before their group exists.

distcomm makes the store itself rather than hand torch a URL, for three reasons:
- torch's ``tcp://`` and ``env://`` handlers change what they do when torchelastic's variables are
  set (they turn every rank into a client of the agent's store), so a URL that works under
  ``python`` hangs under torchrun;
- under torchrun's static rendezvous the agent keeps one store across restarts, and the workers'
  keys carry no attempt number: a restarted rank can read a dead peer's address and fail to connect
  (torch's own initialisation fails about half of the restarts that way). Our keys live under the
  run id and the restart count;
- every wait is bounded by the timeout and, when it runs out, names the ranks that never came.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
import urllib.parse
from typing import Any

import torch

from ._errors import CollectiveTimeoutError, CommunicatorStateError

__all__ = ["open_store", "parse_url", "unreachable_here"]

_ARRIVED = "distcomm/arrived"
_ALL_HERE = "distcomm/all-here"


def parse_url(url: str) -> tuple[str, int]:
    """``tcp://host:port`` (IPv6 hosts in brackets) as (host, port)."""
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme != "tcp" or not parts.hostname or port is None:
        raise ValueError(f"dist_url must be tcp://host:port, got {url!r}")
    return parts.hostname, port


def open_store(host: str, port: int, rank: int, world: int, seconds: float, *, prefix: str = "",
               hosted: bool = True, what: str = "the rendezvous") -> Any:
    """The job's store at ``host:port``, once every rank has reached it.

    Rank 0 hosts it unless ``hosted`` is False (a torchrun agent already does); ``prefix`` keeps
    this attempt's keys apart from an earlier attempt's in a store that outlives it.

    Raises:
        CollectiveTimeoutError: the store or some ranks didn't come within ``seconds``; names them.
        CommunicatorStateError: rank 0 could not listen on the port (another job holds it).
    """
    deadline = time.monotonic() + seconds
    where = f"{what} at {host}:{port}"
    base = _connect(host, port, rank, world, seconds, hosted, where)
    store = torch._C._distributed_c10d.PrefixStore(prefix, base) if prefix else base
    store.set(f"{_ARRIVED}/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
    if store.add(_ARRIVED, 1) == world:
        store.set(_ALL_HERE, "1")
    try:
        store.wait([_ALL_HERE], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except Exception as e:
        missing = [r for r in range(world) if not store.check([f"{_ARRIVED}/{r}"])]
        raise CollectiveTimeoutError(
            f"{where} did not complete within {seconds:g} s: rank {rank} waited for rank(s) "
            f"{_ranks(missing)} of {world}, which never arrived (not started, or started with other "
            f"variables)", op="rendezvous", ranks=missing) from e
    return store


def _connect(host: str, port: int, rank: int, world: int, seconds: float, hosted: bool, where: str) -> Any:
    timeout = datetime.timedelta(seconds=seconds)
    master = hosted and rank == 0
    try:
        return torch._C._distributed_c10d.TCPStore(host, port, world, master, timeout, wait_for_workers=False)
    except Exception as e:
        if master:
            raise CommunicatorStateError(
                f"rank 0 could not open {where} ({e}); the port may be held by another job: "
                f"set MASTER_PORT to a free port on every rank") from e
        host_role = "its host (rank 0)" if hosted else "the launcher's store"
        raise CollectiveTimeoutError(
            f"{where} did not complete within {seconds:g} s: rank {rank} could not reach {host_role} "
            f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})",
            op="rendezvous", ranks=[0]) from e


def unreachable_here(master: str) -> str:
    """Why peers on other machines could not reach this process over gloo, or "".

    Without GLOO_SOCKET_IFNAME, gloo advertises the address this host's name resolves to; where
    that is a loopback address (Debian maps the host name to 127.0.1.1) or nothing, peers on other
    machines are handed an address they can't connect to, and each connection waits for the timeout.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME") or _is_loopback(master):
        return ""
    name = socket.gethostname()
    try:
        advertised = socket.gethostbyname(name)
    except OSError:
        advertised = ""
    if advertised and not _is_loopback(advertised):
        return ""
    toward = _address_toward(master)
    return (f"this host's name {name!r} resolves to {advertised or 'no address'}, which peers on other machines "
            f"can't reach: gloo would hand them that address. Set GLOO_SOCKET_IFNAME to the interface that "
            f"reaches {master}" + (f" (the one with address {toward}: see `ip -o addr`)" if toward else ""))


def _is_loopback(host: str) -> bool:
    try:
        return socket.gethostbyname(host).startswith("127.") or host in ("::1", "localhost")
    except OSError:
        return False


def _address_toward(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP socket's connect sends nothing)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return ""


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:16]))
    return shown + (f" and {len(ranks) - 16} more" if len(ranks) > 16 else "")
