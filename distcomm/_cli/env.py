"""``python -m distcomm env``: what this process would start with, and where each fact came from.

Versions, devices, what the launcher detection reads (and from which variables), and the network
interface gloo would use: the facts a first bug report on a new cluster needs, in one place.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import platform
import socket
import struct
from typing import Any

import torch
import torch.distributed as dist

from .._launching.launchers import detect

__all__ = ["environment", "gloo_interface", "print_environment", "versions"]

_LAUNCH_PREFIXES = ("TORCHELASTIC_", "GROUP_", "LOCAL_", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID",
                    "SLURM_NTASKS", "SLURM_STEP_", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_TASKS_PER_NODE",
                    "OMPI_COMM_WORLD_", "OMPI_MCA_ess_base_jobid", "PMIX_NAMESPACE", "PMI_", "MPI_LOCAL",
                    "MV2_COMM_WORLD_", "MPIRUN_ID",
                    "PALS_", "PBS_NODEFILE", "JSM_NAMESPACE_", "LSB_JOBID", "LSB_DJOB_RANKFILE", "LSB_MCPU_HOSTS",
                    "PET_", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME",
                    "NCCL_SOCKET_IFNAME", "DISTCOMM_")


def versions() -> dict[str, str]:
    """The versions every rank of a job must share (``check`` compares them)."""
    from .. import __version__

    nccl = ""
    if torch.cuda.is_available() and dist.is_nccl_available():
        with contextlib.suppress(Exception):
            nccl = ".".join(map(str, torch.cuda.nccl.version()))  # type: ignore[no-untyped-call]
    return {"python": platform.python_version(), "torch": torch.__version__, "distcomm": __version__,
            "nccl": nccl or "none", "gloo": "yes" if dist.is_gloo_available() else "no"}


def environment() -> dict[str, Any]:
    """Everything ``env`` reports, as plain data (``--json`` prints it as it is)."""
    report: dict[str, Any] = {"versions": versions(), "host": socket.gethostname(), "pid": os.getpid()}
    report["devices"] = {"cpus": os.cpu_count() or 0, "cuda": torch.cuda.device_count() if torch.cuda.is_available()
                         else 0, "cuda_names": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
                         if torch.cuda.is_available() else []}
    report["launch"] = _launch()
    report["variables"] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(_LAUNCH_PREFIXES)}
    name, address, loopback, why = gloo_interface()
    report["gloo_interface"] = {"name": name, "address": address, "loopback": loopback, "chosen_by": why}
    return report


def _launch() -> dict[str, Any]:
    """What ``detect()`` reads, with where the rendezvous address and port come from."""
    try:
        found = detect()
    except ValueError as e:
        return {"problem": str(e)}
    launch: dict[str, Any] = {k: getattr(found, k) for k in (
        "launcher", "rank", "world_size", "local_rank", "local_size", "node_rank", "num_nodes", "master_addr",
        "master_port", "restart", "job")}
    env = os.environ
    launch["master_addr_from"] = ("MASTER_ADDR" if "MASTER_ADDR" in env else "this machine (no launcher)"
                                  if not found.started_by_launcher else
                                  f"{found.launcher}'s variables" if found.master_addr else "nowhere")
    launch["master_port_from"] = ("MASTER_PORT" if "MASTER_PORT" in env else
                                  f"derived from the job's id ({found.job})" if found.master_port else
                                  "a world of one, which meets nobody" if found.world_size == 1 else "nowhere")
    if found.address_problem:
        launch["problem"] = found.address_problem
    return launch


def gloo_interface() -> tuple[str, str, bool, str]:
    """The interface gloo would use here: (name, address, loopback?, what chose it). Without
    GLOO_SOCKET_IFNAME gloo takes the address this host's name resolves to."""
    chosen = os.environ.get("GLOO_SOCKET_IFNAME", "")
    if chosen:
        name = chosen.split(",")[0]
        address = _ipv4_of(name)
        return name, address, _loopback(address), "GLOO_SOCKET_IFNAME"
    host = socket.gethostname()
    try:
        address = socket.gethostbyname(host)
    except OSError:
        return "", "", False, f"the host name {host!r}, which does not resolve"
    return _interface_with(address), address, _loopback(address), f"the host name {host!r}"


def _loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _ipv4_of(name: str) -> str:
    """The IPv4 address of interface ``name`` ("" where it has none or doesn't exist)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))  # SIOCGIFADDR
        except OSError:
            return ""
    return socket.inet_ntoa(packed[20:24])


def _interface_with(address: str) -> str:
    """The name of the interface that holds ``address`` ("" where none does)."""
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == address:
            return name
    return "lo" if _loopback(address) else ""


def print_environment(as_json: bool) -> int:
    report = environment()
    if as_json:
        print(json.dumps(report, indent=2, default=str))
        return 0
    v, d, launch, nic = report["versions"], report["devices"], report["launch"], report["gloo_interface"]
    print(f"distcomm {v['distcomm']}  torch {v['torch']}  python {v['python']}  NCCL {v['nccl']}  gloo {v['gloo']}")
    gpus = f"{d['cuda']} CUDA ({', '.join(d['cuda_names'])})" if d["cuda"] else "no CUDA device"
    print(f"host {report['host']} (pid {report['pid']}): {d['cpus']} CPUs, {gpus}")
    if "launcher" in launch:
        print(f"launcher: {launch['launcher']}, rank {launch['rank']} of {launch['world_size']}, local rank "
              f"{launch['local_rank']} of {launch['local_size']}, node {launch['node_rank']} of {launch['num_nodes']}")
        port = launch["master_port"] or "any free one"
        print(f"rendezvous: {launch['master_addr']} (from {launch['master_addr_from']}), port {port} "
              f"(from {launch['master_port_from']})")
    if "problem" in launch:
        print(f"problem: {launch['problem']}")
    where = f"{nic['name'] or '?'} {nic['address'] or 'no address'}"
    note = " (loopback: fine on one machine; across machines set GLOO_SOCKET_IFNAME)" if nic["loopback"] else ""
    print(f"gloo interface: {where}, chosen by {nic['chosen_by']}{note}")
    if report["variables"]:
        print("launch variables:")
        for k, val in report["variables"].items():
            print(f"  {k}={val}")
    return 0 if "problem" not in launch else 1
