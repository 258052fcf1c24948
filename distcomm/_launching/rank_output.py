"""What launch()'s processes print: each line prefixed with its rank where several ranks share one
terminal, and a copy per rank in a log directory (torchrun's ``--tee`` / ``--log-dir``).

Python's ``sys.stdout`` and ``sys.stderr`` are wrapped: what C++ code writes to the file
descriptors directly (torch's and gloo's own warnings, a crash's last words) goes to the terminal
as it is, and not into the log. Only processes launch() starts are wrapped (a job of one process,
or ranks a launcher started, print as they would without it).
"""

from __future__ import annotations

import codecs
import dataclasses
import io
import os
import re
import select
import sys
import threading
from typing import Any, TextIO

__all__ = ["RankOutput", "Tail", "log_name", "pass_through"]


@dataclasses.dataclass(frozen=True)
class RankOutput:
    """How a launched process's output is written: ``prefix`` its lines with ``[rank<r>]: ``;
    ``log_dir``: also into ``<log_dir>/rank<r>.log``."""

    prefix: bool = False
    log_dir: str | None = None
    attempt: int = 0  # a replacement's: its log is rank<r>.<attempt>.log, never the one of the process it replaces

    @classmethod
    def chosen(cls, prefix: bool | None, log_dir: str | os.PathLike[str] | None) -> RankOutput:
        """launch()'s arguments: ``prefix`` None prefixes where the output is a terminal (a person
        reads the ranks' lines interleaved; a pipe or a file is left as it is)."""
        if prefix is not None and not isinstance(prefix, bool):
            raise TypeError(f"prefix_output must be a bool or None, got {type(prefix).__name__}")
        if prefix is None:
            prefix = sys.stdout.isatty()
        directory = None if log_dir is None else os.fspath(log_dir)
        if directory is not None:
            os.makedirs(directory, exist_ok=True)  # here, before any process starts: an error is the caller's
        return cls(bool(prefix), directory)

    def install(self, rank: int) -> None:
        """In the launched process: wrap its streams (nothing where there is nothing to do)."""
        if not self.prefix and self.log_dir is None:
            return
        copy = None if self.log_dir is None else open(
            os.path.join(self.log_dir, log_name(rank, self.attempt)), "w", buffering=1, encoding="utf-8")
        tag = f"[rank{rank}]: " if self.prefix else ""
        sys.stdout = _Lines(sys.stdout, tag, copy)
        sys.stderr = _Lines(sys.stderr, tag, copy)


def log_name(rank: int, attempt: int) -> str:
    """The log of ``rank``'s process: ``rank<r>.log``, and ``rank<r>.<attempt>.log`` for its replacements."""
    return f"rank{rank}.log" if attempt == 0 else f"rank{rank}.{attempt}.log"


class _Lines(io.TextIOBase):
    """A text stream that writes to ``target`` with ``tag`` at the start of each line, and to ``copy``.
    Whole lines go out in one write each (``print`` writes its text and its newline apart), so the
    lines of ranks sharing one terminal or pipe never run into each other."""

    def __init__(self, target: TextIO, tag: str, copy: TextIO | None) -> None:
        super().__init__()
        self._target, self._tag, self._copy = target, tag, copy
        self._at_start = True
        self._partial = ""

    def write(self, s: str) -> int:
        text = self._partial + s
        end = text.rfind("\n") + 1
        self._partial = text[end:]
        if end:
            self._emit(text[:end])
        if self._copy is not None:
            self._copy.write(s)
        return len(s)

    def _emit(self, text: str) -> None:
        if self._tag:
            lines = text.splitlines(keepends=True)
            text = "".join(self._tag + line if i or self._at_start else line for i, line in enumerate(lines))
        self._at_start = text.endswith("\n")
        self._target.write(text)

    def flush(self) -> None:
        if self._partial:  # a line without its end yet (a progress bar): out as it is
            self._emit(self._partial)
            self._partial = ""
        self._target.flush()
        if self._copy is not None:
            self._copy.flush()

    def isatty(self) -> bool:
        return self._target.isatty()

    def fileno(self) -> int:
        return self._target.fileno()

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", "utf-8")

    def __getattr__(self, name: str) -> Any:  # errors, buffer, ... of the stream underneath
        return getattr(self._target, name)


_QUIET_SECONDS = 0.05  # a line not ended yet (a progress bar) goes out once its worker is this long quiet
_LINE_END = re.compile(r"(\r\n|\r|\n)")


class Tail:
    """The last ``size`` characters a worker wrote to a stream (its traceback, where it raised)."""

    def __init__(self, size: int = 16384) -> None:
        self.text, self._size = "", size

    def add(self, text: str) -> None:
        self.text = (self.text + text)[-self._size:]


def pass_through(fd: int, out: TextIO, tag: str, log: TextIO | None, lock: threading.Lock, tail: Tail | None) -> None:
    """Copy what a worker writes to the pipe ``fd`` on to ``out`` as it comes, ``tag`` at the start
    of each line (after a newline or a ``\\r``: a progress bar redraws its line), and to ``log`` as
    it is, its end into ``tail``; until the worker closes the pipe (it ended), then close it.

    Whole lines go out in one write each, so that workers sharing a terminal don't cut into each
    other's lines; what follows the last line end (a progress bar's update) once the worker is
    quiet for a moment. Once ``out`` can't be written (its reader left: ``| head``), the rest is
    read and dropped: a worker never blocks on a full pipe."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    tagged = _Tagged(tag)
    pending = ""  # read, after the last line end: waits a moment for the rest of its line
    while True:
        if pending and not select.select([fd], [], [], _QUIET_SECONDS)[0]:
            _write(out, tagged(pending), lock)
            pending = ""
            continue
        chunk = os.read(fd, 65536)
        new = decoder.decode(chunk, final=not chunk)
        if log is not None:
            log.write(new)
            log.flush()
        if tail is not None:
            tail.add(new)
        text = pending + new
        cut = len(text) if not chunk else max(text.rfind("\n"), text.rfind("\r")) + 1
        if cut:
            _write(out, tagged(text[:cut]) + ("" if tagged.at_start or chunk else "\n"), lock)
        pending = text[cut:]
        if not chunk:
            break
    os.close(fd)


class _Tagged:
    """``tag`` put at the start of each line of a stream written in pieces."""

    def __init__(self, tag: str) -> None:
        self._tag, self.at_start = tag, True

    def __call__(self, text: str) -> str:
        if not self._tag:
            self.at_start = text.endswith(("\n", "\r")) if text else self.at_start
            return text
        parts = []
        for part in _LINE_END.split(text):
            if not part:
                continue
            if _LINE_END.fullmatch(part):
                self.at_start = True
            elif self.at_start:
                self.at_start = False
                if not part.startswith(self._tag):  # (prefixed already: a worker that tags its own lines)
                    parts.append(self._tag)
            parts.append(part)
        return "".join(parts)


def _write(out: TextIO, text: str, lock: threading.Lock) -> None:
    if text:
        with lock:
            write_or_drop(out, text)


def write_or_drop(out: TextIO, text: str) -> None:
    """``text`` to ``out``; where its reader is gone (``| head``), ``out`` is pointed at /dev/null,
    so that the rest (and the interpreter's last flush) is dropped without an error."""
    try:
        out.write(text)
        out.flush()
    except (BrokenPipeError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, out.fileno())
        except (OSError, ValueError):  # (no descriptor: nothing will flush it at exit)
            pass
        finally:
            os.close(devnull)
