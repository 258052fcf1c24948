"""The three steps of an object collective, the same on every rank, over one ``CallSpec``:

1. Serialize this rank's object into parts and exchange one fixed-size slot per rank (its header
   and the segments that fit). Every rank now knows every rank's sizes, failures and what it
   called, so all ranks take the same decision: raise the same error, or go on.
2. The route moves the segments that did not fit into buffers of their exact size.
3. Each receiver deserializes; out-of-band buffers become the results' memory.

The route (``_routes``) says how each kind of collective's objects travel; the communicator's
transport hooks move the bytes.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .._agreement import agree, agreed_by_sums, agreement_vector
from .._calls import CallSpec, Op
from .._errors import CollectiveError, FrameError, SerializationError
from .._wire import frame as _frame
from .._wire.memory import GC_PAUSE_BYTES, GCPause, is_aligned, owned_copy
from .._wire.serialization import serializer_for
from .._wire.tensor_pickle import CUDA_TARGET
from .routes import ROUTES, Route, Segment, over_max_bytes, status_outgoing

if TYPE_CHECKING:
    from .._communicator import Communicator

__all__ = ["load", "run"]

_SETUP = Op.SETUP


def run(comm: Communicator, spec: CallSpec) -> list[Any]:
    """Run one collective; returns a list indexed by rank (entries this rank did not get: None).

    With ``spec.inline``, every rank's 8 bytes as ints (with ``spec.carries``, every rank's payload
    as a row of a (world, bytes) uint8 array); with ``serialize=False`` otherwise, [].
    """
    comm._call = spec
    try:
        return _run(comm, spec)
    finally:  # the call's objects are the user's: nothing keeps them once it returns
        comm._call = None


def _run(comm: Communicator, spec: CallSpec) -> list[Any]:
    op, root, timeout = spec.op, spec.root, spec.timeout
    counted_as = spec.counted_as
    st = comm._stat(counted_as)
    comm._op_label = counted_as.label
    route = ROUTES[op]
    t0 = time.perf_counter()
    size = comm._slot_size if spec.slot_size is None else spec.slot_size
    parts, status, message = _serialize(comm, route, spec)
    # Counted only now: an interrupt while pickling (KeyboardInterrupt) leaves this rank as if it
    # had never called, instead of one call ahead of its peers.
    comm._seq += 1
    seq = comm._seq
    if spec.stat is None:
        st.calls += 1
    comm._cur = st
    if status == _frame.OK:
        out = route.build(comm, spec, seq, parts, size)
    else:
        out = status_outgoing(spec, seq, status, message, size)
    t1 = time.perf_counter()
    st.serialize_s += t1 - t0

    if comm._agrees_by_reduction and op is not _SETUP:
        words = spec.inline or b""
        vector = agreement_vector(int(op), seq, root, spec.digest, status == _frame.OK, words)
        if agreed_by_sums(comm._agreement_sums(vector, timeout), comm.world_size) and not spec.serialize:
            # an agreement-only call, and every rank agrees (on its 8 bytes too, where it sends some): done
            st.transfer_s += time.perf_counter() - t1
            return [] if spec.inline is None else [_frame.I64.unpack(words)[0]] * comm.world_size
    raw, alike = comm._exchange_slots(out.slot, size, timeout,
                                      route.carried(comm, root, out) if route.carries else (),
                                      route.own_slots(comm, root, out) if route.sends_own_slots else ())
    slots = _frame.Slots(raw, size, comm.rank, out.mine)
    # max_bytes caps serialized payloads (set-up precedes agreement on it; inline words aren't payloads)
    cap = comm.max_bytes if spec.serialize and op is not _SETUP else None
    # where the exchange didn't say which slots are alike (``alike``): the slot every rank but
    # ``odd`` sends when all is well, where it is known, to compare the slots with as bytes
    common, odd = None, -1
    if alike is None:
        if route.expects_common:
            common, odd = route.expected_slot(comm, spec, seq, out, size)
        elif not spec.serialize and spec.inline is None:
            common = out.slot
    if not _frame.agreed(raw, comm.world_size, size, out.slot, digests=spec.on_digest_mismatch is not None,
                         cap=cap, common=common, odd=odd, alike=alike):
        _disagreement(comm, spec, seq, out.message, raw, slots, size, cap)
    if not spec.serialize:
        st.transfer_s += time.perf_counter() - t1
        if spec.carries and spec.inline is not None:
            return _frame.inline_payloads(raw, comm.world_size, size, len(spec.inline))  # type: ignore[return-value]  # (an array: its rows)
        return [] if spec.inline is None else list(_frame.inline_words(raw, comm.world_size, size).tolist())

    try:
        incoming, packed = route.move(comm, spec, seq, out, slots, size)
    except BaseException as e:
        # Whatever stops this rank here (a corrupt table only it decodes, memory, Ctrl-C) leaves
        # its peers mid-transfer: the ranks no longer agree on what was sent.
        comm._mark_broken(f"{op.label} #{seq}: {type(e).__name__} while moving data: {str(e)[:160]}")
        raise
    t2 = time.perf_counter()
    st.transfer_s += t2 - t1

    results: list[Any] = [None] * comm.world_size
    results[comm.rank] = route.own_result(comm, root, spec.obj)
    if incoming:  # a broadcast's or scatter's root loads nothing
        _load_all(comm, route, op, seq, incoming, packed, results)
    st.deserialize_s += time.perf_counter() - t2
    return results


def _serialize(comm: Communicator, route: Route, spec: CallSpec) -> tuple[list[list[memoryview]], int, str]:
    """This rank's parts, or the status and message of why it can't take part."""
    if comm._misused is not None:  # reported to every rank, at every call (see _one_at_a_time)
        return [], _frame.INVALID, f"{comm._misused}; this communicator fails every later collective"
    if spec.problem is not None:
        return [], spec.status, spec.problem
    if not spec.serialize:
        return ([[memoryview(spec.inline)]] if spec.inline is not None else []), _frame.OK, ""
    parts, status, message = route.serialize(comm, spec.root, spec.obj, comm.rank)
    # set-up precedes agreement on max_bytes
    if status == _frame.OK and spec.op is not _SETUP and comm.max_bytes is not None:
        over = over_max_bytes(comm, sum(s.nbytes for p in parts for s in p))
        if over is not None:
            return parts, _frame.TOO_LARGE, over
    return parts, status, message


def _disagreement(comm: Communicator, spec: CallSpec, seq: int, message: str, raw: memoryview,
                  slots: _frame.Slots, size: int, cap: int | None) -> None:
    """The slots' quick check failed: raise the same error on every rank, naming who differs."""
    try:
        heads = _frame.headers(raw, comm.world_size, size)
    except FrameError as e:
        raise FrameError(f"{spec.op.label} #{seq}: a slot is corrupt: {e}", op=spec.op.label) from e
    agree(comm, spec.op, seq, spec.root, heads, slots, message, spec.timeout, cap)
    if spec.on_digest_mismatch is not None and (heads["digest"] != heads["digest"][0]).any():
        spec.on_digest_mismatch()


def _load_all(comm: Communicator, route: Route, op: Op, seq: int, incoming: dict[int, list[Segment]],
              packed: dict[int, bool], results: list[Any]) -> None:
    token = CUDA_TARGET.set(comm._cuda_target)
    try:
        if sum([view.nbytes for v in incoming.values() for view, _ in v]) >= GC_PAUSE_BYTES:
            with GCPause():
                _load_each(comm, route, op, seq, incoming, packed, results)
        else:  # (small results: no pause, and no context manager's two calls)
            _load_each(comm, route, op, seq, incoming, packed, results)
    finally:
        CUDA_TARGET.reset(token)


def _load_each(comm: Communicator, route: Route, op: Op, seq: int, incoming: dict[int, list[Segment]],
               packed: dict[int, bool], results: list[Any]) -> None:
    for src, segs in incoming.items():
        results[route.lands_at(comm, src)] = load(comm, op, seq, src, segs, packed[src])


def load(comm: Communicator, op: Op, seq: int, src: int, segs: list[Segment], packed: bool) -> Any:
    """Deserialize one rank's segments (inline views or received tensors)."""
    # The segments become the results' memory (a serializer may keep them). Those that came
    # inline in the slot are copied out of it: the slot buffers are the transport's, reused by
    # the next call (and may be read-only); out-of-band buffers into aligned memory. Buffers that
    # landed at an unaligned offset of a shared receive buffer are copied too (an all-to-all
    # lands them back to back): every out-of-band buffer starts at a multiple of 64.
    if packed:
        inline = segs[0][1]
        views = _frame.unpack(segs[0][0])
        views[1:] = [owned_copy(v) if inline or not is_aligned(v) else v for v in views[1:]]
        if inline:
            views[0] = memoryview(bytearray(views[0]))
    else:
        stream, inline = segs[0]
        views = [memoryview(bytearray(stream)) if inline else stream]
        if len(segs) > 1:
            views += [owned_copy(v) if inline or not is_aligned(v) else v for v, inline in segs[1:]]
    try:
        return serializer_for(comm).loads(views)
    except CollectiveError as e:
        e.args = (f"{op.label} #{seq}: can't load the object from rank {src}: {e}",)
        e.op, e.ranks = op.label, (src,)
        raise
    except Exception as e:
        raise SerializationError(
            f"{op.label} #{seq}: can't load the object from rank {src}: {type(e).__name__}: {e}",
            op=op.label, ranks=[src],
        ) from e
