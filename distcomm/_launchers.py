"""Who started this process? One answer, read from the environment once per question.

``detect()`` reads the variables a launcher sets (torchrun and torchelastic, Slurm's srun, Open
MPI's mpirun, MPICH / Intel MPI's Hydra, MVAPICH) and returns a plain ``LaunchEnv``: rank, world,
local rank and size, node index and count, the rendezvous address, which launcher. ``from_env``,
``launch`` and ``current`` consume it; none of them reads a launcher's variables of its own.

Precedence, first match wins: torchrun (its workers may run inside an srun or mpirun task, whose
variables then describe the torchrun agent, not the worker), then the MPI flavours (MPI ranks
inherit the Slurm variables of the task or step mpirun runs in: an sbatch script's SLURM_PROCID=0,
or the one-task step Open MPI starts its daemons with), then srun. Explicit RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT win over what a launcher implies; a rank or world size that contradicts
the launcher's is refused. A Slurm batch script (no srun step) and plain ``python`` are a world of one.
"""

from __future__ import annotations

import dataclasses
import os
import re
import zlib
from collections.abc import Mapping

from ._hostlist import expand_hostlist

__all__ = ["LaunchEnv", "detect"]

_PORTS = (20000, 30000)
"""The range a rendezvous port derived from a job id falls in: above most services' ports and
below Linux's ephemeral range (32768-60999), so the kernel doesn't hand it to an outgoing connection."""


_WORLD_VARIABLES = ("WORLD_SIZE", "RANK", "SLURM_STEP_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
"""One of these is set wherever a launcher started the process: without any, detection is one look."""
_WORLD_KEYS = frozenset(name.encode() for name in _WORLD_VARIABLES)


def _launched(env: Mapping[str, str]) -> bool:
    """Whether any launcher's world variable is set. On POSIX, os.environ keeps its keys encoded:
    one set operation on them, instead of encoding six names (7 µs on every helper call without a
    communicator, where a launcher started nothing)."""
    data = getattr(env, "_data", None) if env is os.environ and os.name == "posix" else None
    if isinstance(data, dict):
        return not _WORLD_KEYS.isdisjoint(data.keys())
    return any(name in env for name in _WORLD_VARIABLES)


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What the launcher that started this process says about it.

    ``launcher`` is "torchrun", "slurm", "openmpi", "mpich", "mvapich", "env" (RANK and
    WORLD_SIZE set by hand or by a job controller) or "python" (no launcher: a world of one).
    ``local_size``, ``node_rank`` and ``num_nodes`` are None where the launcher doesn't say (MPI
    names no node; RANK / LOCAL_RANK without a local size). ``master_addr`` / ``master_port`` are
    None where the launcher can't name them; ``address_problem`` then says what to set (a world of
    one takes any free port). ``job`` names the job alike on every rank (the rendezvous' keys live
    under it); ``launcher_store``: the launcher itself hosts the store at the address (torchrun's
    agent); ``even``: every node runs the same number of processes, as far as the launcher says.
    """

    launcher: str
    rank: int
    world_size: int
    local_rank: int
    local_size: int | None
    node_rank: int | None
    num_nodes: int | None
    master_addr: str | None
    master_port: int | None
    restart: int = 0
    address_problem: str = ""
    job: str = ""
    launcher_store: bool = False
    even: bool = True

    @property
    def started_by_launcher(self) -> bool:
        return self.launcher != "python"

    def describe(self) -> str:
        """e.g. ``rank 3 of 8, local 1 of 2 on node 1 of 4``."""
        local = f", local {self.local_rank} of {self.local_size}" if self.local_size is not None else ""
        node = f" on node {self.node_rank} of {self.num_nodes}" if self.node_rank is not None else ""
        return f"rank {self.rank} of {self.world_size}{local}{node}"


_PYTHON = LaunchEnv("python", 0, 1, 0, 1, 0, 1, "127.0.0.1", None)


def detect(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launch environment of this process (``environ``: os.environ by default).

    Raises:
        ValueError: the variables contradict each other or don't parse (a rank out of range, two
            world sizes, a node list that isn't Slurm's grammar), naming the variables.
    """
    env = os.environ if environ is None else environ
    if not _launched(env):
        return _PYTHON
    found = _torchrun(env)
    if found is not None:
        return _checked(found)
    mpi = [f for f in (read(env) for read in (_openmpi, _hydra, _mvapich)) if f is not None]
    for other in mpi[1:]:  # two MPI runtimes' variables in one process: two jobs, not one
        if (other.rank, other.world_size) != (mpi[0].rank, mpi[0].world_size):
            raise ValueError(f"two launchers' variables disagree: {mpi[0].launcher} says {mpi[0].describe()}, but "
                             f"{other.launcher} says {other.describe()}; start the processes with one launcher")
    found = mpi[0] if mpi else _slurm(env)
    if found is not None:
        return _checked(_with_explicit(found, env))
    if "RANK" in env or "WORLD_SIZE" in env:
        return _checked(_explicit(env))
    return _PYTHON


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
    restart = _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
    # the agent hosts the store unless its rendezvous doesn't share it (etcd, custom handlers)
    return LaunchEnv("torchrun", _int(env, "RANK"), world, _int(env, "LOCAL_RANK"),
                     _int(env, "LOCAL_WORLD_SIZE", world), _int(env, "GROUP_RANK", 0),
                     _int(env, "GROUP_WORLD_SIZE", 1), env.get("MASTER_ADDR"),
                     _int(env, "MASTER_PORT"), restart,
                     "" if "MASTER_ADDR" in env else "torchrun set no MASTER_ADDR",
                     f"torchrun-{env['TORCHELASTIC_RUN_ID']}-attempt-{restart}",
                     env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def _mpi(env: Mapping[str, str], launcher: str, names: tuple[str, str, str, str], job: str | None,
         hint: str) -> LaunchEnv | None:
    """An MPI runtime's ranks; ``job``: its job id, None where it names none (then only ranks on
    one machine can derive a port alike, from their shared parent)."""
    rank_var, size_var, local_var, local_size_var = names
    if rank_var not in env or size_var not in env:
        return None
    world, rank, local_size = _int(env, size_var), _int(env, rank_var), _int(env, local_size_var)
    # MPI names no node; it is known only where every rank is on one machine, or each on its own
    node, nodes = (0, 1) if local_size == world else (None, None)
    addr, problem = _local_machine(local_size, world, launcher, hint)
    port: int | None = _port(f"{launcher}:{job}")
    if job is None:
        job = f"parent-{os.getppid()}"
        port = _port(f"{launcher}:{job}")
        if local_size != world:  # each machine's parent differs: no port every rank derives alike
            addr, port, problem = None, None, (f"{launcher} started {world} processes across machines and names no "
                                               f"rendezvous: set MASTER_ADDR and MASTER_PORT for every rank ({hint})")
    return LaunchEnv(launcher, rank, world, _int(env, local_var), local_size, node, nodes, addr, port, 0, problem,
                     f"{launcher}-{job}")


def _openmpi(env: Mapping[str, str]) -> LaunchEnv | None:
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
    found = _mpi(env, "openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                  "OMPI_COMM_WORLD_LOCAL_SIZE"), job, "mpirun -x MASTER_ADDR=<host>")
    if found is not None and _int(env, "OMPI_MCA_orte_num_nodes", 0) == found.world_size:  # one rank per node
        return dataclasses.replace(found, node_rank=found.rank, num_nodes=found.world_size)
    return found


def _hydra(env: Mapping[str, str]) -> LaunchEnv | None:
    if "MPI_LOCALRANKID" not in env and "SLURM_STEP_ID" in env:
        return None  # srun's PMI plugin: srun's own variables say more
    return _mpi(env, "mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
                env.get("PMI_JOBID") or env.get("PMI_KVSNAME"), "mpiexec -genv MASTER_ADDR <host>")


def _mvapich(env: Mapping[str, str]) -> LaunchEnv | None:
    names = ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE")
    return _mpi(env, "mvapich", names, env.get("MPIRUN_ID"), "mpirun_rsh ... MASTER_ADDR=<host>")


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
    job = f"{env.get('SLURM_JOB_ID', '')}.{env.get('SLURM_STEP_ID', '')}"
    return LaunchEnv("slurm", _int(env, "SLURM_PROCID"), world, _int(env, "SLURM_LOCALID", 0), per_node[node],
                     node, len(per_node), hosts[0] if hosts else None, _port(f"slurm:{job}"), 0,
                     "" if hosts else "srun set no node list (SLURM_STEP_NODELIST): set MASTER_ADDR",
                     f"slurm-{job}", even=len(set(per_node)) == 1)


def tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks per node, ``2(x3),1``, as one count per node: [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in text.split(","):
        m = _TASKS.match(part.strip())
        if m is None:  # '4(x2' too: a cut-off variable is no count to guess from
            raise ValueError(f"tasks per node {text!r} is not Slurm's form, e.g. '2(x3),1'")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?\Z")


def _explicit(env: Mapping[str, str]) -> LaunchEnv:
    """RANK and WORLD_SIZE with no launcher's own variables: a job controller or the user set them."""
    world, rank = _int(env, "WORLD_SIZE"), _int(env, "RANK")
    # a job controller's pods (Kubernetes' PyTorchJob) run one process each; a LOCAL_RANK without
    # a local size (DeepSpeed's launcher sets LOCAL_SIZE) leaves it unknown
    sizes = [_int(env, name) for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE") if name in env]
    local_size: int | None = sizes[0] if sizes else (None if "LOCAL_RANK" in env else 1)
    node: int | None
    nodes: int | None
    if "GROUP_RANK" in env:
        node, nodes = _int(env, "GROUP_RANK"), _int(env, "GROUP_WORLD_SIZE", -(-world // (local_size or 1)))
    else:
        node, nodes = (rank, world) if local_size == 1 else (None, None)
    addr, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT", 0) or None
    problem = "" if addr and port else "RANK and WORLD_SIZE are set: set MASTER_ADDR and MASTER_PORT too"
    return LaunchEnv("env", rank, world, _int(env, "LOCAL_RANK", 0), local_size, node, nodes, addr, port, 0,
                     problem, f"env-{addr}:{port}")


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
    if found.local_size is not None:
        if not 0 <= found.local_rank < found.local_size:
            problems.append(f"local rank {found.local_rank} out of range for local size {found.local_size}")
        if found.local_size > found.world_size:
            problems.append(f"local size {found.local_size} larger than the world size {found.world_size}")
    if found.node_rank is not None and found.num_nodes is not None and not 0 <= found.node_rank < found.num_nodes:
        problems.append(f"node {found.node_rank} out of range for {found.num_nodes} nodes")
    if found.master_port is not None and not 0 < found.master_port < 65536:
        problems.append(f"port {found.master_port} out of range")
    if problems:
        raise ValueError(f"the {found.launcher} variables of this process don't add up: {'; '.join(problems)}")
    return found
