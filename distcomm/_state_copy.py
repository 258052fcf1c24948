"""One rank's state handed to another: its tensors raw, into the receiver's own.

The source sends a *header* per receiver: each object's state with its dense tensors cut out (the
skeleton: keys, numbers, strings, param_groups) and what each cut-out tensor is (dtype, shape,
device, a DTensor's layout). The skeleton goes through the safe loader, as any state did: a peer
can send wrong numbers, never code. The receiver checks the header (known dtypes, sizes it can
hold), picks where each tensor lands, and says "go" (or why not); only then do the tensors' bytes
follow, each straight into its landing place: the receiver's own tensor at the same key where it
has one of that dtype and shape (a model's state_dict aliases its parameters, an optimizer's holds
its state tensors themselves; a DTensor's local shard), else a fresh tensor (a newcomer's Adam has
no moments yet). ``load_state_dict`` then takes what arrived, with no second copy.

What a peer announces is checked before a byte moves: each part's byte count (sent beside the
header) must be its dtype and shape's, so that the receiver posts buffers of exactly the sizes that
come; a tensor lands only where the receiver's state has a tensor or nothing (never in place of a
learning rate). Where the communicator authenticates, the header also carries each part's digest
(SHA-256 or blake2b, whichever this CPU hashes faster, under the header's MAC): the bytes are
checked in scratch memory before they go on.

Fresh tensors are bounded before any is allocated: by ``max_bytes`` where the communicator has one,
else by this machine's memory. A transport that records messages as objects (the fake) takes the
tensors inside the header instead (``Communicator._moves_bytes``).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import hmac
import math
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.parameter import is_lazy

from ._errors import PayloadTooLargeError, SerializationError, is_rank_loss
from ._handles import as_caller
from ._sharded import is_dtensor, layout_of, like, local_of, local_shape
from ._wire.memory import PHYSICAL_MEMORY
from ._wire.serialization import AuthenticatedSerializer

if TYPE_CHECKING:
    from ._communicator import Communicator

__all__ = ["leaves", "load_parts", "rebuilt", "receive_state", "send_parts", "send_state", "sendable"]

_STATE_TAG = 0x3FFF_5A7E  # (tags are below 2**30)
_ANSWER_TAG = 0x3FFF_5A7F
_BYTES_TAG = 0x3FFF_5A80

_NOT_SENT = "distcomm: the state was not sent"
"""What the source sends in place of the state it couldn't serialize: the receivers then fail the
call with the others, instead of waiting for a state that never comes."""

_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}
_MAX_DIMS = 64

Spec = tuple[int, str, tuple[int, ...], str, "str | None"]
"""A cut-out tensor: its leaf's number in the skeleton, dtype, shape, device type, DTensor layout."""


# ---------------------------------------------------------------- the state as a tree
def _descends(node: Any) -> bool:
    """The containers a skeleton is cut through (the safe loader rebuilds each as it was); what
    else holds tensors travels whole, inside the skeleton."""
    return isinstance(node, dict) or type(node) in (list, tuple)


def leaves(state: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every leaf of ``state`` with its path, in one order on both sides (a dict's own order)."""
    if _descends(state):
        for k, v in (state.items() if isinstance(state, dict) else enumerate(state)):
            yield from leaves(v, (*path, k))
    else:
        yield path, state


def _key(path: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple((type(k), k) for k in path)  # (0 is not "0", nor True 1)


def rebuilt(node: Any, leaf: Callable[[Any], Any]) -> Any:
    """``node`` with each leaf replaced by ``leaf(it)``, in ``leaves``' order: dicts copied (with
    what a state dict carries beside its items, ``_metadata``), lists and tuples made anew."""
    if isinstance(node, dict):
        out = copy.copy(node)
        for k, v in node.items():
            out[k] = rebuilt(v, leaf)
        return out
    if type(node) in (list, tuple):
        return type(node)(rebuilt(v, leaf) for v in node)
    return leaf(node)


def sendable(t: Any) -> bool:
    """A tensor whose bytes are its values: it travels raw (the others inside the skeleton)."""
    if not isinstance(t, torch.Tensor) or is_lazy(t):
        return False
    local = local_of(t)
    return (type(local) in (torch.Tensor, torch.nn.Parameter) and local.layout == torch.strided
            and not (local.is_quantized or local.is_nested or local.is_meta or local.is_conj() or local.is_neg()))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


# ---------------------------------------------------------------- the source
def _cut(state: Any) -> tuple[Any, list[Spec], list[torch.Tensor]]:
    """The skeleton of ``state``, its specs, and the bytes of the tensors cut out (CPU, in order)."""
    specs: list[Spec] = []
    parts: list[torch.Tensor] = []
    count = iter(range(1 << 62))

    def leaf(value: Any) -> Any:
        n = next(count)
        if not sendable(value):
            return value
        local = local_of(value).detach()
        layout = layout_of(value) if is_dtensor(value) else None
        specs.append((n, str(local.dtype).removeprefix("torch."), tuple(local.shape), local.device.type, layout))
        parts.append(_as_bytes(local.cpu().contiguous()))
        return None

    return rebuilt(state, leaf), specs, parts


def send_state(comm: Communicator, states: list[Any], to: dict[int, list[int]], raw: bool) -> str | None:
    """The source's part: the objects each rank in ``to`` needs, to all of them at once; where they
    can't be serialized (nothing went), why, said to that rank in their place, and returned."""
    if len(to) == 1:
        [(r, which)] = to.items()
        return _send_to(comm, r, [states[i] for i in which], raw)
    with ThreadPoolExecutor(len(to), thread_name_prefix="distcomm-state") as pool:
        sends = [pool.submit(as_caller(functools.partial(_send_to, comm, r, [states[i] for i in which], raw)))
                 for r, which in to.items()]
    failed = [e for e in (s.exception() for s in sends) if e is not None]
    if failed:  # a lost rank breaks the communicator, and the other sends fail on that: the loss is raised
        raise next((e for e in failed if is_rank_loss(e)), failed[0])
    return next((said for said in (s.result() for s in sends) if said is not None), None)


def _send_to(comm: Communicator, r: int, states: list[Any], raw: bool) -> str | None:
    cuts = [_cut(state) for state in states] if raw else [(state, [], []) for state in states]
    return send_parts(comm, r, [(skeleton, specs) for skeleton, specs, _ in cuts],
                      [p for _, _, ps in cuts for p in ps], raw)


def send_parts(comm: Communicator, r: int, header: list[Any], parts: list[torch.Tensor],
               raw: bool = True) -> str | None:
    """Send a state already cut (``header``: each object's skeleton and specs; ``parts``: the
    tensors' bytes, in the specs' order) to rank ``r``, which takes it with ``receive_state``; why
    it couldn't be serialized, or None. Beside the header go each part's exact byte count (the
    receiver posts no buffer of another size: gloo aborts the process on a longer message, and
    leaves a shorter one's rest unwritten) and, where the communicator authenticates, each part's
    digest: the header's MAC then covers the bytes too."""
    parts = [_as_bytes(p) for p in parts] if raw else []
    name = _faster_digest()
    digests = (name, [_digest(p, name) for p in parts]) if _authenticated(comm) else None
    try:
        comm.isend((header, [p.numel() for p in parts], digests), r, tag=_STATE_TAG).wait()
    except (SerializationError, PayloadTooLargeError) as e:
        comm.isend((_NOT_SENT, str(e)), r, tag=_STATE_TAG).wait()
        return str(e)
    if raw and comm.recv(r, tag=_ANSWER_TAG) is None:  # (else it refused, and says why in the call's end)
        comm._send_message(r, _BYTES_TAG, [p for p in parts if p.numel()], comm._op_timeout(None))
    return None


def _authenticated(comm: Communicator) -> bool:
    return isinstance(comm.serializer, AuthenticatedSerializer)


def _digest(part: torch.Tensor, name: str) -> bytes:
    """A part's bytes' digest (collision resistant: inside the MAC'd header, it binds the bytes)."""
    return hashlib.new(name, part.detach().numpy().data).digest()


@functools.cache
def _faster_digest() -> str:
    """SHA-256 where this CPU has instructions for it (x86's SHA-NI, Arm's SHA2: 2-3x blake2b's
    speed), else blake2b: every byte of a newcomer's state is hashed on both sides, on the members'
    path. The sender names it in the MAC'd header; the receiver takes either."""
    sample = bytes(1 << 20)
    took = {}
    for name in _DIGESTS:
        start = time.perf_counter()
        hashlib.new(name, sample).digest()
        took[name] = time.perf_counter() - start
    return min(took, key=took.__getitem__)


_DIGESTS = ("sha256", "blake2b")


# ---------------------------------------------------------------- the receiver
class _Landing:
    """Where one tensor's bytes land (``buf``, this rank's CPU memory) and what the state then holds
    there (``value``): the receiver's own tensor, or a fresh one; ``then`` copies a staged one on."""

    def __init__(self, buf: torch.Tensor, value: Any, then: Callable[[], object] | None = None, *,
                 in_place: bool = False) -> None:
        self.buf, self.value, self.then, self.in_place = buf, value, then, in_place


def receive_state(comm: Communicator, objects: tuple[Any, ...], states: list[Any], src: int, which: list[int],
                  raw: bool, load: Callable[[Any, Any], None]) -> str | None:
    """The receiver's part: take the objects ``which`` from ``src`` and load them; why it couldn't,
    or None. A rank lost on the way is raised (the call fails as for any lost rank). Whatever this
    rank refuses or fails at before the bytes (a malformed header, no room) is answered: ``src``
    never waits to send bytes that no one takes."""
    try:
        got = comm.recv(src, tag=_STATE_TAG)
    except Exception as e:  # (the safe loader refused it, ...: the call fails on every rank)
        if is_rank_loss(e):
            raise
        return _answered(comm, src, raw, f"{type(e).__name__}: {e}")
    if isinstance(got, tuple) and got[:1] == (_NOT_SENT,):
        return f"rank {src} could not send it: {got[1]}"
    try:
        header, sizes, digests = _unwrapped(got, raw, _authenticated(comm))
        landings = _landings(comm, header, [states[i] for i in which], objects, sizes)
    except Exception as e:  # (_Refused, or torch refusing to allocate: answered all the same)
        return _answered(comm, src, raw, str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}")
    _answered(comm, src, raw, None)
    if raw:
        why = _take_bytes(comm, src, [_as_bytes(land.buf) for lands in landings for land in lands.values()],
                          digests)
        if why is not None:
            return why
    return _loaded([objects[i] for i in which], [states[i] for i in which], header, landings, load)


class _Refused(ValueError):
    """Why this rank refuses a header (its text is the reason, as the call's error gives it)."""


def _unwrapped(got: Any, raw: bool, authenticated: bool) -> tuple[Any, list[int], tuple[str, list[bytes]] | None]:
    """The header, each part's byte count and digests, where they are what ``send_parts`` sends."""
    if not (isinstance(got, tuple) and len(got) == 3 and isinstance(got[1], list)
            and all(type(n) is int for n in got[1]) and (got[2] is None or isinstance(got[2], tuple))):
        raise _Refused("the state's header is malformed")
    header, sizes, digests = got
    if authenticated and raw and not (isinstance(digests, tuple) and len(digests) == 2 and digests[0] in _DIGESTS
                                      and isinstance(digests[1], list) and len(digests[1]) == len(sizes)
                                      and all(isinstance(d, bytes) for d in digests[1])):
        raise _Refused("the state's header carries no digest of each tensor's bytes (SHA-256 or blake2b): this "
                       "communicator authenticates the bytes too")
    return header, sizes, digests if authenticated and raw else None


def _take_bytes(comm: Communicator, src: int, bufs: list[torch.Tensor],
                digests: tuple[str, list[bytes]] | None) -> str | None:
    """The parts' bytes into ``bufs`` (each of the size the header said, checked: ``_landings``).
    Authenticated, each arrives in scratch memory first and goes on only where its digest is the
    one the MAC'd header gave: bytes changed on the way never become state (a part that came
    before a changed one is in place: authentic, but the call fails)."""
    timeout = comm._op_timeout(None)
    if digests is None:
        comm._recv_message(src, _BYTES_TAG, [b for b in bufs if b.numel()], timeout)
        return None
    scratch = torch.empty(max((b.numel() for b in bufs), default=0), dtype=torch.uint8)
    changed = []
    name, expected = digests
    for i, (buf, digest) in enumerate(zip(bufs, expected, strict=True)):
        got = scratch[:buf.numel()]
        if buf.numel():  # (every part taken, changed or not: the sender's sends all end)
            comm._recv_message(src, _BYTES_TAG, [got], timeout)
        if hmac.compare_digest(_digest(got, name), digest):
            buf.copy_(got)
        else:
            changed.append(i)
    if changed:
        return (f"the bytes of {len(changed)} tensor(s) (the first: part {changed[0]}) don't match the digest in "
                f"the authenticated header: they were changed on the way")
    return None


def load_parts(comm: Communicator, objects: tuple[Any, ...], states: list[Any], header: list[Any],
               parts: list[torch.Tensor], load: Callable[[Any, Any], None]) -> str | None:
    """Load a state this rank holds cut (a snapshot of its own: ``send_parts``' arguments) into
    ``objects``, its tensors into their own, as ``receive_state`` does; why it couldn't, or None."""
    try:
        landings = _landings(comm, header, states, objects, [p.numel() * p.element_size() for p in parts])
    except Exception as e:  # (_Refused, or torch refusing to allocate)
        return str(e) if isinstance(e, _Refused) else f"{type(e).__name__}: {e}"
    bufs = [_as_bytes(lands[spec[0]].buf) for (_, specs), lands in zip(header, landings, strict=True)
            for spec in specs]
    for buf, part in zip(bufs, parts, strict=True):
        buf.copy_(part)
    return _loaded(list(objects), states, header, landings, load)


def _loaded(objects: list[Any], own_states: list[Any], header: list[Any], landings: list[dict[int, _Landing]],
            load: Callable[[Any, Any], None]) -> str | None:
    """Load each object's state, its tensors as they landed; why it couldn't, or None. A plain
    module (``_plain_module``) whose every parameter and buffer landed in its own memory, under the
    keys it has, holds its state already: its ``load_state_dict`` would copy each onto itself
    (through DTensor's dispatch where FSDP shards it: tens of milliseconds in a newcomer's fresh
    process, on the members' path), so it isn't called."""
    try:
        for obj, own, (skeleton, _), lands in zip(objects, own_states, header, landings, strict=True):
            state = _filled(skeleton, lands)
            if not (_plain_module(obj) and _all_in_place(skeleton, lands) and _same_keys(skeleton, own)):
                load(obj, state)
    except Exception as e:  # (a load_state_dict of the user's: whatever it raises)
        return f"{type(e).__name__}: {e}"
    return None


_MODULE_OWN = ("state_dict", "load_state_dict", "_save_to_state_dict", "_load_from_state_dict", "get_extra_state",
               "set_extra_state")
_FSDP_HOOKS = ("FSDPParamGroup._register_state_dict_hooks.<locals>.to_sharded_hook",
               "FSDPParam.__init__.<locals>.<lambda>")
"""FSDP2's state-dict hooks: the shards made current before a save or a load (the state's own
``state_dict()`` ran them), the padded shard re-read after a load (the same memory: nothing to do)."""


def _plain_module(obj: Any) -> bool:
    """Whether ``obj`` is a module whose state dict is its own parameters and buffers, saved and
    loaded as torch's ``Module`` does: none of its modules overrides how, and no hook but FSDP2's
    runs around it."""
    if not isinstance(obj, torch.nn.Module):
        return False
    for m in obj.modules():
        if any(getattr(type(m), name) is not getattr(torch.nn.Module, name) for name in _MODULE_OWN):
            return False
        if m._state_dict_hooks or not all(_fsdp_hook(h) for hooks in (
                m._state_dict_pre_hooks, m._load_state_dict_pre_hooks, m._load_state_dict_post_hooks)
                for h in hooks.values()):
            return False
    return True


def _fsdp_hook(hook: Any) -> bool:
    return getattr(getattr(hook, "hook", hook), "__qualname__", "") in _FSDP_HOOKS


def _same_keys(skeleton: Any, own: Any) -> bool:
    """Whether the state sent has the keys of this rank's own (a strict load's check)."""
    return isinstance(skeleton, dict) and isinstance(own, dict) and list(skeleton) == list(own)


def _all_in_place(skeleton: Any, lands: dict[int, _Landing]) -> bool:
    """Whether every leaf of a state is a tensor that landed in the receiver's own tensor's memory."""
    return all(n in lands and lands[n].in_place for n, _ in enumerate(leaves(skeleton)))


def _answered(comm: Communicator, src: int, raw: bool, why: str | None) -> str | None:
    """Tell ``src``, which waits to send the bytes, to go (``why`` None) or why not; returns ``why``."""
    if raw and comm._broken is None:  # (a broken pair's stream is lost anyway)
        comm.send(why, src, tag=_ANSWER_TAG)
    return why


def _filled(skeleton: Any, landings: dict[int, _Landing]) -> Any:
    """The skeleton with each tensor that arrived in its place (staged ones copied on first)."""
    count = iter(range(1 << 62))

    def leaf(value: Any) -> Any:
        land = landings.get(next(count))
        if land is None:
            return value
        if land.then is not None:
            land.then()
        return land.value

    return rebuilt(skeleton, leaf) if landings else skeleton


def _landings(comm: Communicator, header: Any, own_states: list[Any], objects: tuple[Any, ...],
              sizes: list[int]) -> list[dict[int, _Landing]]:
    """Where each announced tensor lands, per object (by leaf number). Raises _Refused where this
    rank refuses the header: malformed, a dtype it doesn't know, a tensor where this rank's state
    holds something else, a part whose byte count (``sizes``, what the source sends) isn't its
    spec's, more fresh memory than it may allocate (checked before any is allocated)."""
    if not (isinstance(header, list) and len(header) == len(own_states)
            and all(isinstance(h, tuple) and len(h) == 2 and isinstance(h[1], list) for h in header)):
        raise _Refused("the state's header is malformed")
    if len(sizes) != sum(len(specs) for _, specs in header):
        raise _Refused(f"the state's header announces {len(sizes)} parts for its tensors' bytes, not one each")
    models = _own_dtensors(own_states, objects)
    plans: list[dict[int, Callable[[], _Landing]]] = []
    fresh, numbered = 0, iter(sizes)
    for (skeleton, specs), own_state in zip(header, own_states, strict=True):
        own = dict(_nodes(own_state))
        at = dict(enumerate(path for path, _ in leaves(skeleton)))
        plans.append({})
        for spec in specs:
            n, _, _, _, layout = checked = _checked(spec, at, plans[-1], next(numbered))
            mine = own.get(_key(at[n]))
            if not (mine is None or isinstance(mine, torch.Tensor)):  # (lr, a step count: never a tensor)
                raise _Refused(f"a tensor is announced at {_shown(at[n])}, where this rank's state holds a "
                               f"{type(mine).__name__}")
            planned = _land(comm, checked, mine, models)
            if planned is None:
                raise _Refused(f"this rank has no DTensor laid out as {layout} to hold the shard announced")
            fresh += planned[0]
            plans[-1][n] = planned[1]
    cap = PHYSICAL_MEMORY if comm.max_bytes is None else min(comm.max_bytes, PHYSICAL_MEMORY)
    if fresh > cap:
        raise _Refused(f"the state needs {fresh} bytes of fresh tensors here, over {_cap_name(comm)}")
    return [{n: make() for n, make in plan.items()} for plan in plans]


def _nodes(state: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    """Every node of ``state`` (containers too) by its path's key."""
    yield _key(path), state
    if _descends(state):
        for k, v in (state.items() if isinstance(state, dict) else enumerate(state)):
            yield from _nodes(v, (*path, k))


def _shown(path: tuple[Any, ...]) -> str:
    return repr(".".join(map(str, path)))


def _cap_name(comm: Communicator) -> str:
    return "this machine's memory" if comm.max_bytes is None else f"max_bytes={comm.max_bytes}"


_MAX_BYTES = 1 << 62
"""No tensor announced may span more (its dims' product with zeros taken as ones, in bytes): a zero
dim beside a huge one is no tensor torch can make."""


def _checked(spec: Any, at: dict[int, tuple[Any, ...]], taken: dict[int, Any], size: int) -> Spec:
    """``spec`` where it is well formed, names a leaf the skeleton left empty, once, and its bytes
    (``size``: what the source sends) are its dtype and shape's; else raises _Refused."""
    if not (isinstance(spec, tuple) and len(spec) == 5):
        raise _Refused("a tensor's announcement is malformed")
    n, dtype, shape, device, layout = spec
    if type(n) is not int or n in taken or n not in at:
        raise _Refused(f"a tensor's announcement names no free leaf of the state ({n!r})")
    if dtype not in _DTYPES or device not in ("cpu", "cuda") or not (layout is None or isinstance(layout, str)):
        raise _Refused(f"a tensor's announcement is not one this rank can hold: {dtype!r} on {device!r}")
    if not (isinstance(shape, tuple) and len(shape) <= _MAX_DIMS and all(type(s) is int and s >= 0 for s in shape)
            and _span(shape, _DTYPES[dtype].itemsize) <= _MAX_BYTES):
        raise _Refused(f"a tensor's shape is malformed: {shape!r}")
    if size != math.prod(shape) * _DTYPES[dtype].itemsize:
        raise _Refused(f"a tensor announced as {dtype} {shape} comes as {size} bytes")
    return n, dtype, shape, device, layout


def _span(shape: tuple[int, ...], itemsize: int) -> int:
    """The dims' product (zeros as ones) times ``itemsize``, stopping once over ``_MAX_BYTES``."""
    span = itemsize
    for s in shape:
        span *= max(s, 1)
        if span > _MAX_BYTES:
            break
    return span


def _own_dtensors(own_states: list[Any], objects: tuple[Any, ...]) -> dict[str, Any]:
    """This rank's DTensors by layout (its states', its optimizers' parameters'): what a fresh shard
    (a newcomer's Adam moment) is laid out as."""
    found: dict[str, Any] = {}
    for t in state_tensors(own_states, objects):
        if is_dtensor(t):
            found.setdefault(layout_of(t), t)
    return found


def state_tensors(states: list[Any], objects: tuple[Any, ...]) -> Iterator[Any]:
    """The tensors of ``states`` and the parameters of optimizers among ``objects``."""
    for state in states:
        yield from (t for _, t in leaves(state) if isinstance(t, torch.Tensor))
    for obj in objects:
        for group in getattr(obj, "param_groups", None) or ():
            yield from (p for p in group.get("params", ()) if isinstance(p, torch.Tensor))


def _land(comm: Communicator, spec: Spec, own: Any,
          models: dict[str, Any]) -> tuple[int, Callable[[], _Landing]] | None:
    """How many fresh bytes a tensor takes, and where it will land: into ``own`` (the receiver's
    tensor at its key) where its dtype, shape and layout match, through a staging copy where that
    isn't contiguous CPU memory; else into a fresh tensor (a DTensor's laid out as its model)."""
    _, dtype_name, shape, device, layout = spec
    dtype = _DTYPES[dtype_name]
    size = math.prod(shape) * dtype.itemsize
    if own is not None and sendable(own) and (layout_of(own) if is_dtensor(own) else None) == layout:
        local = local_of(own).detach()
        if local.dtype == dtype and tuple(local.shape) == shape:
            if local.device.type == "cpu" and local.is_contiguous():
                return 0, lambda: _Landing(local, own, in_place=True)
            return size, lambda: _staged(local, own)
    if layout is not None and (layout not in models or local_shape(models[layout]) != shape):
        return None
    target = comm._cuda_target() if device == "cuda" else None
    return size, lambda: _fresh(dtype, shape, target, models.get(layout) if layout else None)


def _staged(local: torch.Tensor, own: Any) -> _Landing:
    staged = torch.empty(local.shape, dtype=local.dtype)
    return _Landing(staged, own, lambda: local.copy_(staged), in_place=True)


def _fresh(dtype: torch.dtype, shape: tuple[int, ...], target: torch.device | None, model: Any) -> _Landing:
    """A fresh tensor (on ``target`` where the sender's was on a GPU: copied on once the bytes
    arrived), a DTensor laid out as ``model`` where it is one."""
    buf = torch.empty(shape, dtype=dtype)
    value = buf if target is None else torch.empty(shape, dtype=dtype, device=target)
    then = None if target is None else (lambda: value.copy_(buf))
    return _Landing(buf, value if model is None else like(model, value), then)
