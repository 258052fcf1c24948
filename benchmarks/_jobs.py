"""What the recovery benchmarks share about the jobs they start: the environment a launcher gets,
and the RESULT lines its ranks print."""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any


def job_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for a launcher: no rank variables of its own, this path, ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return {**env, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **extra}


def results(text: str) -> list[dict[str, Any]]:
    """Each ``RESULT {...}`` a rank printed (ranks that print at once may share a line of the launcher's output)."""
    return [json.loads(m) for m in re.findall(r"RESULT (\{[^{}]*\})", text)]
