"""Running a user's script in a process of its own, as a user would, and reading what it reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_script(path: Path, source: str, timeout: float) -> dict[str, Any]:
    """Write ``source`` to ``path``, run it with this interpreter (distcomm importable), and return
    the JSON it printed on its first line starting with ``RESULT ``."""
    path.write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, str(path)], cwd=path.parent, env=env, capture_output=True, text=True,
                         timeout=timeout)
    results = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, (out.stdout + out.stderr)[-3000:]
    got: dict[str, Any] = json.loads(results[0][len("RESULT "):])
    return got
