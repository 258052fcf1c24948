"""Who started this process? One answer, read from the environment once per question.

``detect()`` reads the variables a launcher sets (torchrun and torchelastic, Slurm's srun, Open
MPI's mpirun, MPICH / Intel MPI's Hydra, MVAPICH, HPE Cray PALS, LSF's jsrun, Kubeflow's training
operator) and returns a plain ``LaunchEnv``: rank, world,
local rank and size, node index and count, the rendezvous address, which launcher. ``from_env``,
``launch`` and ``current`` consume it; none of them reads a launcher's variables of its own.

Precedence, first match wins: torchrun (its workers may run inside an srun or mpirun task, whose
variables then describe the torchrun agent, not the worker), then the MPI flavours (MPI ranks
inherit the Slurm variables of the task or step mpirun runs in: an sbatch script's SLURM_PROCID=0,
or the one-task step Open MPI starts its daemons with), then srun. Explicit RANK / WORLD_SIZE /
MASTER_ADDR / MASTER_PORT win over what a launcher implies; a rank or world size that contradicts
the launcher's is refused, but in a world of one (srun -n1) they describe processes the program
started itself. A Slurm batch script (no srun step) and plain ``python`` are a world of one.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import re
import zlib
from collections.abc import Mapping

from .hostlist import expand_hostlist

__all__ = ["LaunchEnv", "detect", "inherited"]

_PORTS = (20000, 30000)
"""The range a rendezvous port derived from a job id falls in: above most services' ports and
below Linux's ephemeral range (32768-60999), so the kernel doesn't hand it to an outgoing connection."""


_WORLD_VARIABLES = ("WORLD_SIZE", "RANK", "SLURM_STEP_ID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMI_ID",
                    "MV2_COMM_WORLD_SIZE", "PALS_RANKID", "JSM_NAMESPACE_SIZE")
"""One of these is set wherever a launcher started the process (PMI_ID: Hydra's -pmi-port mode, which
sets no PMI_SIZE): without any, detection is one look."""
_WORLD_KEYS = frozenset(name.encode() for name in _WORLD_VARIABLES)


def _launched(env: Mapping[str, str]) -> bool:
    """Whether any launcher's world variable is set. On POSIX, os.environ keeps its keys encoded:
    one set operation on them, instead of encoding nine names (7 µs on every helper call without a
    communicator, where a launcher started nothing)."""
    data = getattr(env, "_data", None) if env is os.environ and os.name == "posix" else None
    if isinstance(data, dict):
        return not _WORLD_KEYS.isdisjoint(data.keys())
    return any(name in env for name in _WORLD_VARIABLES)


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """What the launcher that started this process says about it.

    ``launcher`` is "torchrun", "distcomm run", "slurm", "openmpi", "mpich", "mvapich", "pals", "lsf", "kubeflow",
    "env" (RANK and WORLD_SIZE set by hand or by a job controller) or "python" (no launcher: a world of one).
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
        nodes = f" of {self.num_nodes}" if self.num_nodes is not None else ""
        node = f" on node {self.node_rank}{nodes}" if self.node_rank is not None else ""
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
    mpi = [f for f in (read(env) for read in (_openmpi, _hydra, _mvapich, _pals, _lsf)) if f is not None]
    for other in mpi[1:]:  # two MPI runtimes' variables in one process: two jobs, not one
        if (other.rank, other.world_size) != (mpi[0].rank, mpi[0].world_size):
            raise ValueError(f"two launchers' variables disagree: {mpi[0].launcher} says {mpi[0].describe()}, but "
                             f"{other.launcher} says {other.describe()}; start the processes with one launcher")
    found = mpi[0] if mpi else _slurm(env)
    if found is not None and found.world_size == 1 and _int(env, "WORLD_SIZE", 1) != 1:
        # processes the program started itself inside one task (mp.spawn, DeepSpeed's launcher
        # under srun -n1 or srun --pty bash): the inner launcher's variables describe them
        return _checked(_explicit(env))
    if found is not None:
        return _checked(_with_explicit(_alone(found), env))
    if "RANK" in env or "WORLD_SIZE" in env:
        return _checked(_kubeflow(env) or _explicit(env))
    if _int(env, "PMI_SIZE", 1) > 1:
        raise ValueError(f"PMI_SIZE={env['PMI_SIZE']} says a launcher started {env['PMI_SIZE']} processes, but none "
                         f"distcomm reads (Hydra's MPI_LOCALNRANKS, PALS' PALS_RANKID, srun's SLURM_STEP_ID): "
                         f"set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for every rank")
    return _PYTHON


def _alone(found: LaunchEnv) -> LaunchEnv:
    """A world of one meets nobody: any free port on this machine, none derived from the job (array
    jobs packed onto one node would collide on it for nothing)."""
    if found.world_size != 1:
        return found
    return dataclasses.replace(found, master_addr=found.master_addr or "127.0.0.1", master_port=None,
                               address_problem="")


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


LAUNCHER_VAR, RUN_AGENT = "DISTCOMM_LAUNCHER", "distcomm run"  # what ``python -m distcomm run`` tells its workers
TORCHRUN_LIKE = frozenset({"torchrun", RUN_AGENT})  # launchers with torchrun's variables and agent store


def _torchrun(env: Mapping[str, str]) -> LaunchEnv | None:
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    world = _int(env, "WORLD_SIZE")
    restart = _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
    # the agent hosts the store unless its rendezvous doesn't share it (etcd, custom handlers)
    launcher = RUN_AGENT if env.get(LAUNCHER_VAR) == RUN_AGENT else "torchrun"  # (the same variables)
    return LaunchEnv(launcher, _int(env, "RANK"), world, _int(env, "LOCAL_RANK"),
                     _int(env, "LOCAL_WORLD_SIZE", world), _int(env, "GROUP_RANK", 0),
                     _int(env, "GROUP_WORLD_SIZE", 1), env.get("MASTER_ADDR"),
                     _int(env, "MASTER_PORT"), restart,
                     "" if "MASTER_ADDR" in env else "torchrun set no MASTER_ADDR",
                     f"torchrun-{env['TORCHELASTIC_RUN_ID']}",  # (no attempt: the store counts rounds)
                     env.get("TORCHELASTIC_USE_AGENT_STORE") == "True")


def _mpi(env: Mapping[str, str], launcher: str, names: tuple[str, str, str, str], job: str | None,
         hint: str) -> LaunchEnv | None:
    """An MPI runtime's ranks; ``job``: its job id, None where it names none (see ``_shared_job``)."""
    rank_var, size_var, local_var, local_size_var = names
    if rank_var not in env or size_var not in env:
        return None
    return _ranks(env, launcher, _int(env, rank_var), _int(env, size_var), _int(env, local_var),
                  _int(env, local_size_var), job, hint)


def _ranks(env: Mapping[str, str], launcher: str, rank: int, world: int, local_rank: int, local_size: int,
           job: str | None, hint: str) -> LaunchEnv:
    # MPI names no node; it is known only where every rank is on one machine
    node, nodes = (0, 1) if local_size == world else (None, None)
    addr, problem = _local_machine(local_size, world, launcher, hint)
    if job is None:
        job = _shared_job(env, local_size == world)
    if job is None:  # nothing every rank shares to derive a port from: no guess that splits the job
        where = "on this machine" if local_size == world else "across machines"
        return LaunchEnv(launcher, rank, world, local_rank, local_size, node, nodes, addr, None, 0,
                         f"{launcher} started {world} processes {where} and names no job they all share: set "
                         f"MASTER_ADDR and MASTER_PORT for every rank ({hint} -genv MASTER_PORT <port>)")
    return LaunchEnv(launcher, rank, world, local_rank, local_size, node, nodes, addr, _port(f"{launcher}:{job}"), 0,
                     problem, f"{launcher}-{job}")


def _shared_job(env: Mapping[str, str], one_machine: bool) -> str | None:
    """What every rank of one Hydra launch shares, and no other launch does, or None.

    Under Slurm, Hydra starts its proxies with one srun step of several tasks: its id is the job's
    everywhere. On one machine, the proxy (hydra_pmi_proxy) that started every rank here, even
    through a wrapper script per rank (each rank's own parent differs then). The proxy's port in
    -pmi-port mode (PMI_PORT) is this machine's proxy too."""
    if _srun_step(env) and _int(env, "SLURM_STEP_NUM_TASKS", _int(env, "SLURM_NTASKS", 1)) > 1:
        return f"slurm-step-{env.get('SLURM_JOB_ID', '')}.{env['SLURM_STEP_ID']}"
    if not one_machine:
        return None
    if "PMI_PORT" in env:
        return f"proxy-{env['PMI_PORT']}"
    proxy = _hydra_proxy()
    return None if proxy is None else f"proxy-{proxy}"


_PROXIES = (b"hydra_pmi_proxy", b"pmi_proxy")
"""The names of the process Hydra (MPICH, Intel MPI) starts a machine's ranks from."""


def _hydra_proxy() -> int | None:
    """The pid of the Hydra proxy this process descends from, read from /proc (None elsewhere)."""
    pid = os.getppid()
    for _ in range(16):  # a wrapper script or two between the proxy and the rank; never a loop
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            return None
        name_end = stat.rindex(b")")
        if stat[stat.index(b"(") + 1:name_end] in _PROXIES:
            return pid
        pid = int(stat[name_end + 2:].split()[1])
        if pid <= 1:
            return None
    return None


def _openmpi(env: Mapping[str, str]) -> LaunchEnv | None:
    job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
    found = _mpi(env, "openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                                  "OMPI_COMM_WORLD_LOCAL_SIZE"), job, "mpirun -x MASTER_ADDR=<host>")
    if found is not None and _int(env, "OMPI_MCA_orte_num_nodes", 0) == found.world_size:  # one rank per node
        return dataclasses.replace(found, node_rank=found.rank, num_nodes=found.world_size)
    return found


def _hydra(env: Mapping[str, str]) -> LaunchEnv | None:
    """MPICH's and Intel MPI's Hydra: MPI_LOCALNRANKS on every rank, with PMI_RANK and PMI_SIZE, or in
    -pmi-port mode PMI_ID and PMI_PORT alone (the size then comes over the PMI wire only)."""
    if "MPI_LOCALNRANKS" not in env:
        return None  # srun's PMI plugins, Cray's PALS: PMI_RANK without Hydra's own variables
    job = env.get("PMI_JOBID") or env.get("PMI_KVSNAME")
    hint = "mpiexec -genv MASTER_ADDR <host>"
    if "PMI_RANK" in env or "PMI_ID" not in env:
        return _mpi(env, "mpich", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"), job, hint)
    if "WORLD_SIZE" not in env:
        raise ValueError(f"Hydra's -pmi-port mode (PMI_ID={env['PMI_ID']}, PMI_PORT) names this rank but not how many "
                         f"ranks mpiexec started: run mpiexec without -pmi-port, or pass the count to every rank "
                         f"(mpiexec -genv WORLD_SIZE <n>)")
    return _ranks(env, "mpich", _int(env, "PMI_ID"), _int(env, "WORLD_SIZE"), _int(env, "MPI_LOCALRANKID"),
                  _int(env, "MPI_LOCALNRANKS"), job, hint)


def _mvapich(env: Mapping[str, str]) -> LaunchEnv | None:
    names = ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_SIZE")
    return _mpi(env, "mvapich", names, env.get("MPIRUN_ID"), "mpirun_rsh ... MASTER_ADDR=<host>")


def _pals(env: Mapping[str, str]) -> LaunchEnv | None:
    """HPE Cray PALS (mpiexec on PBS: Polaris, Aurora, Derecho): PMI_RANK / PMI_SIZE with PMI_LOCAL_*
    and PALS_*; PALS_APID names the launch, PBS_NODEFILE's first host runs rank 0 (mpiexec's default
    host file, unless --hostfile names another)."""
    if "PALS_RANKID" not in env and "PALS_APID" not in env:
        return None
    world = _int(env, "PMI_SIZE")
    rank, local_size, local_rank = (_int(env, pmi if pmi in env else pals) for pmi, pals in (
        ("PMI_RANK", "PALS_RANKID"), ("PMI_LOCAL_SIZE", "PALS_LOCAL_SIZE"), ("PMI_LOCAL_RANK", "PALS_LOCAL_RANKID")))
    node: int | None = _int(env, "PALS_NODEID", 0) if local_size != world else 0
    nodes = 1 if local_size == world else (world if local_size == 1 else None)
    addr, problem = _local_machine(local_size, world, "pals", "export MASTER_ADDR=$(head -1 $PBS_NODEFILE)")
    if addr is None and env.get("PBS_NODEFILE"):
        hosts = _lines(env["PBS_NODEFILE"])
        if hosts:
            addr, problem = hosts[0], ""
    job = env.get("PALS_APID") or env.get("PMI_JOBID") or ""
    return LaunchEnv("pals", rank, world, local_rank, local_size, node, nodes, addr,
                     _port(f"pals:{job}") if job else None, 0,
                     problem or ("" if job else "PALS set no PALS_APID: set MASTER_PORT"), f"pals-{job}" if job else "")


def _lsf(env: Mapping[str, str]) -> LaunchEnv | None:
    """LSF's jsrun (JSM): JSM_NAMESPACE_RANK / _SIZE / _LOCAL_RANK; the hosts from LSB_DJOB_RANKFILE
    (one line per slot) or LSB_MCPU_HOSTS (host and slot count pairs), whose first host is the launch
    node, which runs no task: rank 0 runs on the next (as Lightning's LSFEnvironment reads it)."""
    if "JSM_NAMESPACE_SIZE" not in env:
        return None
    world, rank = _int(env, "JSM_NAMESPACE_SIZE"), _int(env, "JSM_NAMESPACE_RANK")
    local_size: int | None = _int(env, "JSM_NAMESPACE_LOCAL_SIZE") if "JSM_NAMESPACE_LOCAL_SIZE" in env else None
    if env.get("LSB_DJOB_RANKFILE"):
        hosts = _lines(env["LSB_DJOB_RANKFILE"])[1:]
    else:
        hosts = env.get("LSB_MCPU_HOSTS", "").split()[2::2]
    # several jsrun steps of one job run at once: each step is a PMIx namespace of its own
    job = ".".join(filter(None, (env.get("LSB_JOBID"), env.get("PMIX_NAMESPACE"))))
    node, nodes = (0, 1) if local_size == world else (None, None)
    return LaunchEnv("lsf", rank, world, _int(env, "JSM_NAMESPACE_LOCAL_RANK", 0), local_size, node, nodes,
                     hosts[0] if hosts else None, _port(f"lsf:{job}") if job else None, 0,
                     "" if hosts and job else "jsrun's job names no compute host or job id (LSB_DJOB_RANKFILE, "
                     "LSB_JOBID): set MASTER_ADDR and MASTER_PORT", f"lsf-{job}" if job else "")


def _lines(path: str) -> list[str]:
    """The non-empty lines of a launcher's host file; none where it can't be read."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return [line.strip() for line in f if line.strip()]
    except OSError:
        return []


_SLURM_MAX_NORMAL_STEP = 0xFFFFFFF0
"""Slurm's SLURM_MAX_NORMAL_STEP_ID: ids above are its special steps (batch script 0xfffffffb,
interactive 0xfffffffa, extern 0xfffffffc; before 20.11 batch 0xfffffffe and extern 0xffffffff),
which newer releases print signed (26.05 gives a batch script SLURM_STEP_ID=-5)."""


def _srun_step(env: Mapping[str, str]) -> bool:
    """Whether SLURM_STEP_ID names a step srun started, not the batch script's or salloc's own."""
    return "SLURM_STEP_ID" in env and 0 <= _int(env, "SLURM_STEP_ID") <= _SLURM_MAX_NORMAL_STEP


def _slurm(env: Mapping[str, str]) -> LaunchEnv | None:
    # Only srun's tasks: a batch script (or salloc's interactive step) also has SLURM_PROCID=0 and
    # SLURM_NTASKS, but runs once.
    if "SLURM_PROCID" not in env or not _srun_step(env):
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


def _kubeflow(env: Mapping[str, str]) -> LaunchEnv | None:
    """Kubeflow's training operator (v1.7+) with nprocPerNode: WORLD_SIZE counts processes (pods times
    PET_NPROC_PER_NODE), but RANK is the pod's index (PET_NODE_RANK), for torchrun in the pod to
    refine. Without torchrun the pod runs one process: machine PET_NODE_RANK of PET_NNODES, which
    launch(main, n) fills with n processes; one given LOCAL_RANK is that process of the pod's n."""
    if "PET_NPROC_PER_NODE" not in env or "PET_NNODES" not in env or "PET_NODE_RANK" not in env:
        return None
    try:  # "auto" per node, "2:4" nodes (elastic): the operator then counts one process per pod
        per_pod, pods = int(env["PET_NPROC_PER_NODE"]), int(env["PET_NNODES"])
    except ValueError:
        return None
    pod = _int(env, "PET_NODE_RANK")
    if per_pod == 1 or _int(env, "RANK") != pod or _int(env, "WORLD_SIZE") != pods * per_pod:
        return None  # one process per pod, or an inner launcher set this process's own RANK
    addr, port = env.get("MASTER_ADDR"), _int(env, "MASTER_PORT", 0) or None
    problem = "" if addr and port else "the training operator set no MASTER_ADDR and MASTER_PORT: set them"
    rank, world, local, local_size = pod, pods, 0, 1
    if "LOCAL_RANK" in env:
        local, local_size = _int(env, "LOCAL_RANK"), per_pod
        rank, world = pod * per_pod + local, pods * per_pod
    return LaunchEnv("kubeflow", rank, world, local, local_size, pod, pods, addr, port, 0, problem,
                     f"kubeflow-{addr}:{port}")


def _with_explicit(found: LaunchEnv, env: Mapping[str, str]) -> LaunchEnv:
    """MASTER_ADDR / MASTER_PORT win over the launcher's; RANK / WORLD_SIZE must agree with it."""
    if found.launcher not in TORCHRUN_LIKE:  # torchrun's own RANK/WORLD_SIZE are what it read
        for name, mine in (("WORLD_SIZE", found.world_size), ("RANK", found.rank)):
            if name in env and _int(env, name) != mine:
                raise ValueError(f"{name}={env[name]} contradicts {found.launcher}'s {mine} "
                                 f"({found.describe()}); unset {name} or make them agree")
    if "MASTER_ADDR" in env:
        found = dataclasses.replace(found, master_addr=env["MASTER_ADDR"])
    if "MASTER_PORT" in env:
        found = dataclasses.replace(found, master_port=_int(env, "MASTER_PORT"))
    if not found.job and found.master_port is not None:  # no job id of its own: the address all ranks were given
        found = dataclasses.replace(found, job=f"{found.launcher}-{found.master_addr}:{found.master_port}")
    if found.master_addr is not None and (found.master_port is not None or found.world_size == 1):
        found = dataclasses.replace(found, address_problem="")
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


def inherited(found: LaunchEnv) -> bool:
    """Whether ``found`` (this process's launch) is its parent's, inherited: a process Python's
    multiprocessing started with the launcher's variables already set (a rank's data loader
    worker), which is a helper of its rank, not a rank. Variables set for the process after it
    started (torchrun's elastic_launch(fn) and mp.spawn set each worker's in the worker) make it a
    rank of its own. Where the starting environment can't be read, a helper, as before."""
    if multiprocessing.parent_process() is None:
        return False
    start = _starting_environment()
    if start is None:
        return True
    try:
        then = detect(start)
    except ValueError:
        return False
    return (then.launcher, then.rank, then.world_size) == (found.launcher, found.rank, found.world_size)


_at_fork: dict[str, str] | None = None
"""The environment at the fork that started this process, if it forked from one that imported distcomm."""


def remember_starting_environment() -> None:
    """Take the environment as it is now as the one this process started with (at a fork; or where
    the process then takes its parent's, as a forkserver's child does)."""
    global _at_fork
    _at_fork = dict(os.environ)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=remember_starting_environment)


def _starting_environment() -> dict[str, str] | None:
    """The environment this process started with: at its fork, else at its exec (Linux's
    /proc/self/environ keeps it, whatever the process set since); None where neither is known."""
    if _at_fork is not None:
        return _at_fork
    try:
        with open("/proc/self/environ", "rb") as f:
            data = f.read()
    except OSError:
        return None
    pairs = (os.fsdecode(item).partition("=") for item in data.split(b"\0") if item)
    return {name: value for name, _, value in pairs}

