"""Small calls of this checkout beside an earlier commit's, and beside torch's own, in one run.

    python benchmarks/against.py [--commit 2e312e0] [--world 2 8] [--rounds 3]   (make bench does)

The earlier commit's ``distcomm/`` is taken out of git into a temporary folder. Each round runs
one job of each version (benchmarks/_percall_job.py under ``distcomm.launch``), in alternating
order, so that the machine's drift falls on both. Every job times torch's own calls too: torch's
column is the median over all jobs, and a version's ratio to torch is taken within its own jobs.
Figures: medians over rounds of each job's median, in µs per call, each batch the slowest rank's;
beside wall time, the ratio of the calling thread's CPU time (the Python and C++ a call runs there,
which the transport's noise on a loaded machine doesn't swamp; gloo's own threads are not in it, so
a fold moved from gloo's threads to the caller's counts against the change).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _report import publish

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BEFORE_MEMBERSHIP = "2e312e0"
"""The last commit before the membership work: small calls took 0.67-0.80x torch's time at 8 ranks."""


def earlier_tree(commit: str, into: Path) -> tuple[Path | None, str]:
    """``commit``'s distcomm/ in ``into``; or None and why, where no git history holds it."""
    try:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "distcomm"], check=True,
                                 capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        return None, e.stderr.decode().strip() if isinstance(e, subprocess.CalledProcessError) else str(e)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into, ""


def one_job(root: Path, world: int, calls: int, repeats: int) -> dict[str, dict[str, float]]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, str(HERE / "_percall_job.py"), str(world), str(calls), str(repeats)],
                         env=env, capture_output=True, text=True, timeout=600, cwd=root)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT "):]))
    raise SystemExit(f"the job under {root} printed no result:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")


TORCH_TWIN = {"synchronize": "torch: barrier", "all_gather(int)": "torch: all_gather_object(int)",
              "reduce_dict": "torch: all_reduce(4 floats)", "all_reduce_dict": "torch: all_reduce(4 floats)",
              "all_reduce(4 floats)": "torch: all_reduce(4 floats)",
              "all_reduce(4 floats, check=False)": "torch: all_reduce(4 floats)"}
"""Each call's nearest torch call, for the ratio to torch (reduce_dict's: one all_reduce of its values)."""


def table(world: int, commit: str, runs: dict[str, list[dict[str, dict[str, float]]]]) -> str:
    """Wall time per call (and the calling thread's CPU time) of this code beside ``commit``'s and torch's."""
    def med(version: str, kind: str, name: str, per: str | None = None) -> float:
        return statistics.median(r[kind][name] / (r[kind][per] if per else 1) for r in runs[version])

    rows = [f"### {world} ranks: µs per call, the slowest rank's (median of {len(runs['this'])} jobs of each)", "",
            f"| call | this | {commit} | this / {commit} | calling thread's CPU: this / {commit} | torch "
            f"| this / torch | {commit} / torch |", "|---|---|---|---|---|---|---|---|"]
    for name in (k for k in runs["this"][0]["wall"] if not k.startswith("torch: ")):
        this, then = med("this", "wall", name), med("then", "wall", name)
        cpu = med("this", "cpu", name) / med("then", "cpu", name)
        twin = TORCH_TWIN.get(name)
        vs_torch = "| | |" if twin is None else (
            f"{statistics.median(r['wall'][twin] for v in runs.values() for r in v):.0f} ({twin[7:]}) "
            f"| {med('this', 'wall', name, twin):.2f}x | {med('then', 'wall', name, twin):.2f}x |")
        rows.append(f"| {name} | {this:.0f} | {then:.0f} | {this / then:.2f}x | {cpu:.2f}x | {vs_torch}")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commit", default=BEFORE_MEMBERSHIP, help="the earlier commit (default: %(default)s)")
    parser.add_argument("--world", type=int, nargs="+", default=[2, 8], help="world sizes (default: 2 8)")
    parser.add_argument("--rounds", type=int, default=3, help="jobs of each version per world size")
    parser.add_argument("--calls", type=int, help="calls per timed batch (default: 200 / world size)")
    parser.add_argument("--repeats", type=int, default=7, help="timed batches per call per job")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="distcomm-against-") as tmp:
        then_root, why = earlier_tree(args.commit, Path(tmp))
        if then_root is None:  # (a shallow clone, an unpacked sdist): the rest of make bench still runs
            print(f"against.py: not run: no git history here holds {args.commit} ({why})", file=sys.stderr)
            return
        tables = []
        for world in args.world:
            runs: dict[str, list[dict[str, dict[str, float]]]] = {"this": [], "then": []}
            for r in range(args.rounds):
                order = [("this", ROOT), ("then", then_root)]
                for version, root in order if r % 2 == 0 else order[::-1]:
                    runs[version].append(one_job(root, world, args.calls or max(200 // world, 10), args.repeats))
            tables.append(table(world, args.commit, runs))
            print(f"({world} ranks done)", file=sys.stderr, flush=True)
    publish("\n\n".join(tables), "against")


if __name__ == "__main__":
    main()
