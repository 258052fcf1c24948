"""Reading what every rank of a launched script printed."""

from __future__ import annotations

import json
import re
import subprocess
from typing import Any


def ranks_said(result: subprocess.CompletedProcess[str], world: int) -> list[dict[str, Any]]:
    """Each rank's WHO line, by rank; fails with the output unless the command succeeded and every
    rank of ``world`` spoke once."""
    assert result.returncode == 0, result.stdout[-4000:]
    # print() writes a line and its newline apart: two ranks' lines may share one line of the output
    said = [json.loads(m.group(1)) for m in re.finditer(r"WHO (\{[^{}]*\})", result.stdout)]
    assert sorted(s["rank"] for s in said) == list(range(world)), result.stdout[-4000:]
    return sorted(said, key=lambda s: s["rank"])
