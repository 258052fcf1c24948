"""The members of a new group prove to each other that they hold the job's key.

A group forms in the job's store, where anyone who reaches it could put an address of its own in
a member's place. So, after every start, shrink and admit, before any byte from a peer is loaded
(the communicator's set-up is the first object collective), each member answers a challenge made
of every member's fresh nonce: two all-gathers of raw bytes, nothing deserialized. Every member
sees every answer, so all of them find the same impostors and fail alike, naming them. The digest
of the nonces is the membership's ticket, over which a newcomer proves the key. (A process that
relays between two members passes the proof by relaying it: docs/trust-model.md, the wire.)
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from .._errors import AuthenticationError
from .key import MAC_BYTES, JobKey

__all__ = ["known_ticket", "prove_members", "remember_ticket"]

_NONCE_BYTES = 16


def prove_members(key: JobKey | None, epoch: str, job_ranks: tuple[int, ...], device: Any = None,
                  group: Any = None, watch: Callable[[], None] | None = None) -> str | None:
    """On ``group`` just formed (default: the default group; ``job_ranks[r]``: its rank ``r``'s job
    rank, or global rank): raise AuthenticationError on every member where a member can't answer
    with the job's key. A job without a key has nothing to prove (torch's own trust model). Every
    group distcomm makes is proven (``_TorchCommunicator._new_group``): objects travel on several.

    Returns the group's ticket: ``epoch`` and a digest of every member's nonce, the same on every
    member, new in every group and never known to an earlier job (None without a key). ``watch``,
    called while a gather on CPU waits, raises where a member is found gone (a group that connects
    its pairs in its first calls retries a dead member in C++ for five times its timeout)."""
    if key is None:
        return None
    nonces = _all_gather(secrets.token_bytes(_NONCE_BYTES), device, group, watch)
    challenge = b"".join(nonces)

    def answer(rank: int) -> bytes:
        return key.mac(b"member", epoch.encode(), str(rank).encode(), str(job_ranks[rank]).encode(), challenge)

    answers = _all_gather(answer(dist.get_rank(group)), device, group, watch)
    bad = [r for r, said in enumerate(answers) if not hmac.compare_digest(said, answer(r))]
    if bad:
        raise AuthenticationError(
            f"{epoch}: rank(s) {bad} (job rank(s) {[job_ranks[r] for r in bad]}) could not prove they hold the job's "
            f"key: a process that is none of the job's took their place in its group, or they were started with "
            f"another key; nothing from them was loaded", op="rendezvous", ranks=bad)
    return f"{epoch}:{hashlib.blake2b(challenge, digest_size=12).hexdigest()}"


def remember_ticket(ticket: str) -> None:
    """This process is a member of the membership ``ticket`` names (see ``prove_members``)."""
    _TICKETS.append(ticket)


def known_ticket(ticket: str) -> bool:
    """Whether ``ticket`` names a membership this process was a member of (one of the last few):
    a newcomer that proves the key over it proves it now, not in an earlier job."""
    return ticket in _TICKETS


_TICKETS: collections.deque[str] = collections.deque(maxlen=64)


def _all_gather(mine: bytes, device: Any, group: Any, watch: Callable[[], None] | None) -> list[bytes]:
    assert len(mine) in (_NONCE_BYTES, MAC_BYTES)
    t = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    if device is not None:
        t = t.to(device)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    if watch is None or t.is_cuda:
        dist.all_gather(out, t, group=group)
    else:
        _watched(dist.all_gather(out, t, group=group, async_op=True), watch)
    return [bytes(o.cpu().numpy().tobytes()) for o in out]


def _watched(work: Any, watch: Callable[[], None]) -> None:
    """Wait for ``work``, calling ``watch`` every 50 ms meanwhile: what it raises ends the wait, and
    the work is left to the group's teardown. Looked at, not waited on, on this thread: a thread of
    its own left waiting would end inside the interpreter's finalization and abort the process."""
    pause, next_look = 0.0005, time.monotonic() + _LOOK_SECONDS
    while not work.is_completed():
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
        if time.monotonic() >= next_look:
            watch()
            next_look = time.monotonic() + _LOOK_SECONDS
    work.wait()  # (raises what the gather met)


_LOOK_SECONDS = 0.05
