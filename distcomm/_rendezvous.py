"""The rendezvous: the key-value store a job's processes meet at before their group exists.

distcomm makes the store itself rather than hand torch a URL, for three reasons:
- torch's ``tcp://`` and ``env://`` handlers change what they do when torchelastic's variables are
  set (they turn every rank into a client of the agent's store), so a URL that works under
  ``python`` hangs under torchrun;
- under torchrun's static rendezvous the agent keeps one store across restarts, and the workers'
  keys carry no attempt number: a restarted rank can read a dead peer's address and fail to connect
  (torch's own initialisation fails about half of the restarts that way). Our keys live under the
  job (the launcher's job id; torchrun's run id and restart count), its world size, and a generation
  counted in the store, so a second rendezvous in one attempt, or another job that happens onto the
  same port, never reads this one's keys;
- every wait is bounded by the timeout and, when it runs out, names the ranks that never came.
"""

from __future__ import annotations

import datetime
import os
import socket
import threading
import time
import urllib.parse
from typing import Any

import torch

from ._errors import CollectiveTimeoutError, CommunicatorStateError, DistCommError, PeerError

__all__ = ["open_store", "parse_url", "unreachable_here"]

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


def open_store(host: str, port: int, rank: int, world: int, seconds: float, *, scope: str = "",
               hosted: bool = True, what: str = "the rendezvous") -> Any:
    """The job's store at ``host:port``, once every rank of this generation has reached it.

    Rank 0 hosts it unless ``hosted`` is False (a torchrun agent already does). Keys live under
    ``scope`` and ``world``; each rendezvous there is a new generation (the arrivals counted so far,
    divided by ``world``), and the store returned is that generation's, for the group's own keys.

    Raises:
        CollectiveTimeoutError: the store or some ranks didn't come within ``seconds``; names them.
        CommunicatorStateError: rank 0 could not listen on the port (another job holds it).
    """
    deadline = time.monotonic() + seconds
    where = f"{what} at {host}:{port}"
    job = _c10d().PrefixStore(f"distcomm/{scope}/world-{world}", _connect(host, port, rank, world, seconds, hosted,
                                                                         where))
    generation = (job.add("arrivals", 1) - 1) // world
    store = _c10d().PrefixStore(f"generation-{generation}", job)
    store.set(f"arrived/{rank}", f"{socket.gethostname()} pid {os.getpid()}")
    if store.add("arrivals", 1) == world:
        store.set("all-here", "1")
    try:
        store.wait(["all-here"], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    except Exception:
        error = _missing(store, rank, world, seconds, where)
    else:
        return store
    # the error's traceback holds this frame: let go of the store here, so rank 0's port is free again
    job = store = None
    raise error


def _missing(store: Any, rank: int, world: int, seconds: float, where: str) -> DistCommError:
    """What the wait for the other ranks ran into: who never arrived, or the host went away."""
    try:
        missing = [r for r in range(world) if not store.check([f"arrived/{r}"])]
    except Exception:
        return PeerError(f"{where} went away while rank {rank} waited for the other ranks: its host (rank 0) "
                         f"ended or lost its connection", op="rendezvous", ranks=[0])
    return CollectiveTimeoutError(
        f"{where} did not complete within {seconds:g} s: rank {rank} waited for rank(s) {_ranks(missing)} of "
        f"{world}, which never arrived (not started, or started with other variables)", op="rendezvous",
        ranks=missing)


def _connect(host: str, port: int, rank: int, world: int, seconds: float, hosted: bool, where: str) -> Any:
    """A store client (rank 0's is also the server) within ``seconds``.

    torch's client waits for the server's answer without a limit: a port where something else
    listens would hold it forever, so it is made on a helper thread (the call releases the GIL) and
    given up on, with the thread, when the time is over.
    """
    master = hosted and rank == 0
    made: list[Any] = []

    def make() -> None:
        try:
            made.append(_c10d().TCPStore(host, port, world, master, datetime.timedelta(seconds=seconds),
                                         wait_for_workers=False))
        except BaseException as e:
            made.append(e)

    helper = threading.Thread(target=make, name="distcomm-rendezvous", daemon=True)
    helper.start()
    helper.join(seconds + 5.0)  # the client's own connect gives up at ``seconds``; the answer may lag
    if made and not isinstance(made[0], BaseException):
        return made[0]
    error = made[0] if made else None
    if master:
        raise CommunicatorStateError(
            f"rank 0 could not open {where} ({error}); the port may be held by another job: "
            f"set MASTER_PORT to a free port on every rank") from error
    if error is None:
        reason = "something listens there but doesn't answer as a rendezvous store: set MASTER_PORT"
    else:
        lines = str(error).strip().splitlines()
        reason = f"{type(error).__name__}: {lines[0] if lines else ''}"
    host_role = "its host (rank 0)" if hosted else "the launcher's store"
    raise CollectiveTimeoutError(
        f"{where} did not complete within {seconds:g} s: rank {rank} could not reach {host_role} ({reason})",
        op="rendezvous", ranks=[0]) from error


def _c10d() -> Any:
    return torch._C._distributed_c10d


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
