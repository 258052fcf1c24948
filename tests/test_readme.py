"""Every Python block in the README runs as written, so the docs can't rot.

A block's info string says how: ```python runs it as a script, ```python torchrun under torchrun
with 2 processes, ```python pytest as a test file; ```python fragment marks a snippet that is not
meant to run on its own (a signature, a before/after table).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import distcomm

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^( *)```python([^\n]*)\n(.*?)^\1```", re.M | re.S)
KINDS = {"", "torchrun", "pytest", "fragment"}


def blocks() -> list[tuple[int, str, str]]:
    text = (ROOT / "README.md").read_text()
    found = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        found.append((line, m.group(2).strip(), textwrap.dedent(m.group(3))))
    return found


def test_every_block_says_how_it_runs() -> None:
    found = blocks()
    assert len(found) >= 5
    for line, kind, _ in found:
        assert kind in KINDS, f"README line {line}: unknown block kind {kind!r}"
    assert sum(kind != "fragment" for _, kind, _ in found) >= 4


@pytest.mark.slow
@pytest.mark.parametrize("line,kind,code", [b for b in blocks() if b[1] != "fragment"],
                         ids=lambda v: str(v) if isinstance(v, int) else None)
def test_block_runs(line: int, kind: str, code: str, tmp_path: Path) -> None:
    script = tmp_path / ("test_block.py" if kind == "pytest" else "block.py")
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(distcomm.free_port()), str(script)]
    elif kind == "pytest":
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"README block at line {line} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
