"""A free port for a job's store, held until the store listens on it.

Binding to port 0 and closing the socket leaves a window: before the job's rank 0 listens, any
other process's bind to port 0, or its outgoing connection, may take the same port (two test
workers side by side did, and one job's rank joined the other's store). So the port stays bound
here, with SO_REUSEADDR and not listening: the kernel hands it to no other bind(0) and no
connection, while a server that sets SO_REUSEADDR itself (torch's TCPStore does) can listen on it.
"""

from __future__ import annotations

import collections
import socket
import threading
import time

__all__ = ["free_port"]

HOLD_SECONDS = 300.0
"""How long a port stays held: far longer than a job takes to start its rank 0."""

_MOST_HELD = 64  # at most this many sockets (file descriptors) held at once; the oldest go first

_held: collections.deque[tuple[float, socket.socket]] = collections.deque()
_lock = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1, held for this job for ``HOLD_SECONDS``.

    Until then no other bind to port 0 on this machine gets it, nor any outgoing connection; a
    server that sets SO_REUSEADDR (torch's store, torchrun's) listens on it as on a free port.
    """
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    port = int(s.getsockname()[1])
    now = time.monotonic()
    with _lock:
        while _held and (len(_held) >= _MOST_HELD or now - _held[0][0] > HOLD_SECONDS):
            _held.popleft()[1].close()
        _held.append((now, s))
    return port
