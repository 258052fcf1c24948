"""Jobs across "machines": network namespaces with host names of their own, each process started
with the variables its launcher would set on that node (torchrun itself, for torchrun)."""

from __future__ import annotations

import secrets
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import distcomm

from .._jobs import ELASTIC_DDP
from ._cluster import SUBNET, hosts, python_env, run_on_hosts
from ._output import ranks_said

pytestmark = pytest.mark.launchers

NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE
NIC = {"GLOO_SOCKET_IFNAME": "eth0"}  # the namespaces' host names resolve to nothing, as a cluster's may


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[str]]:
    with hosts(NODES) as names:
        yield names


def _each_rank_saw_the_world(result: object) -> None:
    said = ranks_said(result, WORLD)  # type: ignore[arg-type]
    for r, s in enumerate(said):
        assert (s["world"], s["local"], s["gathered"]) == (WORLD, [r % PER_NODE, PER_NODE], list(range(WORLD))), s


def _slurm_task(rank: int, per_node: int, **extra: str) -> dict[str, str]:
    return python_env({
        "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(NODES * per_node),
        "SLURM_STEP_NUM_TASKS": str(NODES * per_node), "SLURM_LOCALID": str(rank % per_node),
        "SLURM_NODEID": str(rank // per_node), "SLURM_STEP_NODELIST": f"{SUBNET}.[1-{NODES}]",
        "SLURM_STEP_TASKS_PER_NODE": f"{per_node}(x{NODES})", **NIC, **extra})


def test_srun_across_nodes(nodes: list[str], scripts: Path) -> None:
    cmds = [(nodes[r // PER_NODE], [sys.executable, str(scripts / "who.py")], _slurm_task(r, PER_NODE))
            for r in range(WORLD)]
    result = run_on_hosts(cmds, scripts)
    _each_rank_saw_the_world(result)
    assert {s["launcher"] for s in ranks_said(result, WORLD)} == {"slurm"}


def test_srun_one_task_per_node_and_launch(nodes: list[str], scripts: Path) -> None:
    """The detectron2 + submitit pattern: srun --ntasks-per-node=1, launch(main, 2) on each node."""
    cmds = [(nodes[n], [sys.executable, str(scripts / "d2.py"), str(PER_NODE)], _slurm_task(n, 1))
            for n in range(NODES)]
    result = run_on_hosts(cmds, scripts)
    _each_rank_saw_the_world(result)
    assert {s["launcher"] for s in ranks_said(result, WORLD)} == {"launch"}


def test_mpirun_across_nodes_with_master_addr(nodes: list[str], scripts: Path) -> None:
    def ompi(rank: int) -> dict[str, str]:
        return python_env({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(WORLD),
                           "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % PER_NODE),
                           "OMPI_COMM_WORLD_LOCAL_SIZE": str(PER_NODE), "OMPI_MCA_ess_base_jobid": "31337",
                           "MASTER_ADDR": f"{SUBNET}.1", **NIC})  # as mpirun -x MASTER_ADDR sets it on every node
    cmds = [(nodes[r // PER_NODE], [sys.executable, str(scripts / "who.py")], ompi(r)) for r in range(WORLD)]
    result = run_on_hosts(cmds, scripts)
    _each_rank_saw_the_world(result)
    assert {s["launcher"] for s in ranks_said(result, WORLD)} == {"openmpi"}


def test_torchrun_multi_node(nodes: list[str], scripts: Path) -> None:
    port = str(distcomm.free_port())
    cmds = [(nodes[n], [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(n),
                        "--nproc-per-node", str(PER_NODE), "--master-addr", f"{SUBNET}.1", "--master-port", port,
                        str(scripts / "who.py")], python_env(NIC)) for n in range(NODES)]
    result = run_on_hosts(cmds, scripts)
    _each_rank_saw_the_world(result)
    assert {s["launcher"] for s in ranks_said(result, WORLD)} == {"torchrun"}


def test_a_job_controller_one_process_per_pod_and_launch(nodes: list[str], scripts: Path) -> None:
    """Kubernetes' PyTorchJob without torchrun: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT per pod."""
    port = str(distcomm.free_port())
    cmds = [(nodes[n], [sys.executable, str(scripts / "d2.py"), str(PER_NODE)],
             python_env({"RANK": str(n), "WORLD_SIZE": str(NODES), "MASTER_ADDR": f"{SUBNET}.1",
                         "MASTER_PORT": port, **NIC})) for n in range(NODES)]
    _each_rank_saw_the_world(run_on_hosts(cmds, scripts))


def test_a_host_name_peers_cannot_reach_is_refused_at_once(nodes: list[str], scripts: Path) -> None:
    """Without GLOO_SOCKET_IFNAME gloo would hand peers an address for this host's name, which here
    resolves to nothing: each connection would wait for the timeout. Refused before connecting."""
    def bare(rank: int, per_node: int) -> dict[str, str]:
        env = _slurm_task(rank, per_node)
        del env["GLOO_SOCKET_IFNAME"]
        return env
    result = run_on_hosts([(nodes[r // PER_NODE], [sys.executable, str(scripts / "who.py")], bare(r, PER_NODE))
                           for r in range(WORLD)], scripts, timeout=60)
    assert result.returncode != 0
    assert result.stdout.count("Set GLOO_SOCKET_IFNAME to the interface that reaches 10.79.0.1") == WORLD, \
        result.stdout[-3000:]
    result = run_on_hosts([(nodes[n], [sys.executable, str(scripts / "d2.py"), "2"], bare(n, 1))
                           for n in range(NODES)], scripts, timeout=60)
    assert result.stdout.count("launch() under slurm across machines: this host's name") == NODES


RESTARTING = """
import json, os, sys
import distcomm

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
with distcomm.from_env(timeout=60) as comm, distcomm.use(comm):
    gathered = distcomm.all_gather(comm.rank)
    if attempt == 0 and comm.rank == 2:
        sys.exit(3)  # one node's worker fails after set-up; its agent restarts it, the other node's its own
    distcomm.synchronize()
    info = {"rank": comm.rank, "world": comm.world_size, "local": [comm.local_rank, comm.local_size],
            "launcher": comm.launcher, "gathered": gathered, "attempt": attempt}
    print("WHO " + json.dumps(info), flush=True)
"""


def test_torchrun_multi_node_workers_meet_again_after_a_restart(nodes: list[str], scripts: Path) -> None:
    """Each node's agent counts its own restarts: the workers meet in the store's rounds whatever they counted."""
    (scripts / "restarting.py").write_text(RESTARTING)
    port = str(distcomm.free_port())
    cmds = [(nodes[n], [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES), "--node-rank", str(n),
                        "--nproc-per-node", str(PER_NODE), "--max-restarts", "2", "--master-addr", f"{SUBNET}.1",
                        "--master-port", port, str(scripts / "restarting.py")], python_env(NIC))
            for n in range(NODES)]
    result = run_on_hosts(cmds, scripts)
    said = ranks_said(result, WORLD)
    _each_rank_saw_the_world(result)
    assert all(s["attempt"] >= 1 for s in said), said


def _distcomm_run(nodes: list[str], port: str, *args: str) -> list[tuple[str, list[str], dict[str, str]]]:
    """One ``python -m distcomm run`` agent per node; the first node's serves the job's store. Each is
    given the job's key, as a user gives it to agents on several machines."""
    key = {"DISTCOMM_JOB_KEY": secrets.token_urlsafe(32)}
    return [(nodes[n], [sys.executable, "-m", "distcomm", "run", "--nnodes", str(NODES), "--node-rank", str(n),
                        "--nproc-per-node", str(PER_NODE), "--master-addr", f"{SUBNET}.1", "--master-port", port,
                        *args], {**python_env(NIC), **key}) for n in range(NODES)]


def test_distcomm_run_multi_node(nodes: list[str], scripts: Path) -> None:
    result = run_on_hosts(_distcomm_run(nodes, str(distcomm.free_port()), str(scripts / "who.py")), scripts)
    _each_rank_saw_the_world(result)
    assert {s["launcher"] for s in ranks_said(result, WORLD)} == {"distcomm run"}  # (beside torchrun's variables)


def test_distcomm_run_multi_node_starts_a_lost_worker_again_on_its_own_node(nodes: list[str], scripts: Path) -> None:
    """Rank 3, on the second node, is killed; that node's agent starts it again, the members let it
    in, and both agents end with the job finished."""
    (scripts / "elastic.py").write_text(textwrap.dedent(ELASTIC_DDP))
    result = run_on_hosts(_distcomm_run(nodes, str(distcomm.free_port()), "--replacements", "1",
                                        str(scripts / "elastic.py"), "3"), scripts)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "rank 3 (pid " in result.stdout and "was lost (killed by SIGKILL); started again" in result.stdout
    assert result.stdout.count("done: members [0, 1, 2, 3], admitted [3]") == WORLD, result.stdout[-4000:]
    assert result.stdout.count("distcomm run: the job finished") == NODES, result.stdout[-4000:]
