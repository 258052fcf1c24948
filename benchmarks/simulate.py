"""Python work per rank per call against world size, up to 1,024 ranks, on one core.

    python benchmarks/simulate.py            (or: make bench-simulate)

One rank's collective runs its real pipeline code (serialize, slots, agreement, routing, plan,
load) while its peers are simulated: their slots and segments are recorded once and replayed, with
the call number patched in. The time the simulated transport spends (replaying slots, copying
bytes into receive buffers) is measured and taken out, so what remains is the rank's own Python
(and the C it calls), as ``time.thread_time``. torch's object collectives run on torch's "fake"
process group, which runs their Python and hallucinates the transfers; its copies of the payload
into the gathered tensor are transport work that this measurement leaves in torch's figure.

Each figure is the largest of the root's, a leaf's (rank 1) and a rank's inside the trees (world
// 2) (torch's: the root's and rank 1's); the last column compares the roots, and the other ranks
(distcomm's larger of rank 1 and world // 2 against torch's rank 1). Each rank's is the least of
three medians (``--rounds``), taken in rounds that alternate distcomm and torch, each over as many
calls as fill about 50 ms: a burst of load on this shared machine then shows in one round, not in
the figure.

The transport's posts are left out of that figure, on both sides, and they are not free: each
point-to-point message a rank posts and waits for costs it tens of microseconds of CPU in gloo,
as does each native collective call. So the table also counts distcomm's posts (point to point,
and native calls such as gloo's all-to-all and broadcast), measures both costs on a 2-rank gloo
group before the run, and adds them: distcomm's posts at those costs, and torch's native calls
(two per object collective, three for scatter_object_list) at the native cost. Beyond 4 ranks
the header exchange runs the gloo communicator's own code, with the ranks on machines of 8 (one
machine up to 8 ranks) and gloo's groups stubbed (``HeaderExchange``): its Python (rank 0's table
and summary, the others' table from the summary, posting each native call and waiting for it)
counts as the rank's, and its native calls are counted.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from distcomm import Communicator
from distcomm._calls import OpStats
from distcomm._transfer.header_exchange import (
    SUMMARY_CARRY,
    SUMMARY_CARRY_ACROSS,
    gather_headers,
    header_blocks,
    summarize,
)
from distcomm._transfer.routes import BROADCAST, ROUTES, build_slot
from distcomm._wire import frame as _frame
from distcomm.testing import FakeCommunicator

MiB = 1 << 20
OPS = ["all_gather", "gather", "broadcast", "scatter"]
PAYLOADS = ["dict of 8 floats", "1 MiB array"]


def payload(name: str, rank: int) -> Any:
    if name == "dict of 8 floats":
        return {f"metric_{i}": float(rank + i / 7) for i in range(8)}
    return np.full(MiB // 8, float(rank))


class _Done:
    """A native collective's work that has finished: ``wait`` returns at once."""

    def wait(self, timeout: Any = None) -> bool:
        return True


class _StubGroup:
    """Stands for one of the header exchange's gloo groups: a gather or broadcast posted to it lands
    at once what gloo would (``HeaderExchange._land``) and returns finished work, so the
    communicator's own posting and waiting code runs as on gloo."""

    def __init__(self, ranks: list[int], hx: HeaderExchange) -> None:
        self.ranks, self.hx = ranks, hx

    def gather(self, outs: list[list[torch.Tensor]], ins: list[torch.Tensor], opts: Any) -> _Done:
        self.hx._land("gather", self.ranks, outs)
        return _Done()

    def broadcast(self, bufs: list[torch.Tensor], opts: Any) -> _Done:
        self.hx._land("broadcast", self.ranks, bufs)
        return _Done()


class HeaderExchange:
    """The gloo communicator's header exchange (``gather_headers``), its real code on one rank of a
    world on machines of 8 (one machine up to 8 ranks), with gloo's groups stubbed: each native call
    lands what gloo would from the whole table, and that landing is the transport's time. So the
    exchange's own Python (buffers, views, rank 0's table and summary, the others' table from it,
    posting and waiting) counts as the rank's, and its native calls are counted."""

    def __init__(self, world: int, rank: int) -> None:
        from distcomm import GlooCommunicator

        c: Any = object.__new__(GlooCommunicator)
        c._world, c._rank, c._opts_made, c._cur = world, rank, {}, OpStats()
        c._obj_group = c._local_group = _StubGroup(list(range(world)), self)
        c._new_group = lambda ranks, backend: _StubGroup(ranks, self)
        machines = [list(range(m, min(m + 8, world))) for m in range(0, world, 8)]
        c._summary_carry = SUMMARY_CARRY if len(machines) == 1 else SUMMARY_CARRY_ACROSS  # as set-up sets it
        c._set_header_blocks(header_blocks(world, machines), None)
        self.comm, self.world, self.rank = c, world, rank
        self.table, self.size = b"", 0
        self.carry = b""  # the segments of rank 0's broadcast that follow its slot (see gather_headers)
        self.transport_s, self.native = 0.0, 0
        self._landings: dict[int, tuple[Any, Any, Any]] = {}

    def _land(self, kind: str, ranks: list[int], outs: list[Any]) -> None:
        t0 = time.thread_time()
        size, table = self.size, self.table
        if kind == "gather" and outs:  # this rank is the root: every member's slots land, in one step
            landing = self._landings.get(id(outs))
            if landing is None:
                landing = self._landings[id(outs)] = self._landing(ranks, outs[0], size)
            into, at, rows = landing
            into[at] = np.frombuffer(table, dtype=np.uint8).reshape(-1, size)[rows]
        elif kind == "broadcast" and self.rank != 0:  # rank 0's summary, or its table
            buf = outs[0].numpy()
            if outs[0].data_ptr() != self.comm._header_bufs[size].summary.data_ptr():  # the table
                buf[:] = np.frombuffer(table, dtype=np.uint8)
            else:
                summary = memoryview(bytearray(buf.size))
                odd = summarize(table, self.world, size, summary)
                if odd == 0 and 0 < len(self.carry) <= self.comm._summary_carry:
                    summary[8 + 2 * size : 8 + 2 * size + len(self.carry)] = self.carry  # rank 0's broadcast
                buf[:] = np.frombuffer(summary, dtype=np.uint8)
        self.native += 1
        self.transport_s += time.thread_time() - t0

    def _landing(self, ranks: list[int], outs: list[torch.Tensor], size: int) -> tuple[Any, Any, Any]:
        """Where a gather's slots land (rows of the buffer behind ``outs``, which the exchange
        reuses from call to call) and which rows of the table they are."""
        blocks = self.comm._blocks
        up = len(blocks) > 1 and ranks == [b[0] for b in blocks]  # rank 0 gathers the blocks' tables
        at, rows = [], []
        for r, out in zip(ranks, outs, strict=True):
            block = next(b for b in blocks if b[0] == r) if up else [r]
            at += [out.storage_offset() // size + j for j in range(len(block))]
            rows += block
        into = torch.empty(0, dtype=torch.uint8).set_(outs[0].untyped_storage())
        return into.numpy().reshape(-1, size), np.array(at), np.array(rows)

    def __call__(self, slot: bytearray, size: int, table: bytes, carry: Any,
                 root_carry: bytes) -> tuple[memoryview, Any]:
        """This rank's exchange of ``slot`` where every rank's slots are ``table`` (and rank 0's
        broadcast segments after its slot ``root_carry``)."""
        self.table, self.size, self.carry = table, size, root_carry
        return gather_headers(self.comm, slot, size, None, carry)


class SimCommunicator(FakeCommunicator):
    """A FakeCommunicator whose peers' bytes are recorded on the first call and replayed after."""

    def __init__(self, rank: int, world_size: int, name: str) -> None:
        objs = [payload(name, r) for r in range(world_size)]
        super().__init__(rank, world_size, peers=lambda op, r, obj: objs if op == "scatter" else objs[r])
        self.objs = objs
        self.transport_s = 0.0
        self.p2p = 0  # point-to-point posts: each a Python call into the transport, and a wait
        self.native = 0  # native collectives (gloo's all-to-all, broadcast): one call each
        self._native = False
        self._tape: dict[tuple[int, int, int], tuple[bytes, dict[int, list[memoryview]]]] = {}
        self._hx: HeaderExchange | None = None

    def _exchange_slots(self, slot: bytearray, size: int, timeout: float | None,
                        carry: Any = (), own: Any = ()) -> tuple[memoryview, Any]:
        t0 = time.thread_time()
        assert self._call is not None
        op, root = self._call.op, self._call.root
        key = (int(op), root, size)
        if key not in self._tape:
            raw = super()._allgather_slots(slot, size, timeout, own)
            self._tape[key] = (bytes(raw), {s: list(q) for s, q in self._pending.items()})
        else:
            self._count(size * (self.world_size - 1), size * (self.world_size - 1))
        raw_bytes, streams = self._tape[key]
        buf = bytearray(raw_bytes)
        heads = np.frombuffer(buf, dtype=_frame._header_dtype(size), count=self.world_size)
        heads["seq"] = self._seq
        buf[self.rank * size : (self.rank + 1) * size] = slot
        self._pending = {s: deque(q) for s, q in streams.items()}
        for _s, q in self._pending.items():  # the sub-slots and slots in the streams carry the call number too
            for i, v in enumerate(q):
                if v.nbytes >= _frame.HEADER_SIZE and bytes(v[:4]) == _frame.MAGIC:
                    patched = bytearray(v)
                    np.frombuffer(patched, dtype=_frame._header_dtype(v.nbytes), count=1)["seq"] = self._seq
                    q[i] = memoryview(patched)
        if self.world_size > 4:  # gloo's header exchange, its own code (its transport taken out)
            hx = self._hx
            if hx is None:
                hx = self._hx = HeaderExchange(self.world_size, self.rank)
            hx.transport_s, hx.native = 0.0, 0
            table = bytes(buf)  # what the stubbed transport lands from
            root_carry = self._root_carry(op, root, size)
            t1 = time.thread_time()
            raw, alike = hx(slot, size, table, carry, root_carry)
            t0 += time.thread_time() - t1 - hx.transport_s  # the exchange's Python is the rank's own
            self.native += hx.native
            self.transport_s += time.thread_time() - t0
            return raw, alike
        self.native += 1  # gloo's all-to-all
        self.transport_s += time.thread_time() - t0
        return memoryview(buf), None

    def _carried(self, root: int, total: int) -> memoryview | None:
        return None if self._hx is None else self._hx.comm._carried(root, total)  # type: ignore[no-any-return]

    def _root_carry(self, op: Any, root: int, size: int) -> bytes:
        """The segments of rank 0's broadcast that follow its slot, as rank 0 would carry them."""
        if self.rank == 0 or root != 0 or ROUTES[op] is not BROADCAST:
            return b""
        key = (-1, root, size)
        if key not in self._tape:
            _, parts, mine = build_slot(op, 1, 0, 0, [self.serializer.dumps(self.objs[0])], size)
            later = b"".join(bytes(s) for s, (_, inline) in zip(parts[0], mine.parts[0], strict=True) if inline is None)
            self._tape[key] = (later, {})
        return self._tape[key][0]

    def _exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]],
                  timeout: float | None) -> None:
        if self._native:  # inside _alltoallv, which times itself
            super()._exchange(sends, recvs, timeout)
            return
        t0 = time.thread_time()
        super()._exchange(sends, recvs, timeout)
        self.p2p += len(sends) + len(recvs)
        self.transport_s += time.thread_time() - t0

    def _one_post(self, move: Callable[[], None]) -> None:
        """A transport step gloo runs as one native call (its messages posted in C++): one post,
        its whole time taken out as transport."""
        t0 = time.thread_time()
        self._native = True
        try:
            move()
        finally:
            self._native = False
        self.native += 1
        self.transport_s += time.thread_time() - t0

    def _alltoallv(self, send: torch.Tensor, send_counts: list[int], recv: torch.Tensor, recv_counts: list[int],
                   timeout: float | None) -> None:
        self._one_post(lambda: FakeCommunicator._alltoallv(self, send, send_counts, recv, recv_counts, timeout))

    def _broadcast_buffer(self, buf: torch.Tensor, root: int, timeout: float | None) -> None:
        self._one_post(lambda: FakeCommunicator._broadcast_buffer(self, buf, root, timeout))

    def _scatter_slots(self, root: int, subs: list[bytearray], size: int, timeout: float | None) -> torch.Tensor | None:
        if self.world_size <= 4:  # as gloo: a message per rank in small worlds, else a native scatter
            return super()._scatter_slots(root, subs, size, timeout)
        got: list[torch.Tensor | None] = []
        self._one_post(lambda: got.append(FakeCommunicator._scatter_slots(self, root, subs, size, timeout)))
        return got[0]


def call(comm: Any, op: str, obj: Any, objs: list[Any]) -> Callable[[], Any]:
    """One collective through the base class's method: the pipeline a gloo rank runs, without the
    FakeCommunicator's recording of calls (test bookkeeping no real communicator does)."""
    if op == "all_gather":
        return lambda: Communicator.all_gather(comm, obj)
    if op == "gather":
        return lambda: Communicator.gather(comm, obj, dst=0)
    if op == "broadcast":
        return lambda: Communicator.broadcast(comm, obj, src=0)
    return lambda: Communicator.scatter(comm, objs if comm.rank == 0 else None, src=0)


def _reps(first: float, reps: int) -> int:
    """``reps``, or with 0 as many calls as fill about 50 ms (5 to 300), from the first call's time."""
    return reps if reps > 0 else max(5, min(300, int(0.05 / max(first, 1e-6))))


def distcomm_time(world: int, rank: int, op: str, name: str, reps: int) -> tuple[float, int, int]:
    """The rank's Python per call (median), and its point-to-point and native transport posts."""
    comm = SimCommunicator(rank, world, name)
    fn = call(comm, op, comm.objs[rank], comm.objs)
    t0 = time.thread_time()
    fn()  # records the peers
    times = []
    for _ in range(_reps(time.thread_time() - t0, reps)):
        comm.transport_s, comm.p2p, comm.native = 0.0, 0, 0
        t0 = time.thread_time()
        fn()
        times.append(time.thread_time() - t0 - comm.transport_s)
    return statistics.median(times), comm.p2p, comm.native


TORCH_NATIVE = {"all_gather": 2, "gather": 2, "broadcast": 2, "scatter": 3}
"""The native collectives torch's object collective calls: sizes then data (scatter_object_list:
a broadcast of the largest size, then two scatters)."""


def _post_costs_worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    group = dist.new_group([0, 1])
    peer = 1 - rank
    send, recv, buf = (torch.zeros(n, dtype=torch.uint8) for n in (64, 64, 300))
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0

    def exchange() -> None:
        for w in [group.recv([recv], peer, 0), group.send([send], peer, 0)]:
            w.wait()

    def native() -> None:
        group.broadcast([buf], opts).wait()

    res = {}
    for key, fn in (("p2p", exchange), ("native", native)):
        for _ in range(50):
            fn()
        cpu = []
        for _ in range(30):
            dist.barrier(group)
            c0 = time.thread_time()
            for _ in range(20):
                fn()
            cpu.append((time.thread_time() - c0) / 20)
        res[key] = statistics.median(cpu)
    if rank == 0:
        with open(out, "w") as f:
            f.write(f"{res['p2p'] / 2} {res['native']}")
    dist.destroy_process_group()


def post_costs() -> tuple[float, float]:
    """CPU per point-to-point post (half of a send-and-receive exchange with its waits) and per
    native collective call (a 300-byte broadcast with its wait), on a 2-rank gloo group over
    127.0.0.1: the transport work the simulation leaves out, measured on this machine."""
    import os
    import socket
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "costs")
        mp.spawn(_post_costs_worker, args=(port, out), nprocs=2)
        with open(out) as f:
            p2p, native = (float(x) for x in f.read().split())
    return p2p, native


class _Replay:
    """torch's broadcast and scatter as a non-root rank meets them on the fake group: the call runs
    (torch's Python and the fake group's C++, as on a real rank), then the bytes the root sent land
    in the tensor, replayed from a recording of the root's call, as the simulation replays
    distcomm's peers. Landing them is transport work: its time is counted in ``transport_s``."""

    def __init__(self) -> None:
        import torch.distributed.distributed_c10d as c10d

        self.c10d = c10d
        self.tape: list[torch.Tensor] = []
        self.record_for: int | None = None  # on the root: record what this rank receives
        self.at = 0
        self.transport_s = 0.0

    def _land(self, tensor: torch.Tensor, sent: torch.Tensor) -> None:
        t0 = time.thread_time()
        if self.record_for is not None:
            self.tape.append(sent.clone())
        else:
            tensor.copy_(self.tape[self.at])
            self.at += 1
        self.transport_s += time.thread_time() - t0

    def __enter__(self) -> _Replay:
        broadcast, scatter = self.c10d.broadcast, self.c10d.scatter
        self.saved = broadcast, scatter

        def replay_broadcast(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            work = broadcast(tensor, *args, **kwargs)
            self._land(tensor, tensor)
            return work

        def replay_scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
                           *args: Any, **kwargs: Any) -> Any:
            work = scatter(tensor, scatter_list, *args, **kwargs)
            self._land(tensor, tensor if scatter_list is None or self.record_for is None
                       else scatter_list[self.record_for])
            return work

        self.c10d.broadcast, self.c10d.scatter = replay_broadcast, replay_scatter
        return self

    def __exit__(self, *exc: object) -> None:
        self.c10d.broadcast, self.c10d.scatter = self.saved


def torch_time(world: int, rank: int, op: str, name: str, reps: int) -> float:
    """torch's Python for one call on the fake process group, transfers left out.

    The fake group hallucinates what a broadcast's or scatter's non-root receives, which it then
    can't use; there the root's call is recorded first and what it sent is replayed into the
    non-root's tensors (``_Replay``), the copy's time taken out."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    obj, root_obj = payload(name, rank), payload(name, 0)
    objs = [payload(name, r) for r in range(world)] if op == "scatter" else []

    def run(me: int) -> None:
        if op == "all_gather":
            dist.all_gather_object([None] * world, obj)
        elif op == "gather":
            dist.gather_object(obj, [None] * world if me == 0 else None, dst=0)
        elif op == "broadcast":
            dist.broadcast_object_list([root_obj if me == 0 else None], src=0)
        else:
            dist.scatter_object_list([None], objs if me == 0 else None, src=0)

    replay = _Replay() if op in ("broadcast", "scatter") and rank != 0 else None
    if replay is not None:  # the root's call, recorded for ``rank``
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            replay.record_for = rank
            with replay:
                run(0)
            replay.record_for = None
        finally:
            dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        with replay if replay is not None else contextlib.nullcontext():
            def timed() -> float:
                if replay is not None:
                    replay.at, replay.transport_s = 0, 0.0
                t0 = time.thread_time()
                run(rank)
                return time.thread_time() - t0 - (replay.transport_s if replay is not None else 0.0)

            first = timed()
            return statistics.median(timed() for _ in range(_reps(first, reps)))
    finally:
        dist.destroy_process_group()


def ms(x: float) -> str:
    return f"{x * 1e6:.1f} µs" if x < 1e-4 else f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.2f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, nargs="+", default=[2, 8, 64, 256, 1024])
    ap.add_argument("--op", choices=OPS, action="append")
    ap.add_argument("--payload", choices=PAYLOADS, action="append")
    ap.add_argument("--reps", type=int, default=0, help="calls per median (default: about 50 ms of them, 5 to 300)")
    ap.add_argument("--rounds", type=int, default=3, help="each figure is the least of this many medians")
    ap.add_argument("--no-post-costs", action="store_true", help="skip measuring the transport's posts on gloo")
    args = ap.parse_args()
    p2p_s, native_s = (0.0, 0.0) if args.no_post_costs else post_costs()
    print(f"transport posts, measured on a 2-rank gloo group here: {p2p_s * 1e6:.0f} µs of CPU per point-to-point "
          f"post, {native_s * 1e6:.0f} µs per native collective call\n")
    print("| payload | op | world | distcomm | torch | distcomm/torch "
          "| distcomm posts: p2p + native (costliest rank) | with posts: distcomm | with posts: torch "
          "| with posts: distcomm/torch | by rank, distcomm/torch: root / others |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.payload or PAYLOADS:
        for op in args.op or OPS:
            for world in args.world:
                ranks = sorted({0, 1, world // 2})  # the root, a leaf, and a rank inside the trees
                # rounds of both, in turn: a burst of load on this machine shows in one round, not in the least
                runs = [([distcomm_time(world, r, op, name, args.reps) for r in ranks],
                         [torch_time(world, r, op, name, args.reps) for r in (0, 1)]) for _ in range(args.rounds)]
                ours = [min((rnd[0][i] for rnd in runs), key=lambda x: x[0]) for i in range(len(ranks))]
                torch_ranks = [min(ts) for ts in zip(*(rnd[1] for rnd in runs), strict=True)]  # root, rank 1
                theirs = max(torch_ranks)
                by_role = (f"{ours[0][0] / torch_ranks[0]:.2f} / "
                           f"{max(t for t, _, _ in ours[1:]) / torch_ranks[1]:.2f}")
                mine = max(t for t, _, _ in ours)
                # the posts of the rank whose work, posts included, is the largest (what the last columns show)
                with_ours, p2p, native = max((t + p * p2p_s + n * native_s, p, n) for t, p, n in ours)
                with_theirs = theirs + TORCH_NATIVE[op] * native_s
                print(f"| {name} | {op} | {world} | {ms(mine)} | {ms(theirs)} | {mine / theirs:.2f} | "
                      f"{p2p} + {native} | {ms(with_ours)} | {ms(with_theirs)} | {with_ours / with_theirs:.2f} "
                      f"| {by_role} |",
                      flush=True)


if __name__ == "__main__":
    main()
