"""Slurm's node-list grammar: ``gpu[01-04,07]``, ``a[1-2]-ib,b3``, ``r[1-2]n[001-002]``.

A list is names separated by commas or white space (empty ones skipped, as Slurm does); a name
may hold several bracketed sets, each a comma-separated list of numbers or ``lo-hi`` ranges, and
expands to their product in the order ``scontrol show hostnames`` prints it: the last set varies
fastest, and the others, outermost first, from the second-to-last back to the first (Slurm's
hostlist.c takes the last set as the ranges, then expands the prefix's sets from its right end
outwards, so ``a[1-2]b[1-2]c[1-2]`` runs b, then a, then c). A range
keeps the width of its lower bound (``[08-10]`` is 08, 09, 10). Text after the last set
(``a[1-2]-ib``) is kept, as newer Slurm releases do (22.05 refuses it). Anything else raises
ValueError: nested or unbalanced brackets, a range that runs backwards, an empty set.
"""

from __future__ import annotations

import itertools
import re

__all__ = ["expand_hostlist"]

_RANGE = re.compile(r"(\d+)(?:-(\d+))?\Z")
_LONGEST = 1 << 16
"""Hosts one expression may name: a typo like ``n[1-999999999]`` is refused, not expanded."""


def expand_hostlist(text: str) -> list[str]:
    """The host names a Slurm node list names, in Slurm's order."""
    hosts: list[str] = []
    for name in _split_top_level(text):
        hosts.extend(_expand_name(name, text))
        if len(hosts) > _LONGEST:
            raise ValueError(f"node list {text!r} names more than {_LONGEST} hosts")
    if not hosts:
        raise ValueError(f"node list {text!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """``text`` split at the commas and white space outside brackets; unbalanced brackets are refused."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"node list {text!r} nests brackets at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"node list {text!r} closes a bracket it didn't open at position {i}")
        elif (ch == "," or ch.isspace()) and depth == 0:
            names.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"node list {text!r} leaves a bracket open")
    names.append(text[start:])
    return [n for n in names if n]


def _expand_name(name: str, text: str) -> list[str]:
    """One name with its bracketed sets expanded, in Slurm's order (see the module's text)."""
    pieces = _pieces(name)
    sets = [_expand_set(body, text) for _, body in pieces if body is not None]
    total = 1
    for numbers in sets:
        total *= len(numbers)
        if total > _LONGEST:
            raise ValueError(f"node list {text!r} names more than {_LONGEST} hosts")
    order = [*range(len(sets) - 2, -1, -1), len(sets) - 1] if sets else []
    out: list[str] = []
    for chosen in itertools.product(*(sets[i] for i in order)):
        picked = dict(zip(order, chosen, strict=True))
        out.append("".join(literal + (picked[i] if body is not None else "")
                           for i, (literal, body) in enumerate(pieces)))
    return out


def _pieces(name: str) -> list[tuple[str, str | None]]:
    """``name`` as (literal text, the bracketed set after it or None) pairs; brackets are balanced."""
    pieces: list[tuple[str, str | None]] = []
    rest = name
    while "[" in rest:
        literal, _, tail = rest.partition("[")
        body, _, rest = tail.partition("]")
        pieces.append((literal, body))
    if rest or not pieces:
        pieces.append((rest, None))
    return pieces


def _expand_set(body: str, text: str) -> list[str]:
    """The numbers of one bracketed set, ``01-04,07``, as strings that keep their widths."""
    numbers: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part)
        if m is None:
            raise ValueError(f"node list {text!r}: [{body}] holds {part!r}, which is neither a number nor lo-hi")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            numbers.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"node list {text!r}: the range {part!r} runs backwards")
        if int(hi) - int(lo) >= _LONGEST:
            raise ValueError(f"node list {text!r}: the range {part!r} names more than {_LONGEST} hosts")
        numbers.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return numbers
