"""``python -m distcomm run``: one agent per machine that starts the machine's workers as torchrun
does (its flags for the common cases, its variables), serves the job's store from the first
machine's agent, and keeps the survivors when a worker is lost: it is started again as a
replacement (``--replacements``) while the others go on (they ``shrink()``, then ``admit()`` it).

A plain torch script runs under it unchanged: the workers see torchrun's variables, and torch's
``env://`` rendezvous asks the agent's store (``TORCHELASTIC_USE_AGENT_STORE``). A worker that
exits non-zero or crashes fails the job (the others are ended, as torchrun does); one killed
(SIGKILL, SIGTERM) in a job that uses distcomm's rendezvous is lost, and the job goes on without
it (``_fails_the_job``); one killed before any worker met the others is started again, in any job,
and takes its place in the first meeting.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import math
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import CommunicatorStateError
from .._trust.key import KEY_FILE_VAR, KEY_VAR, job_key, key_given, new_key
from .._trust.records import Records
from .launchers import LAUNCHER_VAR, RUN_AGENT
from .ports import free_port
from .rank_output import Tail, log_name, pass_through
from .rendezvous import serve_store
from .supervise import JobStore, how_it_ended, saying, wait_elastic

__all__ = ["Job", "UsageError", "run_job"]

_GRACE = 2.0  # seconds the other workers get once one failed, before they are ended (as launch())
_say = saying("distcomm run")


@dataclasses.dataclass(frozen=True)
class Job:
    """What ``python -m distcomm run`` was asked to run: the workers of this machine and the job."""

    command: tuple[str, ...]  # the worker's command after the interpreter: a script or -m module, and its args
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: a free one (one machine only)
    replacements: int = 0
    log_dir: str | None = None
    prefix: bool = True
    timeout: float = 600.0
    term_grace: float = 30.0  # seconds a worker has to end once told to (SIGTERM), before SIGKILL

    @property
    def world(self) -> int:
        return self.nproc_per_node * self.nnodes

    def problem(self) -> str:
        """What is wrong with the job before anything starts ("" where nothing is)."""
        for name in ("nproc_per_node", "nnodes"):
            if getattr(self, name) < 1:
                return f"--{name.replace('_', '-')} must be 1 or more"
        if not 0 <= self.node_rank < self.nnodes:
            return f"--node-rank {self.node_rank} is out of range for --nnodes {self.nnodes}"
        if self.replacements < 0:
            return "--replacements must be 0 or more"
        if self.nnodes > 1 and self.master_port == 0:
            return "a job of several machines needs --master-port (and --master-addr: the first machine's address)"
        if not 0 <= self.term_grace < math.inf:
            return f"--term-grace must be 0 or more seconds, got {self.term_grace}"
        if not 0 <= self.master_port < 65536:
            return f"--master-port {self.master_port} is not a port"
        try:
            keyed = job_key() is not None
        except ValueError as e:
            return str(e)
        if self.nnodes > 1 and self.replacements and not keyed:
            return (f"--replacements let processes into a running job, and only holders of the job's key come in: "
                    f"give every machine's agent the same one ({KEY_VAR}, 16 or more characters, or {KEY_FILE_VAR}); "
                    f"a job on one machine makes its own")
        return ""


class UsageError(ValueError):
    """What the command line was given can't work (a port another process holds, a log folder that
    is a file), found as the agent starts, before any worker: said as a usage error."""


class _Worker:
    """One worker process, as ``wait_elastic`` watches one (``exitcode``, ``sentinel``, ``pid``,
    ``is_alive``, ``terminate``, ``kill``, ``join``), with its output passed through as it comes."""

    def __init__(self, job: Job, rank: int, attempt: int, env: dict[str, str], lock: threading.Lock) -> None:
        log = None if job.log_dir is None else open(os.path.join(job.log_dir, log_name(rank, attempt)), "w",
                                                    encoding="utf-8", errors="replace")
        # a session of its own, as torchrun starts one: the kernel's autogroup then schedules each worker
        # apart from the rest of the terminal's, and its process group holds what it starts (ended with it)
        self._popen = subprocess.Popen([sys.executable, *job.command], env=env, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, preexec_fn=_die_with_the_agent, start_new_session=True)
        self.pid, self.rank = self._popen.pid, rank
        self.sentinel = os.pidfd_open(self.pid)  # readable once the process ends: waited on with the others
        tag = f"[rank{rank}]: " if job.prefix else ""
        self.stderr_tail = Tail()  # (a traceback's end: what it raised)
        streams = ((self._popen.stdout, sys.stdout, None), (self._popen.stderr, sys.stderr, self.stderr_tail))
        self._copies = [threading.Thread(target=pass_through, args=(os.dup(pipe.fileno()), out, tag, log, lock, tail),
                                         daemon=True) for pipe, out, tail in streams if pipe is not None]
        for pipe, _, _ in streams:
            if pipe is not None:
                pipe.close()  # (its copy is the one read)
        for t in self._copies:
            t.start()
        self._log = log

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the worker's process group (it and what it started), while it runs."""
        if self.is_alive():
            try:
                os.killpg(self.pid, signum)
            except ProcessLookupError:  # (it ended meanwhile)
                pass

    def terminate(self) -> None:
        self.signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the worker's process group, whether or not the worker itself still runs: what it
        started lives on in its session, where no hang-up or death signal reaches (the group's id
        isn't given to another process while any of its members lives)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def drain(self) -> None:
        """After it ended: its output copied to the end (what sums it up is in it; the summary comes
        after it). Bounded: a process it started may hold its pipes open."""
        deadline = time.monotonic() + 5.0
        for t in self._copies:
            t.join(max(deadline - time.monotonic(), 0.0))

    def finish(self) -> None:
        """After it ended: its output copied to the end, its log and its descriptor closed."""
        self.drain()
        if self._log is not None:
            self._log.close()
        os.close(self.sentinel)


_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def _die_with_the_agent() -> None:
    """In the worker, before its program starts: the kernel kills it when the agent dies (killed
    with SIGKILL, it leaves no orphan). Only a call prepared beforehand: the agent has threads."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def worker_env(job: Job, local_rank: int, run_id: str, key: str | None) -> dict[str, str]:
    """The variables torchrun sets for a worker, so that a torch script (and ``from_env()``) runs as under it,
    and the job's ``key`` where this agent made it (else the worker inherits the agent's)."""
    rank = job.node_rank * job.nproc_per_node + local_rank
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(job.world),
           "LOCAL_WORLD_SIZE": str(job.nproc_per_node), "GROUP_RANK": str(job.node_rank),
           "GROUP_WORLD_SIZE": str(job.nnodes), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(job.world),
           "ROLE_NAME": "default", "MASTER_ADDR": job.master_addr, "MASTER_PORT": str(job.master_port),
           "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
           "TORCHELASTIC_USE_AGENT_STORE": "True", "PYTHONUNBUFFERED": "1", LAUNCHER_VAR: RUN_AGENT}
    if job.nproc_per_node > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: n processes sharing the cores
    if key is not None:
        env[KEY_VAR] = key
    return env


def run_job(job: Job) -> int:
    """Run this machine's workers of ``job``; the exit status: 0 when the job finished (every worker
    exited 0, but those lost while the others went on), else 1, the failure named. The agents of
    the other machines beat in the job's store until they end, so that the first machine's, which
    serves it, serves it until then (``_AgentBeat``)."""
    if job.master_port == 0:
        job = dataclasses.replace(job, master_port=free_port())
    _make_log_dir(job.log_dir)
    url = f"tcp://{job.master_addr}:{job.master_port}"
    try:
        store = serve_store(url, job.world, job.timeout) if job.node_rank == 0 else None
    except CommunicatorStateError:
        raise UsageError(f"--master-port {job.master_port}: another process listens on it; give every machine's "
                         f"agent a free port") from None
    beat = _AgentBeat(job) if job.node_rank > 0 else None
    code = 1
    try:
        code = _run_workers(job, store, url)
        return code
    finally:
        if beat is not None:
            beat.end(code)


def _make_log_dir(path: str | None) -> None:
    if path is None:
        return
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--log-dir {path}: {e.strerror.lower() if e.strerror else e}") from None


def _run_workers(job: Job, store: Any, url: str) -> int:
    lock = threading.Lock()
    first = job.node_rank * job.nproc_per_node
    attempts = [0] * job.nproc_per_node
    started: list[_Worker] = []
    made = new_key() if job.nnodes == 1 else None  # (across machines, the one every agent was given)

    def start(local: int) -> _Worker:
        worker = _Worker(job, first + local, attempts[local], worker_env(job, local, "none", made), lock)
        attempts[local] += 1
        started.append(worker)
        return worker

    # (a signal already ignored stays so: under nohup, a hang-up doesn't end the job)
    previous = {signum: signal.signal(signum, _as_interrupt) for signum in _PASSED_ON
                if signal.getsignal(signum) is not signal.SIG_IGN}
    job_name = _named_job(store) if store is not None and job.nnodes > 1 else ""
    try:
        workers = [start(i) for i in range(job.nproc_per_node)]
        view = JobStore(store, url, key_given(made))
        def fails(i: int, code: int) -> bool:
            replacements_left = job.replacements - (sum(attempts) - job.nproc_per_node)
            return _fails_the_job(code, view, replacements_left > 0)

        failed = wait_elastic(workers, _GRACE, fails, first, job.replacements, start, view, _say)
        if failed:
            _stop(workers, signal.SIGTERM, job.term_grace)
            _drain(started)
            _say(_failure_line(failed, workers, first))
            return 1
        others = _serve_until_the_others_end(store, job_name, job.nnodes) if job_name else {}
        _drain(started)
        return _verdict(started, others)
    except KeyboardInterrupt as e:
        signum = e.signum if isinstance(e, _Signalled) else signal.SIGINT
        _say(f"{signal.Signals(signum).name}: passed on to the workers, who have {job.term_grace:g} s to end "
             f"before SIGKILL")
        _stop(started, signum, job.term_grace)
        return 128 + signum
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        _stop(started, signal.SIGTERM, job.term_grace)
        for w in started:
            w.finish()
        store = None


def _drain(workers: Sequence[_Worker]) -> None:
    for w in workers:
        w.drain()


def _verdict(started: Sequence[_Worker], others: dict[int, int | None]) -> int:
    """Said and returned: 0 where the job finished (here, or on another machine where every worker
    here was lost), 1 where every worker here was lost and no other machine finished."""
    last = {w.rank: w for w in started}  # (each rank's last process: a replacement where one was started)
    finished = sum(w.exitcode == 0 for w in last.values())
    lost = [w for w in started if (w.exitcode or 0) < 0]
    told = "".join(f", rank {w.rank} (pid {w.pid}, {how_it_ended(w.exitcode or 0)}"
                   f"{'' if last[w.rank] is w else '; started again'})" for w in lost).removeprefix(", ")
    if not finished and 0 not in others.values():
        _say(f"the job failed: every worker here was lost: {told}")
        return 1
    where = " on the other machines" if not finished else ""
    _say(f"the job finished{where}: {finished} of {len(last)} workers here finished" +
         (f", {len(lost)} lost: {told}" if lost else ""))
    return 0


_BEAT_SECONDS = 1.0  # how often another machine's agent says it still runs
_SILENT_SECONDS = 60.0  # an agent whose beat stood still this long is gone (its machine died, it was SIGKILLed)


_JOB_RECORD = "distcomm-run/job"
"""Where the first machine's agent says this job's name: a random one, so that the other agents'
records of an earlier job (signed with the same key) can't be replayed into this one."""


def _beat_key(job_name: str, node: int) -> str:
    return f"distcomm-run/{job_name}/agent/{node}/beat"


def _ended_key(job_name: str, node: int) -> str:
    return f"distcomm-run/{job_name}/agent/{node}/ended"


class _AgentBeat:
    """The beat of an agent on a machine other than the first, in the job's store, and its exit
    status once it ends: the first machine's agent serves the store until every other one ended.
    Both are records signed with the job's key, under the job's random name: a process that
    reaches the store's port can't forge them, nor replay an earlier job's."""

    def __init__(self, job: Job) -> None:
        self._host, self._port, self._node = job.master_addr, job.master_port, job.node_rank
        self._key = job_key()
        self._records: Records | None = None
        self._job_name: str | None = None
        self._beats = 0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="distcomm-run-beat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stopped.wait(_BEAT_SECONDS):
            self._beats += 1
            self._tell(_beat_key, str(self._beats))

    def end(self, code: int) -> None:
        """Say this agent ended, with ``code``."""
        self._stopped.set()
        self._thread.join(10.0)
        self._tell(_ended_key, str(code))

    def _tell(self, name: Callable[[str, int], str], value: str) -> None:
        """Write the record ``name(job name, node)``, connected first where it isn't (the first
        machine's agent may start later); nothing where it can't be now (a later beat tries again)."""
        try:
            if self._records is None:
                store = torch._C._distributed_c10d.TCPStore(self._host, self._port, is_master=False,
                                                            timeout=datetime.timedelta(seconds=5))
                self._records = Records(store, self._key, "")
            if self._job_name is None:
                said = self._records.read(_JOB_RECORD)
                self._job_name = None if said is None else said.decode("ascii", "replace")
            if self._job_name is not None:
                self._records.set(name(self._job_name, self._node), value)
        except Exception:
            self._records = None


def _named_job(store: Any) -> str:
    """This job's random name, said in its store (by the first machine's agent)."""
    name = secrets.token_hex(8)
    Records(store, job_key(), "").set(_JOB_RECORD, name)
    return name


def _serve_until_the_others_end(store: Any, job_name: str, nnodes: int) -> dict[int, int | None]:
    """Keep serving the job's store, which the other machines' workers use, until every other agent
    ended or fell silent; their exit statuses (None: fell silent). Only the records signed with the
    job's key under its name count (``_AgentBeat``)."""
    _say("serving the job's store until the other machines' agents end")
    records = Records(store, job_key(), "")
    heard = {k: (-1, time.monotonic()) for k in range(1, nnodes)}
    ended: dict[int, int | None] = {}
    while len(ended) < nnodes - 1:
        for k in heard.keys() - ended.keys():
            said = records.read(_ended_key(job_name, k))
            if said is not None:
                ended[k] = _number(said, default=1)
                continue
            count = _number(records.read(_beat_key(job_name, k)) or b"0", default=0)
            if count > heard[k][0]:
                heard[k] = (count, time.monotonic())
            elif time.monotonic() - heard[k][1] > _SILENT_SECONDS:
                _say(f"the agent of machine {k} fell silent {_SILENT_SECONDS:g} s ago: taken for ended")
                ended[k] = None
        time.sleep(_BEAT_SECONDS)
    return ended


def _number(said: bytes, default: int) -> int:
    text = said.decode("ascii", "replace")
    return int(text) if text.lstrip("-").isdigit() else default


def _stop(workers: Sequence[_Worker], signum: int, grace: float) -> None:
    """Send ``signum`` to the workers still running, wait up to ``grace`` seconds for them to end
    (one saving a checkpoint in its handler needs the time), then SIGKILL those left. A second
    interrupt while waiting cuts the wait short."""
    alive = [w for w in workers if w.is_alive()]
    for w in alive:
        w.signal(signum)
    deadline = time.monotonic() + grace
    try:
        for w in alive:
            w.join(max(deadline - time.monotonic(), 0.0))
    except KeyboardInterrupt:
        pass
    for w in alive:
        w.kill()
        w.join(5.0)


def _fails_the_job(code: int, job: JobStore, replaceable: bool) -> bool:
    """Whether a worker's end fails the job: it exited non-zero (it raised), it crashed (a signal
    other than SIGKILL or SIGTERM: SIGSEGV, SIGABRT, ...), or it was killed in a job whose workers
    don't use distcomm's membership (a plain torch script: its survivors could only wait for it),
    unless no worker met anyone yet and it can be ``replaceable`` (started again, it takes its place
    in the first meeting). Else it is lost, and the others go on."""
    if code > 0 or (code < 0 and -code not in (signal.SIGKILL, signal.SIGTERM)):
        return True
    if code == 0 or job.uses_membership():
        return False
    return not (replaceable and not job.anyone_met())


# Signals that stop the agent, passed on to the workers (in sessions of their own, a terminal's
# Ctrl-C or hang-up no longer reaches them): SIGINT raises KeyboardInterrupt as it is.
_PASSED_ON = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def _as_interrupt(signum: int, frame: Any) -> None:
    raise _Signalled(signum)


class _Signalled(KeyboardInterrupt):
    """A signal that stops the agent: it passes it on to the workers and exits 128 + its number,
    as a process ended by it would say."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_TAG = re.compile(r"^\[rank\d+\]: ?")  # (a worker that tags its own lines)


def _last_words(stderr: str, code: int) -> str:
    """What sums up a failed worker's end from its last words on stderr: the exception its last
    traceback ends with (its first line: a multi-line error's rows follow it), else, for a worker
    that exited non-zero, its last line. One killed by a signal is summed up by the signal alone,
    unless a traceback is the last it wrote (what it wrote earlier, a warning, says nothing of it)."""
    lines = [_TAG.sub("", line) for line in stderr.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last):")]
    raised = next((i for i in range(starts[-1] + 1, len(lines)) if lines[i].strip() and not lines[i][0].isspace()),
                  None) if starts else None
    if raised is not None and (code > 0 or _only_its_message_after(lines, raised)):
        return lines[raised].strip()
    said = [line.strip() for line in lines if line.strip()]
    return said[-1] if said and code > 0 else ""


def _only_its_message_after(lines: list[str], raised: int) -> bool:
    """Whether the exception line at ``raised`` ends the output, but for its message's own lines
    (indented, as distcomm's tables and chained notes are)."""
    return all(not line.strip() or line[0].isspace() for line in lines[raised + 1:])


def _failure_line(failed: dict[int, tuple[int, float]], workers: Sequence[_Worker], first: int) -> str:
    """The worker that failed first, and the others that did, in one line each."""
    order = sorted(failed, key=lambda i: failed[i][1])
    lines = [f"rank {first + i} (pid {workers[i].pid}) {how_it_ended(failed[i][0])}" for i in order]
    said = _last_words(workers[order[0]].stderr_tail.text, failed[order[0]][0])  # (the others': what they saw of it)
    lines[0] += f": {said}" if said else ""
    return "the job failed: " + lines[0] + "".join(f"\n  then rank {line.removeprefix('rank ')}" for line in lines[1:])

