"""The job's key: a secret every process of the job holds and an outsider doesn't.

Whoever makes the job makes the key (``python -m distcomm run``, ``launch()``, ``testing.spawn()``)
and hands it to each worker in its environment, as torchrun hands out ``MASTER_PORT``; under other
launchers the user gives one (``DISTCOMM_JOB_KEY``, or ``DISTCOMM_JOB_KEY_FILE`` naming a file only
its owner can read). It never travels on a command line or through the store.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping

__all__ = ["KEY_FILE_VAR", "KEY_VAR", "MAC_BYTES", "JobKey", "job_key", "key_given", "new_key"]

KEY_VAR = "DISTCOMM_JOB_KEY"
KEY_FILE_VAR = "DISTCOMM_JOB_KEY_FILE"
MIN_CHARS = 16
MAC_BYTES = 16
"""A MAC cut to 128 bits: forging one is a 2**-128 guess per try."""


class JobKey:
    """The key as a MAC maker: HMAC-SHA256 over the parts given, each length-prefixed (so that
    ("ab", "c") and ("a", "bc") differ). Its repr never shows the secret."""

    __slots__ = ("_base",)

    def __init__(self, secret: bytes) -> None:
        self._base = hmac.new(secret, digestmod=hashlib.sha256)

    def mac(self, *parts: bytes | memoryview) -> bytes:
        h = self._base.copy()  # (the key's pads are hashed once, in __init__)
        for part in parts:
            h.update(memoryview(part).nbytes.to_bytes(8, "little"))
            h.update(part)
        return h.digest()[:MAC_BYTES]

    def __repr__(self) -> str:
        return "JobKey(<secret>)"


def job_key(environ: Mapping[str, str] | None = None) -> JobKey | None:
    """The key this process was given, or None (a job without one).

    Raises:
        ValueError: both variables are set, the key is shorter than 16 characters, or its file
            can't be read or can be read by others than its owner.
    """
    env = os.environ if environ is None else environ
    text, path = env.get(KEY_VAR, ""), env.get(KEY_FILE_VAR, "")
    if text and path:
        raise ValueError(f"both {KEY_VAR} and {KEY_FILE_VAR} are set: give the job's key one way")
    if path:
        text = _read_key_file(path)
    if not text:
        return None
    if len(text) < MIN_CHARS:
        where = f"the file {KEY_FILE_VAR} names" if path else KEY_VAR
        raise ValueError(f"the job's key in {where} has {len(text)} characters; it needs {MIN_CHARS} or more "
                         f"(make one with: python -c 'import secrets; print(secrets.token_urlsafe(32))')")
    return JobKey(text.encode())


def _read_key_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            data = f.read(1 << 16)
    except OSError as e:
        raise ValueError(f"{KEY_FILE_VAR}={path}: can't read the job's key ({e.strerror or e})") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{KEY_FILE_VAR}={path}: the key file can be read or written by others (mode "
                         f"{stat.S_IMODE(mode):o}); make it its owner's only: chmod 600 {path}")
    return data.decode("utf-8", "replace").strip()


def new_key() -> str | None:
    """A new random key for a job made here, or None where this process was given one (checked):
    its workers inherit that one with the rest of its environment."""
    return None if job_key() is not None else secrets.token_urlsafe(32)


def key_given(made: str | None) -> JobKey | None:
    """The key the workers hold: ``made`` here (``new_key``), else this process's own."""
    return JobKey(made.encode()) if made else job_key()
