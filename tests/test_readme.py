"""Every Python block in README.md and docs/*.md runs as written, so the docs can't rot.

A block's info string says how: ```python runs it as a script, ```python torchrun under torchrun
with 2 processes, ```python pytest as a test file; ```python fragment marks a snippet that is not
meant to run on its own (a signature, a before/after table). ``file=NAME`` after the kind runs the
block under that file name and puts it beside every later block of the same page, as a reader who
saved it would have it (docs/tutorial.md's test imports its train.py).

Blocks run as a user would paste them into a project of their own: from an empty directory, with
distcomm installed and nothing of this repository's on the path (its examples and tests aren't
importable there; ``test_blocks_run_outside_the_repository`` checks that).
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
FILE = re.compile(r"(?:^|\s)file=(\S+)$")


def doc_files() -> list[str]:
    """README.md, then every page under docs/, as paths relative to the repository root."""
    return ["README.md", *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))]


def blocks() -> list[tuple[str, str, str, str, dict[str, str]]]:
    """(where, kind, name, code, saved) of every ```python block: where is ``file:line``; name the file it
    runs as ("" for the default); saved, the files earlier blocks of its page saved (name: code)."""
    found = []
    for name in doc_files():
        text = (ROOT / name).read_text()
        saved: dict[str, str] = {}
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            info, code = m.group(2).strip(), textwrap.dedent(m.group(3))
            named = FILE.search(info)
            kind = info[:named.start()].strip() if named else info
            found.append((f"{name}:{line}", kind, named.group(1) if named else "", code, dict(saved)))
            if named:
                saved[named.group(1)] = code
    return found


def test_every_block_says_how_it_runs() -> None:
    found = blocks()
    assert len(found) >= 5
    for where, kind, *_ in found:
        assert kind in KINDS, f"{where}: unknown block kind {kind!r}"
    assert sum(kind != "fragment" for _, kind, *_ in found) >= 4
    readme = [kind for where, kind, *_ in found if where.startswith("README.md:")]
    assert sum(kind != "fragment" for kind in readme) >= 3, "the README's quick start and testing examples run"


@pytest.mark.slow
@pytest.mark.parametrize("where,kind,name,code,saved", [pytest.param(*b, id=f"{b[0]}-{b[1]}" if b[1] else b[0])
                                                        for b in blocks() if b[1] != "fragment"])
def test_block_runs(where: str, kind: str, name: str, code: str, saved: dict[str, str], tmp_path: Path) -> None:
    for other, text in saved.items():
        (tmp_path / other).write_text(text)
    script = tmp_path / (name or ("test_block.py" if kind == "pytest" else "block.py"))
    script.write_text(code)
    env = _users_env()
    if kind == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(distcomm.free_port()), str(script)]
    elif kind == "pytest":
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(script)]
    else:
        cmd = [sys.executable, str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"block at {where} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"


def _users_env() -> dict[str, str]:
    """The environment of a user's project: distcomm installed, no path into this repository."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_blocks_run_outside_the_repository(tmp_path: Path) -> None:
    """Where the blocks run, distcomm imports (installed) and the repository's own modules don't."""
    probe = "import importlib.util as u; print(u.find_spec('distcomm') is not None, u.find_spec('examples'), " \
            "u.find_spec('tests'))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=_users_env(), capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert out == ["True", "None", "None"], out


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_readme_links_every_docs_page_and_links_resolve() -> None:
    readme = (ROOT / "README.md").read_text()
    for name in doc_files()[1:]:
        assert f"]({name})" in readme, f"README.md doesn't link {name}"
    for name in doc_files():
        for target in LINK.findall((ROOT / name).read_text()):
            if "://" in target or target.startswith("#"):
                continue
            path = (ROOT / name).parent / target.split("#", 1)[0]
            assert path.exists(), f"{name}: link to {target}, which doesn't exist"
