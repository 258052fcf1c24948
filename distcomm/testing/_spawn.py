"""spawn(): a real multi-process world on 127.0.0.1 for tests, results back in rank order."""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import cloudpickle

from .._errors import DistCommError, RankFailedError
from .._launch import free_port

__all__ = ["spawn"]

_R = TypeVar("_R")


def _spawn_worker(rank: int, world: int, url: str, payload: bytes, out: Any, backend: str, timeout: float) -> None:
    try:
        from .._context import use
        from .._torch import GlooCommunicator, NcclCommunicator, start_world

        fn, comm_kwargs = cloudpickle.loads(payload)
        comm_kwargs.setdefault("timeout", timeout)
        cls = GlooCommunicator if backend == "gloo" else NcclCommunicator
        comm = start_world(cls, url, rank, world, rank, **comm_kwargs)
        with comm, use(comm):
            result = fn(comm)
        out.put((rank, True, cloudpickle.dumps(result), ""))
    except BaseException as e:
        tb = traceback.format_exc()
        try:
            blob: bytes | None = cloudpickle.dumps(e)
            cloudpickle.loads(blob)  # an exception whose __init__ can't be replayed doesn't come back
        except Exception:
            blob = None
        out.put((rank, False, blob, f"{type(e).__name__}: {e}\n{tb}"))


def spawn(fn: Callable[[Any], _R], world_size: int, *, backend: str = "gloo", timeout: float = 120.0,
          return_exceptions: bool = False, **comm_kwargs: Any) -> list[Any]:
    """Run ``fn(comm)`` in ``world_size`` real processes over torch.distributed on 127.0.0.1.

    Each process initializes a process group on a free local port, builds a GlooCommunicator (or
    NcclCommunicator with backend="nccl"), installs it with ``use()`` and calls ``fn(comm)``.
    ``fn`` may be a lambda or closure (cloudpickle); its return values come back in rank order.

    Args:
        fn: the per-rank function.
        world_size: number of processes.
        backend: "gloo" or "nccl".
        timeout: seconds for the whole world; also the communicators' collective timeout.
        return_exceptions: put each failed rank's RankFailedError in the result list instead of
            raising.
        comm_kwargs: passed to each communicator (serializer=, max_bytes=, ...).

    Raises:
        RankFailedError: a rank raised (its exception and remote traceback are attached), died,
            or did not finish within ``timeout`` (it is named and killed).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive, got {timeout}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    url = f"tcp://127.0.0.1:{free_port()}"
    payload = cloudpickle.dumps((fn, comm_kwargs))
    procs = [ctx.Process(target=_spawn_worker, args=(r, world_size, url, payload, out, backend, timeout),
                         name=f"distcomm-rank-{r}", daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, bytes | None, str]] = {}
    dead_since: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, blob, text = out.get(timeout=0.1)
                got[rank] = (ok, blob, text)
                continue
            except queue_mod.Empty:
                pass
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in got and not p.is_alive():
                    if now - dead_since.setdefault(r, now) > 1.0:
                        got[r] = (False, None, f"process exited with code {p.exitcode} before returning")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(5)
        out.close()
    errors: dict[int, RankFailedError] = {}
    results: list[Any] = [None] * world_size
    for r in range(world_size):
        if r not in got:
            errors[r] = RankFailedError(f"rank {r} did not finish within {timeout}s and was killed", rank=r)
            continue
        ok, blob, text = got[r]
        try:
            value = cloudpickle.loads(blob) if blob is not None else None
        except Exception as load_error:  # a result or exception that pickles but doesn't load here
            if ok:
                ok, text = False, f"{type(load_error).__name__}: rank {r}'s result can't be loaded here: {load_error}"
            value = None
        if ok:
            results[r] = value
        else:
            exc = value if isinstance(value, BaseException) else None
            first = text.split("\n")[0]
            errors[r] = RankFailedError(f"rank {r}: {first}", rank=r, exception=exc, remote_traceback=text)
    if errors and return_exceptions:
        for r, e in errors.items():
            results[r] = e
        return results
    if errors:
        causes = [r for r, e in errors.items() if not isinstance(e.exception, DistCommError)] or sorted(errors)
        r = causes[0]
        main = errors[r]
        others = "".join(f"\n  {e}" for o, e in sorted(errors.items()) if o != r)
        raise RankFailedError(
            f"{main}" + (f"\nother ranks:{others}" if others else "") + f"\n--- rank {r} traceback ---\n"
            f"{main.remote_traceback}",
            rank=r, exception=main.exception, remote_traceback=main.remote_traceback,
            errors={o: e.exception or e for o, e in errors.items()})
    return results
