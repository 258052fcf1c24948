"""The command line: ``python -m distcomm <command>`` (also the ``distcomm`` console script).

``store``: serve a job's store from a process of its own, so that the job outlives any of its
ranks (``comm.shrink()`` needs the store; where rank 0 serves it, it is lost with rank 0). Ranks
find it with MASTER_ADDR / MASTER_PORT and ``DISTCOMM_STORE=external``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from collections.abc import Sequence

from ._rendezvous import serve_store

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distcomm", description="distcomm's command line")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    store = commands.add_parser("store", help="serve a job's store until interrupted (Ctrl-C, SIGTERM)",
                                description=_store.__doc__)
    store.add_argument("--port", type=int, required=True, help="the port to listen on (the ranks' MASTER_PORT)")
    store.add_argument("--world-size", type=int, default=1, help="the job's ranks (informational)")
    args = parser.parse_args(argv)
    return _store(args.port, args.world_size)


def _store(port: int, world: int) -> int:
    """Serve a job's store on PORT until interrupted. Start the ranks with MASTER_ADDR=<this host>,
    MASTER_PORT=PORT and DISTCOMM_STORE=external: the store then outlives any of them."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    held = serve_store(f"tcp://0.0.0.0:{port}", world, 60.0)
    print(f"distcomm: serving the job's store on port {port}; ranks: MASTER_PORT={port} DISTCOMM_STORE=external",
          flush=True)
    while not stop.wait(1.0):
        pass
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
