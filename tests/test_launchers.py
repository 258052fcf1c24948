"""Who started this process: each launcher's variables read into one LaunchEnv, contradictions
refused before any connection, and the entry points (from_env, launch, current) that consume it.
The real launchers (srun, sbatch, mpirun, torchrun with restarts) run in tests/launchers/."""

from __future__ import annotations

import json
import multiprocessing
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import distcomm
from distcomm._launching.hostlist import expand_hostlist
from distcomm._launching.launchers import LaunchEnv, detect, tasks_per_node

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
    # one job name whatever each node's agent counted: the store counts the rounds (nodes restart apart)
    assert env.job == "torchrun-x" and not env.launcher_store  # the agent's store: only when it says
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


def _one_world(envs: list[LaunchEnv]) -> LaunchEnv:
    """The ranks of one launch form one world: ranks 0..n-1, one size, address, port and job."""
    assert sorted(e.rank for e in envs) == list(range(envs[0].world_size)) == list(range(len(envs)))
    assert len({(e.launcher, e.world_size, e.master_addr, e.master_port, e.job) for e in envs}) == 1, envs
    return envs[0]


# What Slurm 26.05 gives a batch script asking for 16 tasks (sbatch -N2 --ntasks-per-node 8), with the
# noise real jobs carry: the batch step prints its id signed (SLURM_BATCH_SCRIPT = 0xfffffffb in slurm.h).
_SBATCH = {"SLURM_JOB_ID": "81", "SLURM_JOBID": "81", "SLURM_STEP_ID": "-5", "SLURM_STEPID": "-5",
           "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS": "16", "SLURM_NPROCS": "16",
           "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODELIST": "n[1-2]",
           "SLURM_TASKS_PER_NODE": "8(x2)", "SLURM_JOB_CPUS_PER_NODE": "8(x2)", "SLURM_CPUS_ON_NODE": "8",
           "SLURM_GTIDS": "0", "SLURM_TASK_PID": "4242", "SLURM_CPU_BIND": "quiet,mask_cpu:0xFF",
           "SLURM_SUBMIT_DIR": "/home/u", "PMIX_NAMESPACE": "slurm.pmix.81.-5"}


@pytest.mark.parametrize("step", [
    "-5", "4294967291",  # the batch script (SLURM_BATCH_SCRIPT), signed as 26.05 prints it and unsigned
    "-6", "4294967290",  # salloc's interactive step (SLURM_INTERACTIVE_STEP, use_interactive_step)
    "-4", "4294967292",  # the extern step (SLURM_EXTERN_CONT)
    "4294967294", "4294967295",  # batch and extern before Slurm 20.11
])
def test_a_special_slurm_step_is_no_srun_task(step: str) -> None:
    """`python train.py` in an sbatch script asking for 16 tasks is a world of one, not rank 0 of 16."""
    env = detect({**_SBATCH, "SLURM_STEP_ID": step, "SLURM_STEPID": step})
    assert (env.launcher, env.world_size) == ("python", 1)


_HYDRA_NOISE = {"PMI_FD": "6", "HYDRA_BSTRAP_XTERM_CMD": "xterm", "I_MPI_PIN_MAPPING": "2:0 0,1 8",
                "I_MPI_HYDRA_TOPOLIB": "hwloc", "OMP_NUM_THREADS": "4"}


def _hydra(rank: int, world: int, per_node: int, **extra: str) -> dict[str, str]:
    """What Hydra's proxy sets for a rank (MPICH's pmip_cb.c launch_procs: MPI_LOCALNRANKS,
    MPI_LOCALRANKID, PMI_RANK, PMI_FD, PMI_SIZE; Intel MPI's Hydra alike), with Intel MPI's noise."""
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(world), "MPI_LOCALRANKID": str(rank % per_node),
            "MPI_LOCALNRANKS": str(per_node), **_HYDRA_NOISE, **extra}


def test_hydra_across_machines_names_its_job_from_what_every_rank_shares() -> None:
    # mpiexec under Slurm starts its proxies with one srun step of a task per node: the ranks inherit it
    step = {"SLURM_JOB_ID": "90", "SLURM_STEP_ID": "3", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
            "SLURM_PROCID": "1", "SLURM_NODEID": "1", "SLURM_STEP_NODELIST": "n[1-2]"}
    world = _one_world([detect({**_hydra(r, 4, 2), **step, "MASTER_ADDR": "n1"}) for r in range(4)])
    assert (world.launcher, world.master_addr, world.job) == ("mpich", "n1", "mpich-slurm-step-90.3")
    assert detect({**_hydra(0, 4, 2), **step, "SLURM_STEP_ID": "4", "MASTER_ADDR": "n1"}).job != world.job
    # without Slurm: only the address and port every rank was given name the job (each node's parent differs)
    given = _one_world([detect({**_hydra(r, 4, 2), "MASTER_ADDR": "n1", "MASTER_PORT": "29400"}) for r in range(4)])
    assert (given.master_port, given.job) == (29400, "mpich-n1:29400")
    refused = detect(_hydra(3, 4, 2, MASTER_ADDR="n1"))
    assert (refused.master_port, refused.job) == (None, "")
    assert "names no job they all share: set MASTER_ADDR and MASTER_PORT" in refused.address_problem


def test_hydra_pmi_port_mode() -> None:
    """mpiexec -pmi-port sets PMI_ID and PMI_PORT, no PMI_RANK or PMI_SIZE (pmip_cb.c)."""
    def rank(r: int, **extra: str) -> dict[str, str]:
        return {"PMI_ID": str(r), "PMI_PORT": "vm:41231", "MPI_LOCALRANKID": str(r), "MPI_LOCALNRANKS": "2",
                "OMP_NUM_THREADS": "4", **extra}
    with pytest.raises(ValueError, match=r"-pmi-port mode \(PMI_ID=1, PMI_PORT\) names this rank but not how many"
                       r".*mpiexec -genv WORLD_SIZE <n>"):
        detect(rank(1))
    world = _one_world([detect(rank(r, WORLD_SIZE="2")) for r in range(2)])
    assert (world.launcher, world.master_addr, world.job) == ("mpich", "127.0.0.1", "mpich-proxy-vm:41231")
    assert detect(rank(0, WORLD_SIZE="2", PMI_PORT="vm:41232")).master_port != world.master_port


def _pals(rank: int, world: int, per_node: int, nodefile: str, **extra: str) -> dict[str, str]:
    """What HPE Cray PALS' mpiexec sets (pals.h: PMI_RANK, PMI_SIZE, PMI_LOCAL_RANK, PMI_LOCAL_SIZE,
    PALS_RANKID, PALS_LOCAL_RANKID, PALS_NODEID, PALS_APID, PALS_DEPTH, PALS_SPOOL_DIR, PALS_APINFO,
    PMI_CONTROL_PORT, PMI_SHARED_SECRET) on PBS (PBS_JOBID, PBS_NODEFILE), as on Polaris."""
    return {"PMI_RANK": str(rank), "PMI_SIZE": str(world), "PMI_LOCAL_RANK": str(rank % per_node),
            "PMI_LOCAL_SIZE": str(per_node), "PALS_RANKID": str(rank), "PALS_LOCAL_RANKID": str(rank % per_node),
            "PALS_NODEID": str(rank // per_node), "PALS_APID": "6f1c4b2a-7d3e-4b3e-9a45-0f1e2d3c4b5a",
            "PALS_DEPTH": "8", "PALS_SPOOL_DIR": "/var/run/palsd/6f1c", "PALS_APINFO": "/var/run/palsd/6f1c/apinfo",
            "PMI_CONTROL_PORT": "6201,6202", "PMI_SHARED_SECRET": "1234567890", "PMI_UNIVERSE_SIZE": str(world),
            "PBS_JOBID": "123456.polaris-pbs-01", "PBS_NODEFILE": nodefile, "PBS_O_WORKDIR": "/home/u",
            "PBS_ENVIRONMENT": "PBS_BATCH", "CUDA_VISIBLE_DEVICES": str(3 - rank % per_node), **extra}


def test_pals_on_pbs(tmp_path: Any) -> None:
    nodefile = tmp_path / "nodes"
    nodefile.write_text("x3006c0s13b0n0.hsn.cm.polaris.alcf.anl.gov\nx3006c0s19b0n0.hsn.cm.polaris.alcf.anl.gov\n")
    envs = [detect(_pals(r, 8, 4, str(nodefile))) for r in range(8)]
    world = _one_world(envs)
    assert (world.launcher, world.master_addr) == ("pals", "x3006c0s13b0n0.hsn.cm.polaris.alcf.anl.gov")
    assert [(e.local_rank, e.local_size, e.node_rank) for e in envs] == [(r % 4, 4, r // 4) for r in range(8)]
    # the sites' wrappers export RANK, WORLD_SIZE, LOCAL_RANK and MASTER_* from them: they win, and agree
    wrapped = detect(_pals(5, 8, 4, str(nodefile), RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="h0",
                           MASTER_PORT="2345"))
    assert (wrapped.launcher, wrapped.rank, wrapped.master_addr, wrapped.master_port) == ("pals", 5, "h0", 2345)


def test_pals_helpers_without_a_communicator_are_refused(no_launcher: None, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Any) -> None:
    """They raised 'MPI_LOCALNRANKS is not set', even in get_rank()."""
    for name, value in _pals(1, 2, 2, str(tmp_path / "none")).items():
        monkeypatch.setenv(name, value)
    with pytest.raises(distcomm.CommunicatorStateError, match=r"pals started this process as rank 1 of 2"):
        distcomm.get_rank()


def _jsrun(rank: int, world: int, per_node: int, **extra: str) -> dict[str, str]:
    """What LSF's jsrun sets (JSM_NAMESPACE_RANK / _SIZE / _LOCAL_RANK, read as Lightning's
    LSFEnvironment reads them) in an LSF job (LSB_JOBID, LSB_MCPU_HOSTS: the launch node first)."""
    return {"JSM_NAMESPACE_RANK": str(rank), "JSM_NAMESPACE_SIZE": str(world),
            "JSM_NAMESPACE_LOCAL_RANK": str(rank % per_node), "LSB_JOBID": "1418771", "LSB_JOBNAME": "train",
            "LSB_MCPU_HOSTS": "batch3 1 a01n05 42 a01n06 42", "LSB_HOSTS": "batch3 " + "a01n05 " * 42,
            "LSB_QUEUE": "batch", "LS_JOBPID": "9876", "OMP_NUM_THREADS": "7", "CUDA_VISIBLE_DEVICES": "0", **extra}


def test_lsf_jsrun(tmp_path: Any) -> None:
    world = _one_world([detect(_jsrun(r, 12, 6)) for r in range(12)])
    assert (world.launcher, world.master_addr) == ("lsf", "a01n05")  # the launch node batch3 runs no task
    assert 20000 <= (world.master_port or 0) < 30000
    assert detect(_jsrun(0, 12, 6, LSB_JOBID="1418772")).master_port != world.master_port
    rankfile = tmp_path / "rankfile"  # one line per slot, the launch node first
    rankfile.write_text("batch3\n" + "a01n07\n" * 42 + "a01n08\n" * 42)
    assert detect(_jsrun(7, 12, 6, LSB_DJOB_RANKFILE=str(rankfile))).master_addr == "a01n07"


def _pytorchjob(pod: int, **extra: str) -> dict[str, str]:
    """What Kubeflow's training operator (v1.7+, envvar.go setPodEnv) sets in pod ``pod`` of a
    PyTorchJob of 4 pods with nprocPerNode 2: WORLD_SIZE counts processes, RANK is the pod's index."""
    return {"MASTER_ADDR": "job-master-0", "PET_MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456",
            "PET_MASTER_PORT": "23456", "WORLD_SIZE": "8", "RANK": str(pod), "PET_NODE_RANK": str(pod),
            "PET_NNODES": "4", "PET_NPROC_PER_NODE": "2", "PYTHONUNBUFFERED": "0",
            "KUBERNETES_SERVICE_HOST": "10.96.0.1", **extra}


def test_kubeflow_several_processes_per_pod_without_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """One process per pod: machine ``pod`` of 4, never 'rank 1 of 8' (only 4 processes run)."""
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")  # a pod's host name resolves to its address
    pods = [detect(_pytorchjob(p)) for p in range(4)]
    world = _one_world(pods)
    assert [(e.launcher, e.rank, e.local_size, e.node_rank, e.num_nodes) for e in pods] == [
        ("kubeflow", p, 1, p, 4) for p in range(4)]
    assert (world.master_addr, world.master_port) == ("job-master-0", 23456)
    # launch(main, 2) in each pod starts the 2 processes the job asked for, 8 in all
    assert distcomm._launching.from_env.machines_under(pods[1], 2, 1, 0, None) == (4, 1, "tcp://job-master-0:23456")
    # the pod's processes started by hand, each with its LOCAL_RANK
    procs = [detect(_pytorchjob(p, LOCAL_RANK=str(lr))) for p in range(4) for lr in range(2)]
    assert [(e.rank, e.local_rank, e.local_size, e.node_rank) for e in _one_world(procs) and procs] == [
        (2 * p + lr, lr, 2, p) for p in range(4) for lr in range(2)]


def test_processes_a_program_starts_inside_a_one_task_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """mp.spawn (or DeepSpeed's launcher) under `srun -n1` or `srun --pty bash` sets each child's RANK,
    WORLD_SIZE, MASTER_*: they describe the child, as torchrun's do inside an srun task."""
    step = _srun(0, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1",
                 SLURM_STEP_NODELIST="gpu01", SLURM_NODEID="0", SLURM_CPU_BIND="quiet,mask_cpu:0xFFFF",
                 SLURM_PTY_PORT="40121", PMIX_RANK="0")
    children = [detect({**step, "RANK": str(r), "WORLD_SIZE": "4", "LOCAL_RANK": str(r), "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500"}) for r in range(4)]
    world = _one_world(children)
    assert (world.launcher, world.master_addr, world.master_port) == ("env", "127.0.0.1", 29500)
    # in a task of several, RANK must still agree with the step's
    with pytest.raises(ValueError, match="WORLD_SIZE=4 contradicts slurm's 8"):
        detect(_srun(1, RANK="1", WORLD_SIZE="4"))


def test_a_world_of_one_binds_no_port_derived_from_the_job() -> None:
    """Array jobs packed onto one node, each `srun -n1`: a derived port would collide for nothing."""
    one = detect(_srun(0, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1",
                       SLURM_STEP_NODELIST="gpu01", SLURM_NODEID="0", SLURM_ARRAY_JOB_ID="4242",
                       SLURM_ARRAY_TASK_ID="3"))
    assert (one.launcher, one.world_size, one.master_port, one.address_problem) == ("slurm", 1, None, "")
    assert detect(_ompi(0, 1, 1)).master_port is None
    assert detect(_srun(0, SLURM_NTASKS="1", SLURM_STEP_NUM_TASKS="1", SLURM_STEP_TASKS_PER_NODE="1",
                        SLURM_NODEID="0", MASTER_PORT="29511")).master_port == 29511  # one asked for


_RANK = """
import json, sys, types
package = types.ModuleType("distcomm")  # the launcher module alone: no torch to import in every rank
package.__path__ = [sys.argv[1]]
sys.modules["distcomm"] = package
from distcomm._launching.launchers import detect
e = detect()
with open(sys.argv[2], "w") as out:
    json.dump([e.launcher, e.rank, e.world_size, e.master_addr, e.master_port, e.job, e.address_problem], out)
"""


def _hydra_node(tmp_path: Any, node: int, per_node: int, world: int, **extra: str) -> subprocess.Popen[str]:
    """A stand-in for one machine's hydra_pmi_proxy: it starts its ranks as Hydra does (the variables
    of pmip_cb.c), each through a wrapper script (`mpiexec -n 2 ./wrap.sh`), so each rank's parent differs."""
    # Each node writes its scripts in its own folder: rewriting one another's while a rank's shell
    # reads it gave that shell an empty script (a rank that silently never ran).
    scripts = tmp_path / f"node{node}"
    scripts.mkdir(exist_ok=True)
    (scripts / "wrap.sh").write_text('#!/bin/sh\n"$@"\n')
    (scripts / "rank.py").write_text(_RANK)
    lines = ["#!/bin/sh"]
    for local in range(per_node):
        env = _hydra(node * per_node + local, world, per_node, **extra)
        assigned = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        lines.append(f"env {assigned} sh {scripts / 'wrap.sh'} {sys.executable} {scripts / 'rank.py'} "
                     f"{Path(distcomm.__file__).parent} {tmp_path / f'said{node}-{local}.json'} &")
    lines.append("wait")
    proxy = scripts / "hydra_pmi_proxy"
    proxy.write_text("\n".join(lines) + "\n")
    proxy.chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIXES) and k not in _NAMES}
    return subprocess.Popen([str(proxy)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=clean)


def _ranks_of(*nodes: subprocess.Popen[str]) -> list[LaunchEnv]:
    printed = [node.communicate(timeout=60)[0] for node in nodes]
    where = Path(nodes[0].args[0]).parent.parent  # each rank wrote what it found there
    files = [where / f"said{i}-{local}.json" for i in range(len(nodes)) for local in range(2)]
    assert all(f.exists() for f in files), printed
    said = [json.loads(f.read_text()) for f in files]
    return [LaunchEnv(s[0], s[1], s[2], 0, None, None, None, s[3], s[4], 0, s[6], s[5]) for s in said]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process tree from /proc")
def test_hydra_ranks_through_wrapper_scripts_form_one_world(tmp_path: Any) -> None:
    """Each rank's parent is its wrapper shell: the job is named from the proxy they share."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    launches = [_hydra_node(tmp_path / "a", 0, 2, 2), _hydra_node(tmp_path / "b", 0, 2, 2)]  # at once
    one, other = (_one_world(_ranks_of(launch)) for launch in launches)
    assert (one.launcher, one.master_addr) == ("mpich", "127.0.0.1") and one.job.startswith("mpich-proxy-")
    assert (other.job, other.master_port) != (one.job, one.master_port)  # another launch
    # Intel MPI across two machines (two proxies) with the address and port every rank was given
    given = {"MASTER_ADDR": "n1", "MASTER_PORT": "29400"}
    across = _one_world(_ranks_of(_hydra_node(tmp_path, 0, 2, 4, **given), _hydra_node(tmp_path, 1, 2, 4, **given)))
    assert (across.master_addr, across.master_port, across.job) == ("n1", 29400, "mpich-n1:29400")
    # without the port: refused at once on every rank, naming what to set
    refused = _ranks_of(_hydra_node(tmp_path, 0, 2, 4, MASTER_ADDR="n1"))
    assert all(r.master_port is None and "set MASTER_ADDR and MASTER_PORT" in r.address_problem for r in refused)


_GATHER = """
import distcomm
with distcomm.from_env(timeout=60) as comm, distcomm.use(comm):
    print("GATHERED", distcomm.all_gather(comm.rank), flush=True)
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(_PREFIXES) and k not in _NAMES}
    return {**env, "PYTHONPATH": os.pathsep.join(sys.path), **extra}


def test_ipv6_loopback_is_this_machine(tmp_path: Any) -> None:
    """MASTER_ADDR=::1 was refused as 'across machines' (the loopback test knew IPv4 names only)."""
    script = tmp_path / "gather.py"
    script.write_text(_GATHER)
    port = str(distcomm.free_port())
    ranks = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=_clean_env(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="::1",
                                                        MASTER_PORT=port)) for r in range(2)]
    try:
        outs = [rank.communicate(timeout=120)[0] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    assert all("GATHERED [0, 1]" in out for out in outs), outs
    assert (distcomm._launching.start.url_host("::1"), distcomm._launching.start.url_host("n1")) == ("[::1]", "n1")


def _helpers_in_a_process_given_its_own_rank(queue: Any) -> None:
    """A worker as elastic_launch's and mp.spawn's: multiprocessing starts it, then its rank is set."""
    os.environ.update({"TORCHELASTIC_RUN_ID": "fn", "RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"})
    try:
        queue.put(f"world of {distcomm.get_world_size()}")
    except distcomm.CommunicatorStateError as e:
        queue.put(str(e))


def test_a_process_given_its_own_rank_is_no_data_loader_worker(no_launcher: None) -> None:
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    worker = context.Process(target=_helpers_in_a_process_given_its_own_rank, args=(queue,))
    worker.start()
    try:
        assert "torchrun started this process as rank 1 of 2" in queue.get(timeout=60)
    finally:
        worker.join(30)
        worker.kill()


_ELASTIC = """
import json, multiprocessing, sys
import distcomm
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

def loader_worker(queue):
    queue.put(distcomm.get_world_size())

def train():
    try:
        said = f"world of {distcomm.get_world_size()}"
    except distcomm.CommunicatorStateError as e:
        said = str(e)
    queue = multiprocessing.get_context("fork").Queue()  # a data loader's worker of this rank
    worker = multiprocessing.get_context("fork").Process(target=loader_worker, args=(queue,))
    worker.start()
    loader = queue.get(timeout=60)
    worker.join()
    return said, loader

if __name__ == "__main__":
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id="fn", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{sys.argv[1]}", max_restarts=0, monitor_interval=0.2)
    print("RESULT " + json.dumps(elastic_launch(config, train)()), flush=True)
"""


@pytest.mark.slow
def test_elastic_launch_workers_are_ranks(tmp_path: Any) -> None:
    """torchrun's Python API (accelerate's notebook_launcher): each worker is a rank, refused a silent
    world of one; a data loader's worker of one stays a world of one."""
    script = tmp_path / "elastic.py"
    script.write_text(_ELASTIC)
    out = subprocess.run([sys.executable, str(script), str(distcomm.free_port())], env=_clean_env(),
                         capture_output=True, text=True, timeout=240, cwd=tmp_path)
    results = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    assert results, (out.stdout + out.stderr)[-3000:]
    said = json.loads(results[0][len("RESULT "):])
    assert said and all(f"torchrun started this process as rank {rank} of 2" in text and loader == 1
                        for rank, (text, loader) in said.items()), said
