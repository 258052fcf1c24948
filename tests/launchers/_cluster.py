"""Real launchers on this machine: Debian's Slurm and Open MPI, installed on first use; a one-node
Slurm cluster started for the session and stopped by pid; network namespaces as extra hosts."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

PACKAGES = {"srun": "slurm-wlm", "slurmctld": "slurm-wlm", "slurmd": "slurm-wlm", "mpirun": "openmpi-bin"}
TIMEOUT = 120  # seconds any one launcher command may take


def ensure_packages() -> None:
    """Install the launchers from Debian's packages unless they are on PATH already (needs root)."""
    missing = sorted({pkg for cmd, pkg in PACKAGES.items() if shutil.which(cmd) is None})
    if not missing:
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"the launcher tests need {', '.join(missing)}: run them as root, or "
                           f"`apt-get install {' '.join(missing)}` first")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, capture_output=True, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, env=env, capture_output=True,
                   timeout=900)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _slurm_conf(where: Path, host: str) -> str:
    return f"""\
ClusterName=distcomm
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
AuthType=auth/none
CredType=cred/none
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={where}/state
SlurmdSpoolDir={where}/spool
SlurmctldPidFile={where}/slurmctld.pid
SlurmdPidFile={where}/slurmd.pid
SlurmctldLogFile={where}/slurmctld.log
SlurmdLogFile={where}/slurmd.log
ReturnToService=2
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/linear
NodeName={host} NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
"""


@contextlib.contextmanager
def slurm_cluster(where: Path) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster (slurmctld and slurmd in the foreground, ours by pid); yields the
    environment its commands need; stops both, and any task left behind, on every exit."""
    host = socket.gethostname()
    (where / "state").mkdir(parents=True)
    (where / "spool").mkdir()
    conf = where / "slurm.conf"
    conf.write_text(_slurm_conf(where, host))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        for daemon in ("slurmctld", "slurmd"):
            daemons.append(subprocess.Popen([daemon, "-D", "-f", str(conf)], env=env, stdout=subprocess.DEVNULL,
                                            stderr=subprocess.DEVNULL, start_new_session=True))
        _wait_idle(env, host, daemons, where)
        yield env
    finally:
        subprocess.run(["scancel", "--full", "--quiet", "-u", "root"], env=env, capture_output=True, timeout=30,
                       check=False)
        for d in daemons:
            d.terminate()
        for d in daemons:
            try:
                d.wait(10)
            except subprocess.TimeoutExpired:
                d.kill()
                d.wait(10)
        _end_stepds()


def _wait_idle(env: dict[str, str], host: str, daemons: list[subprocess.Popen[bytes]], where: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if any(d.poll() is not None for d in daemons):
            break
        out = subprocess.run(["sinfo", "-h", "-n", host, "-o", "%t"], env=env, capture_output=True, text=True,
                             timeout=30, check=False).stdout.strip()
        if out.startswith("idle") or out.startswith("mix"):
            return
        if out.startswith("drain") or out.startswith("down"):
            subprocess.run(["scontrol", "update", f"nodename={host}", "state=resume"], env=env,
                           capture_output=True, timeout=30, check=False)
        time.sleep(0.5)
    logs = "".join((where / f).read_text()[-2000:] for f in ("slurmctld.log", "slurmd.log") if (where / f).exists())
    raise RuntimeError(f"the Slurm node didn't come up within 60 s:\n{logs}")


def _end_stepds() -> None:
    """Slurm's step daemons detach from slurmd: end any that outlived their job."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name == "slurmstepd":
            with contextlib.suppress(OSError):
                os.kill(int(pid), 9)


def python_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This interpreter's import path for child processes, so they import this checkout's distcomm."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(extra or {})}
    for name in list(env):  # a launcher's variables from whatever runs the tests
        if name.startswith(("SLURM_", "OMPI_", "PMI_", "PMIX_", "MV2_", "TORCHELASTIC_")) or name in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            if not (extra and name in extra):
                del env[name]
    return env


def run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    """``cmd`` in its own session, killed with everything it started if it outlives ``timeout``."""
    proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} ran past {timeout} s:\n{out[-4000:]}") from None
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 9)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


SUBNET = "10.79.0"


@contextlib.contextmanager
def hosts(n: int) -> Iterator[list[str]]:
    """``n`` "hosts": network namespaces on one bridge, addresses SUBNET.1 to SUBNET.n; yields their
    names; removes everything on every exit (needs root)."""
    tag = f"dcl{os.getpid() % 10000}"
    names = [f"{tag}n{i}" for i in range(n)]
    made: list[str] = []
    try:
        _ip("link", "add", f"{tag}br", "type", "bridge")
        made.append(f"{tag}br")
        _ip("link", "set", f"{tag}br", "up")
        for i, ns in enumerate(names):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", f"{ns}h", "type", "veth", "peer", "name", "eth0", "netns", ns)
            made.append(f"{ns}h")  # deleted by name: a namespace outlives its deletion while sockets in it linger
            _ip("link", "set", f"{ns}h", "master", f"{tag}br")
            _ip("link", "set", f"{ns}h", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for name in reversed(made):
            kind = ["link", "del", name] if name.endswith(("br", "h")) else ["netns", "del", name]
            subprocess.run(["ip", *kind], capture_output=True, timeout=30, check=False)


def run_on_hosts(cmds: list[tuple[str, list[str], dict[str, str]]], cwd: Path,
                 timeout: float = TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Each (namespace, command, environment) at once, each namespace with a host name of its own (its name);
    one result: the first failing return code (else 0) and every output, one after the other."""
    procs = []
    try:
        for ns, cmd, env in cmds:
            wrapped = ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c",
                       f'hostname {ns} && exec "$@"', "sh", *cmd]
            procs.append(subprocess.Popen(wrapped, env=env, cwd=cwd, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
        deadline = time.monotonic() + timeout
        outs = []
        for p in procs:
            try:
                outs.append(p.communicate(timeout=max(deadline - time.monotonic(), 0.1))[0])
            except subprocess.TimeoutExpired:
                for q in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(q.pid, 9)
                said = "\n".join(f"--- {' '.join(c[1])} on {c[0]}:\n{q.communicate()[0][-2000:]}"
                                 for c, q in zip(cmds, procs))
                raise AssertionError(f"ran past {timeout} s:\n{said}") from None
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, 9)
    code = next((p.returncode for p in procs if p.returncode), 0)
    return subprocess.CompletedProcess([], code, "\n".join(outs), "")
