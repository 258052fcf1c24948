"""launch(): start this machine's processes, one communicator each, and run a function in them."""

from __future__ import annotations

import ast
import contextlib
import ctypes
import dataclasses
import datetime
import faulthandler
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing as mp

from .._communicator import DEFAULT_TIMEOUT
from .._context import use
from .._defaults import clear_default, set_default
from .._elastic.waits import WAITERS
from .._errors import DistCommError, RankFailedError, clipped
from .._local import LocalCommunicator
from .._torch import GlooCommunicator, NcclCommunicator
from .._trust.key import KEY_FILE_VAR, KEY_VAR, job_key, key_given, new_key
from .._wire.memory import seconds as _seconds
from .._wire.serialization import dumps_code
from .from_env import machines_under, run_here
from .launchers import detect
from .ports import free_port
from .rank_output import RankOutput
from .rendezvous import serve_store
from .start import start_world
from .supervise import JobStore, how_it_ended, saying, wait_elastic, wait_until_failure

__all__ = ["free_port", "launch"]

_PR_SET_PDEATHSIG = 1
_LONGEST = 300  # characters of an exception's message in a one-line description
_GRACE = 2.0  # seconds the other processes get to report, once one failed, before they are ended
# asks a process for its stacks: a real-time signal, which programs don't use (SIGUSR1 is Slurm's
# and Lightning's preemption signal); None where there is none (no stacks then)
_STACK_SIGNAL: int | None = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else None
_STACK_SECONDS = 0.5  # how long those stacks get to be written
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # (distcomm/, not _launching/)
_LIBRARY_DIRS = tuple(sorted({os.path.abspath(p) + os.sep for k, p in sysconfig.get_paths().items()
                              if k in ("stdlib", "platstdlib", "purelib", "platlib")}))


def _die_with(parent: int) -> None:
    """Ask the kernel to kill this process when its parent dies (Linux), so that a launcher killed
    with SIGKILL leaves no orphan behind; exit now if the parent is already gone."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # no prctl: the launcher's own cleanup still ends us
            pass
    if os.getppid() != parent:
        os._exit(1)


def _end(processes: Sequence[Any], grace: float = 3.0, stacks: bool = False) -> None:
    """Stop every process still running: SIGTERM, then SIGKILL after ``grace`` seconds. With
    ``stacks`` (a rank failed, the others are ended), each is first asked for its threads' stacks
    (``_stacks_on_request``), for the error that names it; not on Ctrl-C or a normal end."""
    alive = [p for p in processes if p.is_alive()]
    if alive and stacks and _STACK_SIGNAL is not None:
        for p in alive:
            with contextlib.suppress(OSError):
                os.kill(p.pid, _STACK_SIGNAL)
        time.sleep(_STACK_SECONDS)  # faulthandler writes from a signal handler: at once, even if stuck in C
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + grace
    for p in alive:
        p.join(max(deadline - time.monotonic(), 0.0))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _user_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``e``'s traceback in the user's code: outside distcomm, and outside the
    standard library and installed packages where such a frame exists."""
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not os.path.abspath(f.filename).startswith(_PACKAGE_DIR)]
    user = [f for f in frames if not os.path.abspath(f.filename).startswith(_LIBRARY_DIRS)]
    found = user or frames
    return found[-1] if found else None


def describe(e: BaseException) -> str:
    """One line: what was raised, and where it was, e.g. ``ValueError: bad batch (in main() at
    train.py:6)``; a multi-line message gives its first line (the rest is in the traceback)."""
    lines = [line.strip() for line in str(e).strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    if first.endswith(":") and len(lines) > 1:  # "scatter #1 failed on rank 0:": the reason is below
        first += f" {lines[1]}" + (f" (and {len(lines) - 2} more lines)" if len(lines) > 2 else "")
    first = clipped(first, _LONGEST)
    text = f"{type(e).__name__}: {first}" if first else type(e).__name__
    frame = _user_frame(e)
    if frame is not None:
        name = frame.name if frame.name.startswith("<") else f"{frame.name}()"
        text += f" (in {name} at {os.path.basename(frame.filename)}:{frame.lineno})"
    return text


def first_failure(failures: dict[int, tuple[bool, float]]) -> int:
    """The rank whose failure came first: ``failures`` maps each failed rank to (whether its error
    is a consequence of another rank's, a DistCommError such as a lost peer; when it failed). A rank
    that raised something else, or died, comes before the ranks that lost it, the earliest first;
    among consequences alone (an error raised alike on every rank), the lowest rank."""
    return min(failures, key=lambda r: (failures[r][0], 0.0 if failures[r][0] else failures[r][1], r))


def _report(where: str, index: int, e: BaseException) -> bool:
    """Write what this process raised, for the launcher (which reads it after the process ended)."""
    try:
        try:
            blob: bytes | None = cloudpickle.dumps(e)
            cloudpickle.loads(blob)  # an exception whose __init__ can't be replayed doesn't come back
        except Exception:
            blob = None
        report = {"time": time.time(), "line": describe(e), "consequence": isinstance(e, DistCommError),
                  "traceback": traceback.format_exc(), "exception": blob}
        path = os.path.join(where, f"{index}.report")
        with open(path + ".tmp", "wb") as f:
            pickle.dump(report, f)
        os.replace(path + ".tmp", path)
    except Exception:  # noqa: S110 - the launcher still sees the exit code and torch's error file
        pass
    return True


def _stacks_on_request(reports: str, index: int) -> None:
    """Write this process's threads' stacks to ``<index>.stack`` when the launcher asks (before it
    ends a process that hangs), from a signal handler: also while the process waits in C code."""
    if _STACK_SIGNAL is None or signal.getsignal(_STACK_SIGNAL) not in (signal.SIG_DFL, None):
        return  # no such signal, or the program handles it itself: no stacks
    with contextlib.suppress(OSError, ValueError, AttributeError):
        f = open(os.path.join(reports, f"{index}.stack"), "w")  # kept open: faulthandler writes to it later
        faulthandler.register(_STACK_SIGNAL, file=f, all_threads=True)


def _worker(
    local_rank: int, payload: bytes, per_machine: int, num_machines: int, machine_rank: int,
    url: str, backend: str, timeout: float, parent: int, reports: str, hosted: bool, key: str | None,
    output: RankOutput,
) -> None:
    if key is not None:  # (the job's key, made by launch(): in the environment, as under the run command)
        os.environ[KEY_VAR] = key
    output.install(machine_rank * per_machine + local_rank)
    _die_with(parent)
    _stacks_on_request(reports, local_rank)
    reported = False
    try:
        main_func, args = cloudpickle.loads(payload)
        cls = NcclCommunicator if backend == "nccl" else GlooCommunicator
        comm = start_world(cls, url, machine_rank * per_machine + local_rank, per_machine * num_machines,
                           local_rank, timeout=timeout, machine=machine_rank, launcher="launch", hosted=hosted)
        with comm, use(comm):
            try:
                main_func(*args)
            except Exception as e:  # reported before the communicator closes: before its peers fail for it
                reported = _report(reports, local_rank, e)
                raise
    except Exception as e:
        WAITERS.let_go()
        if not reported:
            _report(reports, local_rank, e)
        raise


def _failure(processes: Sequence[Any], failed: dict[int, tuple[int, float]], reports: str, first: int,
             error_files: Sequence[str]) -> RankFailedError:
    """One error for the failed processes, headed by the one that failed first, with what and where."""
    found: dict[int, dict[str, Any]] = {}
    for i in range(len(processes)):
        try:
            with open(os.path.join(reports, f"{i}.report"), "rb") as f:
                found[i] = pickle.load(f)  # written by our own processes
        except (OSError, pickle.UnpicklingError, EOFError):
            continue
    lines: dict[int, str] = {}
    tracebacks: dict[int, str] = {}
    exceptions: dict[int, BaseException | None] = {}
    order: dict[int, tuple[bool, float]] = {}
    for i in sorted(set(failed) | set(found)):
        rank = first + i
        report = found.get(i)
        if report is not None:
            lines[rank] = f"rank {rank} raised {report['line']}"
            tracebacks[rank] = report["traceback"]
            try:
                exc = cloudpickle.loads(report["exception"]) if report["exception"] is not None else None
            except Exception:
                exc = None
            exceptions[rank] = exc if isinstance(exc, BaseException) else None
            order[rank] = (report["consequence"], report["time"])
            continue
        code, when = failed[i]
        how = how_it_ended(code)
        how = f"was {how}" if how.startswith("killed") else how
        lines[rank] = f"rank {rank} (pid {processes[i].pid}) {how} before main_func returned"
        if code == 1 and i not in found:
            lines[rank] += unguarded if (unguarded := _unguarded_call()) else ""
        tracebacks[rank] = ""
        if i < len(error_files):  # torch's own record, where our report could not be written
            try:
                with open(error_files[i], "rb") as f:
                    tracebacks[rank] = str(pickle.load(f)).strip()  # written by our own processes
            except (OSError, pickle.UnpicklingError, EOFError):
                pass
        exceptions[rank] = None
        order[rank] = (False, when)
    rank = first_failure(order)
    stacks = _ended(processes, set(failed) | set(found), reports, first, rank, lines)
    others = "".join(f"\n  {line}" for r, line in sorted(lines.items()) if r != rank)
    text = lines[rank] + (f"\nother ranks:{others}" if others else "")
    if tracebacks[rank]:
        text += f"\n--- rank {rank} traceback ---\n{tracebacks[rank]}"
    text += "".join(f"\n--- rank {r}'s threads when it was ended ---\n{stack}" for r, stack in stacks.items())
    return RankFailedError(text, rank=rank, exception=exceptions[rank], remote_traceback=tracebacks[rank],
                           errors={r: exceptions.get(r) or RankFailedError(line, rank=r) for r, line in lines.items()})


def _unguarded_call() -> str:
    """Where the launching script calls launch() outside an ``if __name__ == "__main__":`` guard:
    each process it started ran that call again while importing the script, and exited (code 1)."""
    f: Any = sys._getframe(1)
    while f is not None and not (f.f_code.co_name == "<module>" and f.f_globals.get("__name__") == "__main__"):
        f = f.f_back
    if f is None:
        return ""
    try:
        with open(f.f_code.co_filename) as src:
            tree = ast.parse(src.read())
    except (OSError, SyntaxError, ValueError):
        return ""
    line = f.f_lineno
    for stmt in tree.body:
        if stmt.lineno <= line <= (stmt.end_lineno or stmt.lineno):
            test = ast.unparse(stmt.test) if isinstance(stmt, ast.If) else ""
            if "__name__" in test and "__main__" in test:
                return ""
            return (f": launch() is called at {os.path.basename(f.f_code.co_filename)}:{line} outside an "
                    f"`if __name__ == \"__main__\":` guard, so each process ran it again while importing the "
                    f"script; put the call under that guard")
    return ""


def _ended(processes: Sequence[Any], seen: set[int], reports: str, first: int, failed_first: int,
           lines: dict[int, str]) -> dict[int, str]:
    """Name, in ``lines``, the processes the launcher ended (still running after the others had
    time to report), where each was stuck; return their threads' stacks, where they were written."""
    stacks = {}
    for i, p in enumerate(processes):
        if i in seen or p.exitcode in (0, None):
            continue
        rank = first + i
        try:
            with open(os.path.join(reports, f"{i}.stack")) as f:
                stacks[rank] = f.read().strip()
        except OSError:
            pass
        stuck = _stuck_at(stacks.get(rank, ""))
        lines[rank] = (f"rank {rank} (pid {p.pid}) was still running {_GRACE:g} s after rank {failed_first} "
                       f"failed, and was ended" + (f" (stuck {stuck})" if stuck else ""))
    return {r: s for r, s in stacks.items() if s}


def _stuck_at(stack: str) -> str:
    """From faulthandler's dump, the main thread's innermost frame in the user's code: ``in main()
    at job.py:9`` (the main thread is the one whose outermost frame is a module's)."""
    threads = [block.splitlines()[1:] for block in stack.split("\n\n") if block.strip()]
    main = next((t for t in threads if t and t[-1].strip().endswith("in <module>")), threads[0] if threads else [])
    frames = []
    for line in main:  # '  File "/path/job.py", line 9 in main'
        head, _, name = line.strip().rpartition(" in ")
        path, _, number = head.removeprefix('File "').rpartition('", line ')
        if path and number.isdigit():
            frames.append((os.path.abspath(path), int(number), name))
    mine = [f for f in frames if not f[0].startswith(_PACKAGE_DIR) and not f[0].startswith(_LIBRARY_DIRS)]
    if not (mine or frames):
        return ""
    path, lineno, name = (mine or frames)[0]
    return f"in {name if name.startswith('<') else name + '()'} at {os.path.basename(path)}:{lineno}"


def launch(
    main_func: Callable[..., Any],
    num_processes_per_machine: int | None = None,
    num_machines: int = 1,
    machine_rank: int = 0,
    dist_url: str | None = None,
    args: Sequence[Any] = (),
    timeout: float | datetime.timedelta = DEFAULT_TIMEOUT,
    *,
    backend: str | None = None,
    num_gpus_per_machine: int | None = None,
    elastic: bool = False,
    replacements: int = 0,
    prefix_output: bool | None = None,
    log_dir: str | os.PathLike[str] | None = None,
) -> None:
    """Start this machine's processes and run ``main_func(*args)`` in each.

    The positional order is detectron2's ``launch(main_func, num_gpus_per_machine, num_machines,
    machine_rank, dist_url, args, timeout)``, so a call written for it runs unchanged.

    Each process initializes torch.distributed, builds the matching communicator (gloo or nccl)
    with its local rank and size, installs it with ``use()``, calls ``main_func(*args)``, and
    cleans up. ``main_func`` may be a lambda or closure (cloudpickle). A job of one process on one
    machine runs ``main_func`` in the calling process, with a LocalCommunicator installed: no
    process is started, nothing is pickled, breakpoints work.

    Args:
        main_func: the function each process runs.
        num_processes_per_machine: processes on this machine (alias: ``num_gpus_per_machine=``).
        num_machines: machines in the job (each calls launch() with its machine_rank).
        machine_rank: this machine's index.
        dist_url: "tcp://host:port" of machine 0; None or "auto" picks a free local port (one
            machine only).
        args: arguments for main_func.
        timeout: seconds (or a timedelta) collectives and set-up wait for peers; default 600 s
            (detectron2's is 30 minutes).
        backend: "gloo" or "nccl"; default nccl when CUDA is available, else gloo.
        elastic: the job outlives a lost rank: this process serves the job's store (so that it
            outlives every rank), a process that dies without raising doesn't end the others
            (they ``comm.shrink()`` and go on), and launch() returns once every process has
            exited. A process that raises still fails the job.
        replacements: with ``elastic``, how many lost processes are started again, in all; each
            waits in the rendezvous until the members ``comm.admit()`` it.
        prefix_output: start each line the processes print with ``[rank<r>]: ``; None: where
            the output is a terminal. ``log_dir``: also write each rank's to ``rank<r>.log`` there (a
            replacement's to ``rank<r>.<k>.log``: the log of the process it replaces stays).

    Under a launcher (torchrun, srun, mpirun; see ``from_env``) the launcher's world wins: where it
    started ``num_processes_per_machine`` processes here, ``main_func`` runs in this one; where it
    started one per machine, launch() starts them, with the machines and the rendezvous it names.

    Raises:
        RankFailedError: a process raised (its rank and remote traceback are attached) or died.
        ValueError: under a launcher, the arguments don't add up with what it started.
        RuntimeError: launch() was called while a spawned process imported the script (no
            ``if __name__ == "__main__":`` guard around the call).
    """
    num_processes_per_machine, backend = _checked(main_func, num_processes_per_machine, num_gpus_per_machine,
                                                  num_machines, machine_rank, backend, args, elastic, replacements)
    seconds = _seconds(timeout, DEFAULT_TIMEOUT)
    assert seconds is not None
    env = detect()
    if env.world_size > 1:  # a launcher started this process: its world wins
        plan = machines_under(env, num_processes_per_machine, num_machines, machine_rank, dist_url)
        if plan is None:
            run_here(env, main_func, args, seconds, backend)
            return
        num_machines, machine_rank, dist_url = plan
    if num_machines == 1 and num_processes_per_machine == 1:
        _run_alone(main_func, args, seconds)
        return
    if dist_url in (None, "auto"):
        if num_machines != 1:
            raise ValueError("dist_url='auto' only works with num_machines=1; pass machine 0's tcp://host:port")
        dist_url = f"tcp://127.0.0.1:{free_port()}"
    assert dist_url is not None
    _run_processes(main_func, args, num_processes_per_machine, num_machines, machine_rank, dist_url, backend,
                   seconds, elastic, replacements, RankOutput.chosen(prefix_output, log_dir))


def _checked(main_func: Any, num_processes_per_machine: int | None, num_gpus_per_machine: int | None,
             num_machines: int, machine_rank: int, backend: str | None, args: Any, elastic: bool,
             replacements: int) -> tuple[int, str]:
    """launch()'s arguments checked before anything starts: the processes per machine and the backend."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):  # a started process importing the script
        raise RuntimeError(
            "distcomm.launch() was called while a process it started imported your script: put the call "
            "under `if __name__ == \"__main__\":` (each process imports the script to find main_func)")
    if not callable(main_func):
        raise TypeError(f"main_func must be callable, got {type(main_func).__name__}")
    if num_gpus_per_machine is not None:
        if num_processes_per_machine is not None and num_processes_per_machine != num_gpus_per_machine:
            raise TypeError("pass num_processes_per_machine or its alias num_gpus_per_machine, not both")
        num_processes_per_machine = num_gpus_per_machine
    if num_processes_per_machine is None:
        raise TypeError("launch() needs num_processes_per_machine (or num_gpus_per_machine)")
    for name, value, low in (("num_processes_per_machine", num_processes_per_machine, 1),
                             ("num_machines", num_machines, 1), ("machine_rank", machine_rank, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if machine_rank >= num_machines:
        raise ValueError(f"machine_rank={machine_rank} is out of range for num_machines={num_machines}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend='nccl' needs CUDA and this machine has no CUDA device; use backend='gloo'")
    if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
        raise TypeError(f"args must be a tuple or list of main_func's arguments, got {type(args).__name__}")
    if isinstance(replacements, bool) or not isinstance(replacements, int) or replacements < 0:
        raise ValueError(f"replacements must be an int >= 0, got {replacements!r}")
    if replacements and not elastic:
        raise ValueError("replacements start lost ranks again in an elastic job: pass elastic=True too")
    if job_key() is None and replacements and num_machines > 1:  # (a bad key is refused here too)
        raise ValueError(f"replacements let processes into a running job, and only holders of the job's key come "
                         f"in: give every machine's launch() the same one ({KEY_VAR}, 16 or more characters, or "
                         f"{KEY_FILE_VAR}); a job on one machine makes its own")
    return num_processes_per_machine, backend


def _run_alone(main_func: Callable[..., Any], args: Sequence[Any], seconds: float) -> None:
    """A job of one process: ``main_func`` here, over a LocalCommunicator (nothing started or pickled)."""
    with LocalCommunicator(timeout=seconds) as comm, use(comm):
        set_default(comm)  # helper threads see it too, as in a job of many processes
        try:
            main_func(*args)
        finally:
            clear_default(comm)


def _run_processes(main_func: Callable[..., Any], args: Sequence[Any], per_machine: int, num_machines: int,
                   machine_rank: int, dist_url: str, backend: str, seconds: float, elastic: bool,
                   replacements: int, output: RankOutput) -> None:
    """Start this machine's processes, watch them (``_supervise``), and report the job's failure."""
    first = machine_rank * per_machine
    context = None
    processes: list[Any] = []
    reports = tempfile.mkdtemp(prefix="distcomm-launch-")
    served = serve_store(dist_url, per_machine * num_machines, seconds) if elastic and machine_rank == 0 else None
    made = new_key() if num_machines == 1 else None  # (across machines, the key each launch() was given)
    worker_args = (dumps_code((main_func, tuple(args))), per_machine, num_machines, machine_rank, dist_url, backend,
                   seconds, os.getpid(), reports, not elastic, made, output)
    try:
        context = mp.start_processes(  # type: ignore[attr-defined,no-untyped-call]
            _worker, args=worker_args, nprocs=per_machine, join=False, start_method="spawn")
        processes = list(context.processes)
        if elastic:
            view = JobStore(served, dist_url, key_given(made))
            failed = wait_elastic(processes, _GRACE, lambda i, _: os.path.exists(os.path.join(reports, f"{i}.report")),
                                  first, replacements, _starter(worker_args), view, saying("distcomm.launch"))
        else:
            failed = wait_until_failure(processes, _GRACE)
        if failed:
            _end(processes, stacks=True)  # before reading the reports: none is written after
            raise _failure(processes, failed, reports, first, getattr(context, "error_files", ())) from None
    finally:  # on every way out, processes still running are ended (those started before an interrupt
        # inside start_processes die with this one: PDEATHSIG)
        _end(processes or (context.processes if context is not None else []))
        shutil.rmtree(reports, ignore_errors=True)
        served = None  # (the store goes with the job)


def _starter(worker_args: tuple[Any, ...]) -> Callable[[int], Any]:
    """What starts process ``index`` again: a replacement, whose output goes to logs of its own."""
    spawn = mp.get_context("spawn")
    attempts: dict[int, int] = {}

    def start(index: int) -> Any:
        attempts[index] = attempts.get(index, 0) + 1
        output = dataclasses.replace(worker_args[-1], attempt=attempts[index])
        process = spawn.Process(target=_worker, args=(index, *worker_args[:-1], output))
        process.start()
        return process

    return start


