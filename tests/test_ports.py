"""free_port(): the port stays held for the job's store until that store listens on it."""

from __future__ import annotations

import datetime
import errno
import socket

import pytest
import torch.distributed as dist

import distcomm
from distcomm._launching import ports


def _plain_bind(port: int, host: str = "127.0.0.1") -> int:
    """0 if a socket without SO_REUSEADDR could bind ``port`` (as another job's would), else the errno."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno or -1
    return 0


def _ipv6() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_the_port_is_held_from_other_binds_yet_a_store_listens_on_it() -> None:
    port = distcomm.free_port()
    assert _plain_bind(port) == errno.EADDRINUSE  # before: free again the moment free_port() returned
    store = dist.TCPStore("127.0.0.1", port, 1, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 1, False, datetime.timedelta(seconds=10))
    client.set("k", "v")
    assert store.get("k") == b"v"


def test_a_hold_ends_after_its_time(monkeypatch: pytest.MonkeyPatch) -> None:
    first = distcomm.free_port()
    monkeypatch.setattr(ports, "HOLD_SECONDS", 0.0)
    second = distcomm.free_port()  # lets the expired holds go
    assert second != first and _plain_bind(first) == 0


def test_the_port_is_held_on_every_address() -> None:
    """gloo's own listeners bind port 0 of the host's address, not 127.0.0.1: none may get it."""
    port = distcomm.free_port()
    hosts = ["127.0.0.1", "0.0.0.0", *(["::1", "::"] if _ipv6() else [])]
    assert {h: _plain_bind(port, h) for h in hosts} == dict.fromkeys(hosts, errno.EADDRINUSE)
