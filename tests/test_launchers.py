"""Who started this process: each launcher's variables read into one LaunchEnv, contradictions
refused before any connection, and the entry points (from_env, launch, current) that consume it.
The real launchers (srun, sbatch, mpirun, torchrun with restarts) run in tests/launchers/."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Iterator
from typing import Any

import pytest

import distcomm
from distcomm._hostlist import expand_hostlist
from distcomm._launchers import LaunchEnv, detect, tasks_per_node

_PREFIXES = ("SLURM_", "OMPI_", "PMI_", "PMIX_", "MPI_LOCAL", "MV2_", "TORCHELASTIC_")
_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
          "MASTER_ADDR", "MASTER_PORT", "MPIRUN_ID")


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as plain ``python`` started it, whatever runs the tests."""
    for name in list(os.environ):
        if name.startswith(_PREFIXES) or name in _NAMES:
            monkeypatch.delenv(name)
    yield


def _srun(rank: int, **extra: str) -> dict[str, str]:
    """What srun -N4 --ntasks-per-node=2 sets for task ``rank`` on gpu[01-04]."""
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank), "SLURM_NTASKS": "8",
            "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": str(rank % 2), "SLURM_NODEID": str(rank // 2),
            "SLURM_STEP_NODELIST": "gpu[01-04]", "SLURM_STEP_TASKS_PER_NODE": "2(x4)", **extra}


def _ompi(rank: int, world: int, local_size: int, **extra: str) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world),
            "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_size), "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
            "OMPI_MCA_ess_base_jobid": "2140798977", **extra}


def test_plain_python_is_a_world_of_one() -> None:
    env = detect({})
    assert env == LaunchEnv("python", 0, 1, 0, 1, 0, 1, "127.0.0.1", None)
    assert not env.started_by_launcher


_TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": "29500"}


def test_torchrun() -> None:
    env = detect({"TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                  "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "n0",
                  "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "2",
                  **_srun(1, SLURM_STEP_NUM_TASKS="2")})  # torchrun inside an srun task: torchrun's ranks
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_size, env.node_rank, env.num_nodes,
            env.master_addr, env.master_port, env.restart) == ("torchrun", 3, 4, 1, 2, 1, 2, "n0", 29500, 2)
    assert env.job == "torchrun-x-attempt-2" and not env.launcher_store  # the agent's store: only when it says
    assert detect({**dict(_TORCHRUN), "TORCHELASTIC_USE_AGENT_STORE": "True"}).launcher_store


def test_srun_across_nodes_all_ranks_agree_on_the_rendezvous() -> None:
    envs = [detect(_srun(r)) for r in range(8)]
    assert [(e.rank, e.local_rank, e.local_size, e.node_rank, e.num_nodes) for e in envs] == [
        (r, r % 2, 2, r // 2, 4) for r in range(8)]
    assert {(e.launcher, e.master_addr, e.master_port) for e in envs} == {("slurm", "gpu01", envs[0].master_port)}
    assert 20000 <= (envs[0].master_port or 0) < 30000
    assert detect(_srun(0, SLURM_JOB_ID="4243")).master_port != envs[0].master_port  # another job
    assert detect(_srun(0, SLURM_STEP_ID="1")).master_port != envs[0].master_port  # another step


def test_srun_uneven_tasks_per_node_and_explicit_address() -> None:
    env = detect(_srun(4, SLURM_STEP_TASKS_PER_NODE="2(x2),1", SLURM_STEP_NUM_TASKS="5", SLURM_NODEID="2",
                       SLURM_LOCALID="0", SLURM_STEP_NODELIST="a[1-2]-ib,b3", MASTER_ADDR="10.0.0.9",
                       MASTER_PORT="12345"))
    assert (env.local_size, env.num_nodes, env.master_addr, env.master_port) == (1, 3, "10.0.0.9", 12345)
    assert detect(_srun(0, SLURM_STEP_NODELIST="a[1-2]-ib,b3")).master_addr == "a1-ib"


def test_a_batch_script_is_not_a_task() -> None:
    """sbatch's script has SLURM_PROCID=0 and SLURM_NTASKS but runs once: not a rank of several."""
    env = detect({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"})
    assert env.launcher == "python" and env.world_size == 1


def test_mpirun_on_one_machine_and_across_machines() -> None:
    one = [detect(_ompi(r, 4, 4)) for r in range(4)]
    assert {(e.launcher, e.master_addr, e.master_port) for e in one} == {("openmpi", "127.0.0.1", one[0].master_port)}
    across = detect(_ompi(5, 8, 4))
    assert (across.rank, across.local_rank, across.local_size, across.master_addr) == (5, 1, 4, None)
    assert "mpirun -x MASTER_ADDR" in across.address_problem
    assert detect(_ompi(5, 8, 4, MASTER_ADDR="node0")).master_addr == "node0"
    # mpirun inside an sbatch script: the script's SLURM_PROCID=0 doesn't count; nor, inside an srun
    # step (srun --pty bash; the one-task steps Open MPI starts its daemons with), the step's
    assert detect({**_ompi(3, 4, 4), "SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}).rank == 3
    in_step = detect({**_srun(0, SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1"), **_ompi(3, 4, 4)})
    assert (in_step.launcher, in_step.rank, in_step.world_size) == ("openmpi", 3, 4)
    # uneven ranks per node (8 and 4 slots): no node index is guessed
    uneven = detect(_ompi(11, 12, 4, OMPI_MCA_orte_num_nodes="2"))
    assert (uneven.rank, uneven.local_size, uneven.node_rank, uneven.num_nodes) == (11, 4, None, None)
    one_each = detect(_ompi(3, 4, 1, OMPI_MCA_orte_num_nodes="4"))
    assert (one_each.node_rank, one_each.num_nodes) == (3, 4)


def test_hydra_and_mvapich() -> None:
    env = detect({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"})
    assert (env.launcher, env.rank, env.world_size, env.local_size, env.master_addr) == ("mpich", 2, 4, 2, None)
    # Hydra names no job id: across machines each node's parent differs, so the port must be given too
    assert "set MASTER_ADDR and MASTER_PORT" in env.address_problem
    env = detect({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1",
                  "MV2_COMM_WORLD_LOCAL_SIZE": "2"})
    assert (env.launcher, env.rank, env.master_addr) == ("mvapich", 1, "127.0.0.1")


def test_explicit_variables_of_a_job_controller() -> None:
    """Kubernetes' PyTorchJob without torchrun: one process per pod."""
    env = detect({"RANK": "2", "WORLD_SIZE": "3", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456"})
    assert (env.launcher, env.rank, env.world_size, env.local_rank, env.local_size, env.node_rank, env.num_nodes,
            env.master_addr, env.master_port) == ("env", 2, 3, 0, 1, 2, 3, "job-master-0", 23456)
    assert not env.address_problem
    # a launcher that sets LOCAL_RANK with LOCAL_SIZE (DeepSpeed's), or with no local size at all
    env = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "MASTER_ADDR": "h",
                  "MASTER_PORT": "1"})
    assert (env.local_rank, env.local_size, env.node_rank) == (1, 2, None)
    env = detect({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert (env.local_rank, env.local_size) == (3, None)
    assert "MASTER_PORT" in detect({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}).address_problem


@pytest.mark.parametrize(("env", "message"), [
    (_srun(1, RANK="0"), r"RANK=0 contradicts slurm's 1"),
    (_srun(1, WORLD_SIZE="4"), r"WORLD_SIZE=4 contradicts slurm's 8"),
    (_srun(9, SLURM_NODEID="3"), r"rank 9 out of range for world size 8"),
    (_srun(1, SLURM_STEP_NODELIST="gpu[01-04"), r"node list 'gpu\[01-04' leaves a bracket open"),
    (_srun(1, SLURM_STEP_TASKS_PER_NODE="2x4"), r"tasks per node '2x4'"),
    (_srun(1, SLURM_NODEID="7"), r"SLURM_NODEID=7 is out of range"),
    (_srun(1, SLURM_PROCID="x"), r"SLURM_PROCID='x' is not an integer"),
    ({**_ompi(1, 4, 4), "PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "4"},
     r"two launchers' variables disagree: openmpi says rank 1 of 4.* but mpich says rank 3 of 4"),
    (_ompi(1, 4, 8), r"local size 8 larger than the world size 4"),
    ({"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"MASTER_PORT is not set"),
    ({"RANK": "2", "WORLD_SIZE": "2"}, r"rank 2 out of range"),
])
def test_contradictions_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        detect(env)


def test_tasks_per_node() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]


@pytest.mark.parametrize("text", ["4(x2", "4(x2)x", "(x2)", "4,", "2(x)"])
def test_tasks_per_node_refuses_what_is_not_slurms_form(text: str) -> None:
    """A cut-off ``4(x2`` is not ``4(x2)``: guessing would size the world from a broken variable."""
    with pytest.raises(ValueError, match="is not Slurm's form"):
        tasks_per_node(text)


@pytest.mark.parametrize(("text", "hosts"), [
    ("gpu[01-04,07]", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07"]),
    ("a[1-2]-ib,b3", ["a1-ib", "a2-ib", "b3"]),
    ("r[1-2]n[001-002]", ["r1n001", "r1n002", "r2n001", "r2n002"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
    ("a,,b c", ["a", "b", "c"]),
    # three sets: scontrol runs the middle set outermost, then the first, the last fastest (hostlist.c
    # expands the prefix's sets from the right); tests/launchers/test_slurm.py compares with scontrol
    ("a[1-2]b[1-2]c[1-2]", ["a1b1c1", "a1b1c2", "a2b1c1", "a2b1c2", "a1b2c1", "a1b2c2", "a2b2c1", "a2b2c2"]),
])
def test_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["n[1-3", "n[[1]]", "n[3-1]", "n[]", "n[1-2]]", ",", "n[1-99999999]", "n[a]"])
def test_hostlist_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="node list"):
        expand_hostlist(text)


def test_from_env_under_python(no_launcher: None) -> None:
    with distcomm.from_env() as comm:
        assert isinstance(comm, distcomm.LocalCommunicator) and comm.launcher == "python"
        assert distcomm.current() is comm  # the process-wide default
    with distcomm.GlooCommunicator.from_env(timeout=30) as gloo:  # a torch.distributed world of one
        assert (gloo.rank, gloo.world_size, gloo.launcher) == (0, 1, "python")
        assert gloo.all_gather("x") == ["x"]
        assert "launcher=python" in repr(gloo)


def test_current_refuses_a_silent_world_of_one(no_launcher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _srun(1).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(distcomm.CommunicatorStateError, match=r"slurm started this process as rank 1 of 8.*"
                       r"distcomm.from_env\(\)"):
        distcomm.get_rank()
    with distcomm.LocalCommunicator() as comm, distcomm.use(comm):  # one installed: no question asked
        assert distcomm.get_rank() == 0


def test_from_env_across_machines_without_an_address(no_launcher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in _ompi(5, 8, 4).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(distcomm.CommunicatorStateError, match="set MASTER_ADDR"):
        distcomm.from_env(timeout=5)


def test_launch_refuses_what_does_not_add_up(no_launcher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"TORCHELASTIC_RUN_ID": "x", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                        "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=r"asked for 4 processes per machine, but torchrun started this "
                       r"process as rank 1 of 2, local 1 of 2.*--nproc-per-node 4"):
        distcomm.launch(print, 4)
    with pytest.raises(ValueError, match=r"num_machines=3\) contradicts the launcher"):
        distcomm.launch(print, 2, num_machines=3, dist_url="tcp://127.0.0.1:1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ValueError, match=r"run torchrun --nproc-per-node 2 instead"):
        distcomm.launch(print, 2)


def test_from_env_without_a_port_is_refused_at_once(no_launcher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank would pick a port of its own and wait for the timeout."""
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(distcomm.CommunicatorStateError, match="set MASTER_ADDR and MASTER_PORT"):
        distcomm.from_env(timeout=5)


def test_launch_refuses_other_counts_on_other_machines(no_launcher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """srun -N2 -n3: node 0 would run main here in a world of 3, node 1 start 2 in a world of 6."""
    for name, value in _srun(2, SLURM_STEP_NUM_TASKS="3", SLURM_STEP_TASKS_PER_NODE="2,1", SLURM_NODEID="1",
                             SLURM_LOCALID="0", SLURM_STEP_NODELIST="n[1-2]").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="same number of processes on every machine"):
        distcomm.launch(print, 2)


def _world_seen_by_a_worker(queue: Any) -> None:
    queue.put(distcomm.get_world_size())


def test_a_ranks_multiprocessing_worker_is_a_world_of_one(no_launcher: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A data loader's worker inherits the launcher's variables but is no rank of its own."""
    for name, value in _srun(1).items():
        monkeypatch.setenv(name, value)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    worker = context.Process(target=_world_seen_by_a_worker, args=(queue,))
    worker.start()
    try:
        assert queue.get(timeout=60) == 1
    finally:
        worker.join(30)
        worker.kill()
