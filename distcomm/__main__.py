"""The command line: ``python -m distcomm <command>`` (also the ``distcomm`` console script).

``env``    versions, devices, what the launcher detection reads, the interface gloo would use.
``check``  every rank meets and every collective gives exact results; rank 0 prints a table.
``bench``  object and tensor collectives over message sizes, beside torch's own API.
``store``  serve a job's store from a process of its own, so the job outlives any of its ranks.
``run``    start this machine's workers as torchrun does, keeping the survivors when one is lost.

``check`` and ``bench`` run under the job's launcher (``srun``, ``torchrun``, ``mpirun``: one
process per rank) or, started by plain ``python``, in ``--nproc`` processes on this machine.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m distcomm", description="distcomm's command line")
    commands = parser.add_subparsers(dest="command", required=True, metavar="command")
    env = commands.add_parser("env", help="versions, devices, launcher and network as this process sees them")
    env.add_argument("--json", action="store_true", help="machine-readable output")
    check = commands.add_parser("check", help="every rank meets and every collective gives exact results")
    bench = commands.add_parser("bench", help="collectives over message sizes beside torch's own API")
    for sub in (check, bench):
        sub.add_argument("--nproc", type=int, default=None,
                         help="processes to start on this machine (without a launcher; default 2)")
        sub.add_argument("--backend", choices=("gloo", "nccl"), default=None,
                         help="default: nccl where CUDA is available, else gloo")
        sub.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for the other ranks")
    bench.add_argument("--sizes", default="1K,64K,1M,16M", help="bytes per rank, comma-separated (K, M, G)")
    bench.add_argument("--plot", metavar="PNG", help="also draw time against size into this file")
    store = commands.add_parser("store", help="serve a job's store until interrupted (Ctrl-C, SIGTERM)",
                                description=_store.__doc__)
    store.add_argument("--port", type=int, required=True, help="the port to listen on (the ranks' MASTER_PORT)")
    store.add_argument("--world-size", type=int, default=1, help="the job's ranks (informational)")
    run = _run_parser(commands)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # (said by the command's own parser: its usage, not the top level's)
        (run if args.command == "run" else parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if not 0 < getattr(args, "timeout", 1.0) < math.inf or (getattr(args, "nproc", None) or 1) < 1:
        parser.error("--timeout must be a positive, finite number of seconds and --nproc 1 or more")
    if getattr(args, "backend", None) == "nccl" and not _cuda():
        parser.error("--backend nccl needs CUDA, and this machine has no CUDA device")
    if args.command == "env":
        from ._cli.env import print_environment

        return print_environment(args.json)
    if args.command == "store":
        return _store(args.port, args.world_size)
    if args.command == "run":
        return _run(run, args)
    if args.command == "check":
        return _on_every_rank(parser, _check, (), args)
    return _bench_command(parser, args)


def _run_parser(commands: Any) -> argparse.ArgumentParser:
    run = commands.add_parser(
        "run", help="start this machine's workers as torchrun does, keeping the survivors when one is lost",
        description="Start this machine's workers with torchrun's variables (a plain torch script runs unchanged); "
                    "the first machine's agent serves the job's store, so that it outlives any worker. A worker "
                    "that exits non-zero fails the job; one killed by a signal is lost, and the others go on.")
    run.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, help="workers on this machine")
    run.add_argument("--nnodes", type=int, default=1, help="machines in the job (one agent each)")
    run.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this machine's index")
    run.add_argument("--standalone", action="store_true",
                     help="a job of this machine alone, on a free port (torchrun's flag; the default here)")
    run.add_argument("--master-addr", "--master_addr", default="127.0.0.1", help="the first machine's address")
    run.add_argument("--master-port", "--master_port", type=int, default=0,
                     help="the job's store's port on the first machine (default on one machine: a free one)")
    run.add_argument("--replacements", type=int, default=0,
                     help="lost workers started again, in all, each to be let in by the others' admit()")
    run.add_argument("--log-dir", "--log_dir", help="also write each worker's output to rank<r>.log there "
                                                    "(a replacement's to rank<r>.<k>.log)")
    run.add_argument("--term-grace", type=float, default=30.0, metavar="SECONDS",
                     help="once the agent is stopped (SIGTERM, Ctrl-C) or the job failed, seconds each worker "
                          "has to end once the signal is passed on (to save a checkpoint), before SIGKILL (default 30)")
    run.add_argument("--no-prefix", action="store_true", help="don't start each line with [rank<r>]: ")
    run.add_argument("-m", "--module", action="store_true", help="the script is a module to run, as python -m")
    run.add_argument("script", help="the script (or module) each worker runs")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    return run  # type: ignore[no-any-return]


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._launching.agent import Job, UsageError, run_job

    if args.standalone and (args.nnodes != 1 or args.master_port):
        parser.error("--standalone is a job of this machine alone, on a free port: drop --nnodes and --master-port")
    command = ("-m", args.script) if args.module else (args.script,)
    job = Job(command + tuple(args.script_args), args.nproc_per_node, args.nnodes, args.node_rank, args.master_addr,
              args.master_port, args.replacements, args.log_dir, not args.no_prefix, term_grace=args.term_grace)
    problem = job.problem() or ("" if args.module or os.path.exists(args.script) else f"no script {args.script!r}")
    if problem:
        parser.error(problem)
    try:
        return run_job(job)
    except UsageError as e:
        parser.error(str(e))


def _bench_command(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from ._cli.bench import bench_problem, parse_size

    try:
        sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    except ValueError as e:
        parser.error(str(e))
    if not sizes:
        parser.error(f"--sizes names no size ({args.sizes!r}): give bytes per rank, comma-separated, e.g. 1K,64K,1M")
    found = _detected(parser)
    world = found.world_size if found.started_by_launcher else args.nproc or 2
    if world < 2:
        parser.error("bench compares collectives between ranks: run it under a launcher or with --nproc 2 or more")
    if not found.started_by_launcher:  # (under a launcher, rank 0 decides for all: see _bench)
        problem = bench_problem(sizes, world, world, args.plot)
        if problem:
            parser.error(problem)
    return _on_every_rank(parser, _bench, (sizes, args.plot), args)


def _detected(parser: argparse.ArgumentParser) -> Any:
    """What started this process (``detect()``); variables that contradict each other end the command."""
    from ._launching.launchers import detect

    try:
        return detect()
    except ValueError as e:
        parser.exit(1, f"PROBLEM: {e}\n")


def _on_every_rank(parser: argparse.ArgumentParser, fn: Callable[..., bool], fn_args: tuple[Any, ...],
                   args: argparse.Namespace) -> int:
    """Run ``fn(*fn_args)`` on every rank with its communicator installed; 0 if rank 0's returned True."""
    import distcomm

    found = _detected(parser)
    if found.started_by_launcher:
        if args.nproc is not None:
            parser.error(f"{found.launcher} started this process: it sets the ranks, so drop --nproc")
        backend = args.backend or ("nccl" if _cuda() else "gloo")
        cls = distcomm.NcclCommunicator if backend == "nccl" else distcomm.GlooCommunicator
        try:
            comm = cls.from_env(timeout=args.timeout)
        except distcomm.DistCommError as e:
            print(f"PROBLEM (rank {found.rank}): {e}", file=sys.stderr, flush=True)
            return 1
        with comm, distcomm.use(comm):
            ok = fn(*fn_args)
        return 0 if ok or found.rank != 0 else 1
    with tempfile.TemporaryDirectory(prefix="distcomm-") as tmp:
        verdict = os.path.join(tmp, "verdict")
        try:  # (the table is rank 0's alone: no rank prefix on its lines)
            distcomm.launch(_rank_main, args.nproc or 2, args=(fn, fn_args, verdict), backend=args.backend,
                            timeout=args.timeout, prefix_output=False)
        except (distcomm.DistCommError, ValueError, RuntimeError) as e:
            print(f"PROBLEM: {e}", file=sys.stderr, flush=True)
            return 1
        with open(verdict) as f:
            return 0 if f.read() == "ok" else 1


def _rank_main(fn: Callable[..., bool], fn_args: tuple[Any, ...], verdict: str) -> None:
    ok = fn(*fn_args)
    import distcomm

    if distcomm.get_rank() == 0:
        with open(verdict, "w") as f:
            f.write("ok" if ok else "problem")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _check() -> bool:
    from ._cli.check import check_rank

    return check_rank()


def _bench(sizes: list[int], png: str | None) -> bool:
    import distcomm

    from ._cli.bench import bench_problem, bench_rank, plot, table

    comm = distcomm.current()  # rank 0 decides for all: memory and matplotlib may differ per machine
    problem = comm.broadcast(bench_problem(sizes, comm.world_size, comm.local_size, png) if comm.rank == 0 else None)
    if problem:
        if comm.rank == 0:
            print(f"PROBLEM: {problem}", file=sys.stderr, flush=True)
        return False
    rows = bench_rank(sizes)
    if distcomm.get_rank() == 0:
        print(table(rows), flush=True)
        if png:
            plot(rows, png)
            print(f"plot: {png}", flush=True)
    return True


def _store(port: int, world: int) -> int:
    """Serve a job's store on PORT until interrupted. Start the ranks with MASTER_ADDR=<this host>,
    MASTER_PORT=PORT and DISTCOMM_STORE=external: the store then outlives any of them."""
    from ._launching.rendezvous import serve_store

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    held = serve_store(f"tcp://0.0.0.0:{port}", world, 60.0)
    print(f"distcomm: serving the job's store on port {port}; ranks: MASTER_PORT={port} DISTCOMM_STORE=external",
          flush=True)
    while not stop.wait(1.0):
        pass
    del held
    return 0


if __name__ == "__main__":
    sys.exit(main())
