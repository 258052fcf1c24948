"""What a process can tell of the others' being alive: its own identity (which machine, which pid
namespace), whether a pid on this machine is still a live process, and which members' keep-alives
stopped (their host is down or cut off: see ``_keepalive``)."""

from __future__ import annotations

import os
import secrets
import select
import socket

__all__ = ["HOSTS_LOST", "LOSS_SECONDS", "alive", "lost_by_silence", "machine", "process_id", "readable"]


def process_id() -> tuple[str, int, int]:
    """(machine, PID namespace, pid): two ranks with the same first two can see each other's pid.
    The machine is its boot id and network namespace: hosts made of network namespaces on one
    machine (a test's) are other hosts, whose processes are judged by their beat, as a real one's."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
        network = os.stat("/proc/self/ns/net").st_ino
    except OSError:  # not Linux: no liveness checks
        return (f"{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(4)}", 0, os.getpid())
    return (f"{boot}/{network}", namespace, os.getpid())


def readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read, or its other end closed (poll: select() refuses
    descriptors past 1023, which a process with many files open reaches)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def machine() -> str:
    """What tells this machine's processes (one pid namespace) from other machines'."""
    boot, namespace, _ = process_id()
    return f"{boot}-{namespace}"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # exiting (its sockets about to close), or exited and not yet reaped by its parent
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return fields[0] != "Z" and not int(fields[6]) & _PF_EXITING
    except (OSError, IndexError, ValueError):
        return True


_PF_EXITING = 0x4  # the kernel's flag for a process inside exit(), in /proc/<pid>/stat


HOSTS_LOST: list[int] = []
"""The job rank whose keep-alive beat stopped in this process's membership (see _keepalive)."""


LOSS_SECONDS = 30.0
"""A keep-alive beat that has not moved for this long is a lost rank (its host is down or cut off).
Sixty beats: a machine running many more ranks than cores starves a beat's thread for seconds (a
33-rank world on 2 cores left one silent for over 5 s), and a rank declared lost ends the job's
collectives, so a healthy one must never be."""


def lost_by_silence(pid: int | None, silent_for: float) -> bool:
    """Whether a member whose keep-alive beat has stood still for ``silent_for`` seconds is lost.
    Where this machine sees its process (``pid``) alive, only after ``WEDGED_TIMES`` as long: a C
    call that holds the GIL stops the beat's thread for a while (35 s seen), a deadlock for good.
    Elsewhere, or with its process gone, after ``LOSS_SECONDS``."""
    if pid is not None and alive(pid):
        return silent_for > WEDGED_TIMES * LOSS_SECONDS
    return silent_for > LOSS_SECONDS


WEDGED_TIMES = 4
"""How many times ``LOSS_SECONDS`` a member whose process is seen alive may stay silent."""

