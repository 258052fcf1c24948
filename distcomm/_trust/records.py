"""The job's store as its membership records see it.

torch's TCPStore answers anyone who reaches its port, so records can't be kept secret or out of
an outsider's reach; they can be made unforgeable. With the job's key, each value is stored
behind a MAC of the record's full name and its value: one written without the key, or copied to
another name (another round, another epoch, another rank), reads as absent here, and is named
once in a warning. Counters (``add``) carry no MAC: they number things (rounds, epochs), and where
a count decides (a round complete), the signed records it counts are checked. Without a key,
values are stored as they are.
"""

from __future__ import annotations

import hmac
import warnings
from typing import Any

import torch

from .key import MAC_BYTES, JobKey

__all__ = ["Records"]

_ABSENT = b"\x00distcomm: no such record\x00"
"""What a read's compare-and-set expects: absent, the store answers with it and writes nothing."""
_NAMED: set[str] = set()


class Records:
    """The records under ``path`` in the job's store (``raw``: the store under that prefix), each
    signed with ``key`` where the job has one, over its full name."""

    def __init__(self, raw: Any, key: JobKey | None, path: str) -> None:
        self.raw, self.key, self.path = raw, key, path

    @property
    def underlying_store(self) -> Any:  # (as a PrefixStore: tcp_store finds the TCPStore beneath)
        return self.raw

    def under(self, prefix: str) -> Records:
        """The records under ``prefix/``."""
        return Records(torch._C._distributed_c10d.PrefixStore(prefix, self.raw), self.key, f"{self.path}{prefix}/")

    def clone(self) -> Records:
        """The same records over a connection of its own."""
        return Records(self.raw.clone(), self.key, self.path)

    # ---------------------------------------------------------------- records
    def set(self, name: str, value: str | bytes) -> None:
        self.raw.set(name, self._signed(name, _bytes(value)))

    def read(self, name: str) -> bytes | None:
        """The record's value, or None where there is none (or only a forged one): one store call."""
        found = bytes(self.raw.compare_set(name, _ABSENT, _ABSENT))
        return None if found == _ABSENT else self._verified(name, found)

    def get(self, name: str) -> bytes:
        """The record's value; KeyError where there is none (or only a forged one)."""
        value = self.read(name)
        if value is None:
            raise KeyError(f"no record {self.path}{name} in the job's store")
        return value

    def check(self, names: list[str]) -> bool:
        """Whether every one of the records is there (a forged one is not)."""
        if self.key is None:
            return bool(self.raw.check(names))
        return all(self.read(n) is not None for n in names)

    def compare_set(self, name: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """Set ``desired`` where the record holds ``expected`` ("": none, or an empty one); the
        record's value afterwards. A forged value counts as none: a claim overwrites it."""
        want, new = _bytes(expected), self._signed(name, _bytes(desired))
        held = bytes(self.raw.compare_set(name, self._signed(name, want) if want else b"", new))
        for _ in range(3):
            value = self._verified(name, held)
            if want or (value is not None and (value or held == new)):
                return b"" if value is None else value
            held = bytes(self.raw.compare_set(name, held, new))  # (an empty or forged one in the way of a claim)
        return self._verified(name, held) or b""

    def add(self, name: str, amount: int) -> int:
        """A counter: not signed (see the module's doc)."""
        return int(self.raw.add(name, amount))

    def append_entry(self, name: str, entry: str) -> None:
        """Add ``entry`` (no commas) to the list at ``name``, signed on its own."""
        mac = self.key.mac(b"entry", f"{self.path}{name}".encode(), entry.encode()).hex() if self.key else ""
        self.raw.append(name, f"{entry}#{mac},")

    def entries(self, name: str) -> list[str]:
        """The signed entries of the list at ``name``, in order (forged ones left out, named)."""
        text = self.raw.get(name).decode("utf-8", "replace") if self.raw.check([name]) else ""
        kept = []
        for item in filter(None, text.split(",")):
            entry, _, mac = item.rpartition("#")
            if self.key is None or hmac.compare_digest(
                    mac, self.key.mac(b"entry", f"{self.path}{name}".encode(), entry.encode()).hex()):
                kept.append(entry)
            else:
                self._name_forged(name)
        return kept

    # ---------------------------------------------------------------- MACs
    def _signed(self, name: str, value: bytes) -> bytes:
        if self.key is None:
            return value
        return self.key.mac(f"{self.path}{name}".encode(), value) + value

    def _verified(self, name: str, stored: bytes) -> bytes | None:
        if self.key is None:
            return stored
        value = stored[MAC_BYTES:]
        if len(stored) >= MAC_BYTES and hmac.compare_digest(
                stored[:MAC_BYTES], self.key.mac(f"{self.path}{name}".encode(), value)):
            return value
        self._name_forged(name)
        return None

    def _name_forged(self, name: str) -> None:
        full = f"{self.path}{name}"
        if full not in _NAMED:
            _NAMED.add(full)
            warnings.warn(f"distcomm: ignored the record {full} in the job's store: it was not written with the "
                          f"job's key (a process that can reach the store but is none of the job's wrote it; "
                          f"see docs/trust-model.md)", RuntimeWarning, stacklevel=3)


def _bytes(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)
