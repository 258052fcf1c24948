"""Who started this process? One answer, read from the environment once per question.

``detect()`` reads the variables a launcher sets (torchrun and torchelastic, Slurm's srun, Open
MPI's mpirun, MPICH / Intel MPI's Hydra, MVAPICH) and returns a plain ``LaunchEnv``: rank, world,
local rank and size, node index and count, the rendezvous address, which launcher. ``from_env``,
``launch`` and ``current`` consume it; none of them reads a launcher's variables of its own.

Precedence, first match wins: torchrun (its workers may run inside an srun or mpirun task, whose
variables then describe the torchrun agent, not the worker), then the MPI flavours (an mpirun
inside an sbatch script inherits the batch script's SLURM_PROCID=0 on every rank), then srun.
Explicit RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT win over what a launcher implies; a rank or
world size that contradicts the launcher's is refused. A Slurm batch script (no srun step) and
plain ``python`` are a world of one.
"""

from __future__ import annotations

import dataclasses
import os
import zlib
from collections.abc import Mapping

from ._hostlist import expand_hostlist

__all__ = ["LaunchEnv", "detect"]

_PORTS = (20000, 30000)
"""The range a rendezvous port derived from a job id falls in: above most services' ports and
below Linux's ephemeral range (32768-60999), so the kernel doesn't hand it to an outgoing connection."""


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What the launcher that started this process says about it.

    ``launcher`` is "torchrun", "slurm", "openmpi", "mpich", "mvapich", "env" (RANK and
    WORLD_SIZE set by hand or by a job controller) or "python" (no launcher: a world of one).
    ``master_addr`` is None where the launcher can't name a rendezvous host; ``address_problem``
    then says what to set. ``master_port`` is None where any free port will do (a world of one).
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    node_rank: int
    num_nodes: int
    master_addr: str | None
    master_port: int | None
    restart: int = 0
    address_problem: str = ""

    @property
    def started_by_launcher(self) -> bool:
        return self.launcher != "python"

    @property
    def knows_nodes(self) -> bool:
        """Whether ``node_rank`` is the launcher's own (MPI names no node: there it is a guess)."""
        return self.launcher in ("torchrun", "slurm")

    def describe(self) -> str:
        """e.g. ``rank 3 of 8, local 1 of 2 on node 1 of 4``."""
        return (f"rank {self.rank} of {self.world_size}, local {self.local_rank} of {self.local_size} "
                f"on node {self.node_rank} of {self.num_nodes}")


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launch environment of this process (``environ``: os.environ by default).

    Raises:
        ValueError: the variables contradict each other or don't parse (a rank out of range, two
            world sizes, a node list that isn't Slurm's grammar), naming the variables.
    """
    env = os.environ if environ is None else environ
    found = _torchrun(env)
    if found is not None:
        return _checked(found)
    launchers = [f for f in (read(env) for read in (_openmpi, _hydra, _mvapich, _slurm)) if f is not None]
    first = launchers[0] if launchers else None
    for other in launchers[1:]:  # e.g. mpirun inside an srun task: two jobs, not one
        if first is not None and (other.rank, other.world_size) != (first.rank, first.world_size):
            raise ValueError(f"two launchers' variables disagree: {first.launcher} says {first.describe()}, but "
                             f"{other.launcher} says {other.describe()}; start the processes with one launcher")
    if launchers:
        return _checked(_with_explicit(launchers[0], env))
    if "RANK" in env or "WORLD_SIZE" in env:
        return _checked(_explicit(env))
    return LaunchEnv("python", 0, 1, 0, 1, 0, 1, "127.0.0.1", None)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    value = env.get(name)
    if value is None:
        if default is None:
            raise ValueError(f"{name} is not set, and the launcher's other variables need it")
        return default
    try:
        return int(value.strip())
    except ValueError:
        raise ValueError(f"{name}={value!r} is not an integer") from None


def _port(text: str) -> int:
    """A port every rank of a job derives alike from its id, in ``_PORTS``."""
    low, high = _PORTS
    return low + zlib.crc32(text.encode()) % (high - low)


def _local_machine(local_size: int, world: int, launcher: str, hint: str) -> tuple[str | None, str]:
    """Loopback where every rank runs on this machine; else no address, and what to set."""
    if local_size == world:
        return "127.0.0.1", ""
    return None, (f"{launcher} started {world} processes across machines and names no rendezvous host: "
                  f"set MASTER_ADDR to the first machine's address for every rank ({hint})")


def _torchrun(env: Mapping[str, str]) -> LaunchEnv | None:
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    world = _int(env, "WORLD_SIZE")
    return LaunchEnv("torchrun", _int(env, "RANK"), world, _int(env, "LOCAL_RANK"),
                     _int(env, "LOCAL_WORLD_SIZE", world), _int(env, "GROUP_RANK", 0),
                     _int(env, "GROUP_WORLD_SIZE", 1), env.get("MASTER_ADDR"),
                     _int(env, "MASTER_PORT"), _int(env, "TORCHELASTIC_RESTART_COUNT", 0),
                     "" if "MASTER_ADDR" in env else "torchrun set no MASTER_ADDR")


def _mpi(env: Mapping[str, str], launcher: str, prefix: tuple[str, str, str, str], job: str,
         hint: str) -> LaunchEnv | None:
    rank_var, size_var, local_var, local_size_var = prefix
    if rank_var not in env or size_var not in env:
        return None
    world, local_size = _int(env, size_var), _int(env, local_size_var)
    rank = _int(env, rank_var)
    nodes = max(1, -(-world // local_size)) if local_size > 0 else 1
    addr, problem = _local_machine(local_size, world, launcher, hint)
    return LaunchEnv(launcher, rank, world, _int(env, local_var), local_size,
                     rank // local_size if local_size > 0 else 0, nodes, addr,
                     _port(f"{launcher}:{job}"), 0, problem)


def _openmpi(env: Mapping[str, str]) -> LaunchEnv | None:
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or str(os.getppid())
    found = _mpi(env, "openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                  "OMPI_COMM_WORLD_LOCAL_SIZE"), job, "mpirun -x MASTER_ADDR=<host>")
    if found is not None and "OMPI_MCA_orte_num_nodes" in env:
        return dataclasses.replace(found, num_nodes=_int(env, "OMPI_MCA_orte_num_nodes"))
    return found


def _hydra(env: Mapping[str, str]) -> LaunchEnv | None:
    if "MPI_LOCALRANKID" not in env and "SLURM_STEP_ID" in env:
        return None  # srun's PMI plugin: srun's own variables say more
    # Hydra (MPICH, Intel MPI) names no job id; its ranks on one machine share their proxy, the parent
    job = env.get("PMI_JOBID") or env.get("PMI_KVSNAME") or str(os.getppid())
    return _mpi(env, "mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), job,
                "mpiexec -genv MASTER_ADDR <host>")


def _mvapich(env: Mapping[str, str]) -> LaunchEnv | None:
    job = env.get("MPIRUN_ID") or str(os.getppid())
    return _mpi(env, "mvapich", ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK",
                                 "MV2_COMM_WORLD_LOCAL_SIZE"), job, "mpirun_rsh ... MASTER_ADDR=<host>")


def _slurm(env: Mapping[str, str]) -> LaunchEnv | None:
    # Only srun's tasks: a batch script also has SLURM_PROCID=0 and SLURM_NTASKS, but runs once.
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    world = _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1))
    node = _int(env, "SLURM_NODEID", 0)
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE") or str(world))
    if node >= len(per_node):
        raise ValueError(f"SLURM_NODEID={node} is out of range for the {len(per_node)} nodes of "
                         f"SLURM_STEP_TASKS_PER_NODE={env.get('SLURM_STEP_TASKS_PER_NODE')!r}")
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    hosts = expand_hostlist(nodelist) if nodelist else []
    return LaunchEnv("slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0), per_node[node],
                     node, len(per_node), hosts[0] if hosts else None,
                     _port(f"slurm:{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"), 0,
                     "" if hosts else "srun set no node list (SLURM_STEP_NODELIST): set MASTER_ADDR")


def tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks per node, ``2(x3),1``, as one count per node: [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        count, _, times = part.partition("(x")
        try:
            n, k = int(count), int(times.rstrip(")")) if times else 1
        except ValueError:
            raise ValueError(f"tasks per node {text!r} is not Slurm's form, e.g. '2(x3),1'") from None
        counts.extend([n] * k)
    return counts


def _explicit(env: Mapping[str, str]) -> LaunchEnv:
    """RANK and WORLD_SIZE with no launcher's own variables: a job controller or the user set them."""
    # One process per machine unless told otherwise: a job controller's pods (Kubernetes' PyTorchJob)
    world, rank = _int(env, "WORLD_SIZE"), _int(env, "RANK")
    local_size = max(_int(env, "LOCAL_WORLD_SIZE", 1), 1)
    addr = env.get("MASTER_ADDR")
    nodes = _int(env, "GROUP_WORLD_SIZE", -(-world // local_size))
    return LaunchEnv("env", rank, world, _int(env, "LOCAL_RANK", 0), local_size,
                     _int(env, "GROUP_RANK", rank // local_size), nodes, addr, _int(env, "MASTER_PORT", 0) or None, 0,
                     "" if addr else "RANK and WORLD_SIZE are set, MASTER_ADDR is not: set MASTER_ADDR and MASTER_PORT")


def _with_explicit(found: LaunchEnv, env: Mapping[str, str]) -> LaunchEnv:
    """MASTER_ADDR / MASTER_PORT win over the launcher's; RANK / WORLD_SIZE must agree with it."""
    if found.launcher != "torchrun":  # torchrun's own RANK/WORLD_SIZE are what it read
        for name, mine in (("WORLD_SIZE", found.world_size), ("RANK", found.rank)):
            if name in env and _int(env, name) != mine:
                raise ValueError(f"{name}={env[name]} contradicts {found.launcher}'s {mine} "
                                 f"({found.describe()}); unset {name} or make them agree")
    if "MASTER_ADDR" in env:
        found = dataclasses.replace(found, master_addr=env["MASTER_ADDR"], address_problem="")
    if "MASTER_PORT" in env:
        found = dataclasses.replace(found, master_port=_int(env, "MASTER_PORT"))
    return found


def _checked(found: LaunchEnv) -> LaunchEnv:
    problems = []
    if found.world_size < 1:
        problems.append(f"a world size of {found.world_size}")
    if not 0 <= found.rank < found.world_size:
        problems.append(f"rank {found.rank} out of range for world size {found.world_size}")
    if not 0 <= found.local_rank < found.local_size:
        problems.append(f"local rank {found.local_rank} out of range for local size {found.local_size}")
    if found.local_size > found.world_size:
        problems.append(f"local size {found.local_size} larger than the world size {found.world_size}")
    if not 0 <= found.node_rank < found.num_nodes:
        problems.append(f"node {found.node_rank} out of range for {found.num_nodes} nodes")
    if found.master_port is not None and not 0 < found.master_port < 65536:
        problems.append(f"port {found.master_port} out of range")
    if problems:
        raise ValueError(f"the {found.launcher} variables of this process don't add up: {'; '.join(problems)}")
    return found
