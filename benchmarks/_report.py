"""Where a benchmark's table goes: printed, and kept in benchmarks/out/<name>.md."""

from __future__ import annotations

from pathlib import Path

OUT = Path(__file__).parent / "out"


def publish(table: str, name: str) -> None:
    print(table)
    OUT.mkdir(exist_ok=True)
    (OUT / f"{name}.md").write_text(table + "\n")
