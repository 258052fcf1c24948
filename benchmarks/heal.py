"""sync_state handing a trained state to newcomers, beside torch's broadcast of the same tensors.

    python benchmarks/heal.py [--sizes 64 192 1024] [--striped]

The state: a model of Linear(1024, 1024) layers and its Adam after one step (the moments: twice the
model), of about the size asked (MiB). Rank 0 holds it; rank 1 is a newcomer (``_holds_state``
False) with a fresh model and an Adam without moments yet. Timed in the same processes:
- sync_state (newcomer): the newcomer's sync_state (its moments arrive into fresh tensors; 3 runs,
  each with a fresh Adam on the newcomer);
- sync_state (again): the newcomer's state handed over again, now into its own tensors;
- broadcast: ``torch.distributed.broadcast`` of the same tensors from rank 0 over ``comm.group``,
  into the receiver's tensors, one call per tensor, all posted at once (async_op), then waited;
- broadcast, fresh: the same, the receivers allocating the moments first (``torch.empty_like``), as
  a newcomer without them must (beside sync_state's newcomer figure).
Each figure is the fastest of 3 runs (the machine may be shared). Memory: the newcomer's peak resident
memory rise (VmHWM, reset just before) in its first sync_state, beside the state's size.
``--striped``: also 4 ranks, ranks 0 and 1 holding the state and 2 and 3 newcomers: each holder
sends one copy (beside two broadcasts, from rank 0 to each newcomer, in turn).
Prints a markdown table.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import torch
import torch.distributed as dist

import distcomm
from distcomm.testing import spawn

MiB = 1 << 20


def _state(mib: int, holds: bool) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    layers = max(1, round(mib * MiB / (3 * 4 * (1024 * 1024 + 1024))))
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(layers)))
    opt = torch.optim.Adam(model.parameters())
    if holds:  # one step: Adam's moments exist
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def _tensors(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    moments = [t for s in opt.state.values() for k, t in s.items() if k != "step"]
    return [p.detach() for p in model.parameters()] + moments


def _peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:  # (resets VmHWM to the current resident size)
        f.write("5")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def _timed(comm: distcomm.Communicator, fn: Any) -> float:
    comm.synchronize()
    t = time.perf_counter()
    fn()
    comm.synchronize()  # (the last receiver done)
    return time.perf_counter() - t


def _broadcast(comm: distcomm.Communicator, tensors: list[torch.Tensor], src: int, fresh: int = 0) -> None:
    """Broadcast ``tensors``; a receiver allocates the last ``fresh`` of them anew first."""
    if fresh and comm.rank != src:
        tensors = tensors[:-fresh] + [torch.empty_like(t) for t in tensors[-fresh:]]
    works = [dist.broadcast(t, src, group=comm.group, async_op=True) for t in tensors]
    for w in works:
        w.wait()


def _job(comm: distcomm.Communicator, mib: int, holders: int) -> dict[str, Any]:
    holds = comm.rank < holders
    torch.manual_seed(0 if holds else comm.rank)  # (the holders hold one state)
    model, opt = _state(mib, holds)
    comm._holds_state = holds
    comm.synchronize()
    _peak_reset()
    rss = _status("VmRSS")
    first = [_timed(comm, lambda: comm.sync_state(model, opt))]
    rise = _status("VmHWM") - rss
    for _ in range(2):  # a newcomer again: an Adam without moments
        if not holds:
            opt = torch.optim.Adam(model.parameters())
        comm._holds_state = holds
        first.append(_timed(comm, functools.partial(comm.sync_state, model, opt)))
    tensors = _tensors(model, opt)
    size = sum(t.numel() * t.element_size() for t in tensors)
    moments = len(tensors) - len(list(model.parameters()))
    again, bcast, fresh = [], [], []
    for _ in range(3):
        comm._holds_state = holds
        again.append(_timed(comm, lambda: comm.sync_state(model, opt)))
        bcast.append(_timed(comm, lambda: [_broadcast(comm, tensors, 0) for _ in range(comm.world_size - holders)]))
        fresh.append(_timed(comm, lambda: [_broadcast(comm, tensors, 0, moments)
                                           for _ in range(comm.world_size - holders)]))
    return {"first": min(first), "again": min(again), "bcast": min(bcast), "fresh": min(fresh), "rise": rise,
            "size": size}


def _run(world: int, holders: int, mib: int) -> dict[str, Any]:
    out = spawn(lambda comm: _job(comm, mib, holders), world, timeout=300)
    return {**out[0], "rise": max(o["rise"] for o in out[holders:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[64, 192, 1024], help="state sizes, MiB")
    parser.add_argument("--striped", action="store_true", help="also 2 newcomers of 4 ranks")
    args = parser.parse_args()
    runs = [(2, 1, mib) for mib in args.sizes] + ([(4, 2, mib) for mib in args.sizes] if args.striped else [])
    rows = ["| ranks (newcomers) | state | sync_state: newcomer | broadcast, fresh | ratio | sync_state: again "
            "| broadcast | ratio | newcomer's peak memory rise |", "|---|---|---|---|---|---|---|---|---|"]
    for world, holders, mib in runs:
        got = _run(world, holders, mib)
        ms = {k: f"{got[k] * 1e3:.0f} ms" for k in ("first", "fresh", "again", "bcast")}
        rows.append(f"| {world} ({world - holders}) | {got['size'] / MiB:.0f} MiB | {ms['first']} | {ms['fresh']} | "
                    f"{got['first'] / got['fresh']:.2f}x | {ms['again']} | {ms['bcast']} | "
                    f"{got['again'] / got['bcast']:.2f}x | {got['rise'] / MiB:.0f} MiB "
                    f"({got['rise'] / got['size']:.2f} of the state) |")
        print(rows[-1], flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
