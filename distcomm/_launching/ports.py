"""A free port for a job's store, held until the store listens on it.

Binding to port 0 and closing the socket leaves a window: before the job's rank 0 listens, any
other process's bind to port 0, or its outgoing connection, may take the same port (two test
workers side by side did, and one job's rank joined the other's store). So the port stays bound
here, on every address (IPv6 and IPv4 alike where the machine has IPv6), with SO_REUSEADDR and not
listening: the kernel hands it to no other bind(0) on any address and to no connection, while a
server that sets SO_REUSEADDR itself (torch's TCPStore does) can listen on it.
"""

from __future__ import annotations

import atexit
import collections
import os
import socket
import threading
import time

__all__ = ["free_port"]

HOLD_SECONDS = 300.0
"""A held port is let go by the first free_port() call this long after it (or at exit): far longer
than a job takes to start its rank 0."""

_MOST_HELD = 64  # at most this many sockets (file descriptors) held at once; the oldest go first

_held: collections.deque[tuple[float, socket.socket]] = collections.deque()
_lock = threading.Lock()


def free_port() -> int:
    """A free TCP port, held from other binds on this machine until the job's store listens on it.

    Until a later call lets it go (``HOLD_SECONDS`` on) or this process exits, no other bind to port
    0 on any address gets it, nor any outgoing connection; a server that sets SO_REUSEADDR (torch's
    store, torchrun's) listens on it as on a free port, and one that doesn't can't bind it.
    """
    s = _hold()
    port = int(s.getsockname()[1])
    now = time.monotonic()
    with _lock:
        while _held and (len(_held) >= _MOST_HELD or now - _held[0][0] > HOLD_SECONDS):
            _held.popleft()[1].close()
        _held.append((now, s))
    return port


def _hold() -> socket.socket:
    """A socket bound to port 0 of every address (dual-stack), or of every IPv4 one without IPv6."""
    if socket.has_ipv6:
        s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            s.bind(("::", 0))
            return s
        except OSError:  # IPv6 compiled in but not configured on this machine
            s.close()
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 0))  # noqa: S104 - it never listens: it only holds the port
    return s


def _let_all_go() -> None:
    while _held:
        _held.popleft()[1].close()


def _in_forked_child() -> None:
    """A forked child closes its copies of the held sockets (the parent's stay held) and gets a lock
    of its own (another thread may have held the parent's at the fork)."""
    global _lock
    _lock = threading.Lock()
    _let_all_go()


atexit.register(_let_all_go)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_in_forked_child)
