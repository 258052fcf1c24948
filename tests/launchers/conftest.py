"""The launcher tier (make test-launchers): real srun, sbatch, mpirun and torchrun on this machine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ._cluster import ensure_packages, slurm_cluster

WHO = """
import json
import distcomm

with distcomm.from_env(timeout=60) as comm, distcomm.use(comm):
    info = {"rank": comm.rank, "world": comm.world_size, "local": [comm.local_rank, comm.local_size],
            "launcher": comm.launcher, "type": type(comm).__name__, "gathered": distcomm.all_gather(comm.rank)}
    print("WHO " + json.dumps(info), flush=True)
"""

DETECTRON2_STYLE = """
import json, sys
import distcomm

def main(tag):
    comm = distcomm.current()
    info = {"rank": comm.rank, "world": comm.world_size, "local": [comm.local_rank, comm.local_size],
            "launcher": comm.launcher, "type": type(comm).__name__, "gathered": distcomm.all_gather(comm.rank),
            "tag": tag}
    print("WHO " + json.dumps(info), flush=True)

if __name__ == "__main__":
    distcomm.launch(main, int(sys.argv[1]), args=("d2",), timeout=60)
"""

HELPERS_ONLY = """
import distcomm
print("GATHERED:" + str(distcomm.all_gather(distcomm.get_rank())), flush=True)
"""


@pytest.fixture(scope="session", autouse=True)
def packages() -> None:
    ensure_packages()


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield env


@pytest.fixture
def scripts(tmp_path: Path) -> Path:
    for name, text in (("who.py", WHO), ("d2.py", DETECTRON2_STYLE), ("helpers_only.py", HELPERS_ONLY)):
        (tmp_path / name).write_text(text)
    return tmp_path
