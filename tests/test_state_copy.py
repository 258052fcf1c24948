"""sync_state's copy: tensors raw into the receiver's own, fresh ones bounded, and sharded state
(FSDP2 over a 2 x 2 HSDP mesh) handed over within its shard class only."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import distcomm
from distcomm.testing import spawn

from ._helpers import count_calls


def _peak_reset() -> int:
    with open("/proc/self/clear_refs", "w") as f:  # (VmHWM back to the resident size)
        f.write("5")
    return _status("VmRSS")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith(field + ":")).split()[1]) * 1024


def _newcomer(comm: distcomm.Communicator) -> dict[str, Any]:
    """Rank 0 holds a trained model and Adam (24 MiB); rank 1 is a newcomer with a fresh model and
    an Adam without moments."""
    torch.manual_seed(comm.rank)
    model = torch.nn.Sequential(*(torch.nn.Linear(512, 512) for _ in range(8)))
    opt = torch.optim.Adam(model.parameters())
    if comm.rank == 0:
        model(torch.randn(4, 512)).sum().backward()
        opt.step()
    comm._holds_state = comm.rank == 0
    params = {n: (p, p.data_ptr()) for n, p in model.named_parameters()}
    rss = _peak_reset()
    comm.sync_state(model, opt)
    rise = _status("VmHWM") - rss
    comm.check_identical(model, opt)
    moments = [s["exp_avg"] for s in opt.state.values()]
    comm._holds_state = comm.rank == 0  # again: now into its own moments
    comm.sync_state(model, opt)
    return {"rise": rise, "size": 3 * sum(p.numel() * 4 for p in model.parameters()),
            "own": all(p is dict(model.named_parameters())[n] and p.data_ptr() == ptr
                       for n, (p, ptr) in params.items()),
            "moments kept": all(a is s["exp_avg"] for a, s in zip(moments, opt.state.values(), strict=True)),
            "weights": [p.detach().clone() for p in model.parameters()],
            "step": float(opt.state[params["0.weight"][0]]["step"])}


def test_a_newcomer_receives_into_its_own_tensors_within_the_states_size_of_memory() -> None:
    holder, newcomer = spawn(_newcomer, 2, timeout=120)
    assert newcomer["own"] and newcomer["moments kept"], newcomer
    assert all(torch.equal(a, b) for a, b in zip(holder["weights"], newcomer["weights"], strict=True))
    assert newcomer["step"] == 1.0
    assert newcomer["rise"] <= newcomer["size"], (newcomer["rise"], newcomer["size"])


def _over_max_bytes(comm: distcomm.Communicator) -> tuple[str, int]:
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.Adam(model.parameters())
    if comm.rank == 0:
        model(torch.ones(1, 256)).sum().backward()
        opt.step()
    comm._holds_state = comm.rank == 0
    with pytest.raises(distcomm.SerializationError) as caught:
        comm.sync_state(model, opt)
    return str(caught.value), len(opt.state)


def test_fresh_tensors_over_max_bytes_are_refused_before_they_are_allocated() -> None:
    """The moments (512 KiB fresh) are over max_bytes: the newcomer refuses before allocating, the
    source sends nothing more, and the call fails on both ranks, at once."""
    for text, moments in spawn(_over_max_bytes, 2, timeout=60, max_bytes=300 << 10):
        assert "rank(s) [1] could not send or load the state rank 0 holds" in text, text
        assert "fresh tensors here, over max_bytes=307200" in text, text
    assert moments == 0


# ---------------------------------------------------------------- FSDP2, HSDP over 2 x 2
def _fsdp(comm: distcomm.Communicator, repair_holder: bool) -> dict[str, Any]:
    """Ranks (replicate, shard): 0 (0, 0), 1 (0, 1), 2 (1, 0), 3 (1, 1); ranks 0 and 2 hold the same
    shards, 1 and 3 the others. Rank 3 becomes a newcomer (garbled shards, a fresh Adam); with
    ``repair_holder``, rank 2 also garbles one shard (a holder whose state differs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    for step in range(2):
        model(torch.randn(6, 8, generator=torch.Generator().manual_seed(step))).sum().backward()
        opt.step()
        opt.zero_grad()
    locals_ = [p.detach().to_local() for p in model.parameters()]
    if comm.rank == 3:
        with torch.no_grad():
            for t in locals_:
                t.normal_()
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        comm._holds_state = False
    if comm.rank == 2 and repair_holder:
        with torch.no_grad():
            locals_[0].add_(1.0)
    before = [t.clone() for t in locals_] + [s["exp_avg"].to_local().clone() for s in opt.state.values()]
    sends = count_calls(comm, "isend")
    with pytest.raises(distcomm.CollectiveMismatchError) as caught:
        comm.check_identical(model, opt)
    comm.sync_state(model, opt)
    comm.check_identical(model, opt)  # (within each shard class)
    after = [p.detach().to_local().clone() for p in model.parameters()] + \
        [s["exp_avg"].to_local().clone() for s in opt.state.values()]
    model(torch.randn(6, 8, generator=torch.Generator().manual_seed(9))).sum().backward()
    opt.step()  # (the moments handed over are DTensors laid out as their parameters)
    comm.check_identical(model, opt)
    return {"error": str(caught.value), "ranks": caught.value.ranks, "sent": sends[0], "before": before,
            "after": after, "own": all(p.detach().to_local().data_ptr() == t.data_ptr()
                                       for p, t in zip(model.parameters(), locals_, strict=True)),
            "moments": [type(s["exp_avg"]).__name__ for s in opt.state.values()]}


@pytest.mark.parametrize("repair_holder", [False, True])
def test_fsdp2_hsdp_state_goes_to_each_rank_from_a_holder_of_its_own_shards(repair_holder: bool) -> None:
    out = spawn(lambda comm: _fsdp(comm, repair_holder), 4, timeout=180)
    for r in range(4):
        assert out[r]["ranks"] == ((2, 3) if repair_holder else (3,)), out[r]["error"]
        assert out[r]["own"] and out[r]["moments"] == ["DTensor"] * 4, out[r]
    assert "differs from rank 1's" in out[0]["error"], out[0]["error"]
    # the newcomer now holds its class's source's shards, bit for bit; rank 1 sent them
    assert all(torch.equal(a, b) for a, b in zip(out[3]["after"], out[1]["after"], strict=True))
    assert not torch.equal(out[3]["after"][0], out[0]["after"][0])  # (the other class's shards)
    assert out[1]["sent"] == 1 and out[3]["sent"] == 0
    if repair_holder:
        assert "differs from rank 0's" in out[0]["error"], out[0]["error"]
        assert all(torch.equal(a, b) for a, b in zip(out[2]["after"], out[0]["after"], strict=True))
        assert [o["sent"] for o in out] == [1, 1, 0, 0]
    else:  # the other class is untouched, and nothing went to or from it
        for r in (0, 2):
            assert all(torch.equal(a, b) for a, b in zip(out[r]["before"], out[r]["after"], strict=True))
        assert out[0]["sent"] == out[2]["sent"] == 0


# ---------------------------------------------------------------- replicated state across shard classes
def _hsdp(comm: distcomm.Communicator, shape: tuple[int, ...]) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    names = ("replicate", "shard")[-len(shape):]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(6, 8, generator=torch.Generator().manual_seed(0))).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _ahead(opt: Any, progress: dict[str, Any]) -> None:
    progress["step"] = 99
    for group in opt.param_groups:
        group["lr"] = 5.0


def _replicated(comm: distcomm.Communicator) -> dict[str, Any]:
    """2 x 2 HSDP: rank 3 alone a step ahead in its replicated state (its class's rank 1 is right:
    it hands it over); then ranks 1 and 3 both (their class has no holder of the job's)."""
    model, opt = _hsdp(comm, (2, 2))
    progress = {"step": 1}
    if comm.rank == 3:
        _ahead(opt, progress)
    with pytest.raises(distcomm.CollectiveMismatchError) as one:
        comm.check_identical(model, opt, progress)
    comm.sync_state(model, opt, progress)
    synced = (progress["step"], opt.param_groups[0]["lr"])
    comm.check_identical(model, opt, progress)
    if comm.rank in (1, 3):
        _ahead(opt, progress)
    with pytest.raises(distcomm.CollectiveMismatchError) as both:
        comm.check_identical(model, opt, progress)
    with pytest.raises(distcomm.CollectiveMismatchError) as refused:
        comm.sync_state(model, opt, progress)
    return {"one": (str(one.value), one.value.ranks), "synced": synced,
            "both": (str(both.value), both.value.ranks), "refused": (str(refused.value), refused.value.ranks)}


def test_replicated_state_is_compared_and_handed_over_across_shard_classes() -> None:
    for r, out in enumerate(spawn(_replicated, 4, timeout=180)):
        text, ranks = out["one"]
        assert ranks == (3,) and "rank(s) [3] differs from rank 0's; first at object 1 (Adam), key 'param_groups" \
            in text, (r, text)
        assert out["synced"] == (1, 0.1), (r, out)
        text, ranks = out["both"]
        assert ranks == (1, 3) and "rank(s) [1, 3] differs from rank 0's" in text, (r, text)
        text, ranks = out["refused"]
        assert ranks == (1, 3) and "no rank among [1, 3], which hold the same shards" in text, (r, text)


def _one_replica(comm: distcomm.Communicator) -> tuple[str, str]:
    """After a shrink to one replica, each shard class has one member: still compared."""
    model, opt = _hsdp(comm, (2,))
    progress = {"step": 99 if comm.rank == 1 else 1}
    with pytest.raises(distcomm.CollectiveMismatchError) as caught:
        comm.check_identical(model, opt, progress)
    with pytest.raises(distcomm.CollectiveMismatchError) as refused:
        comm.sync_state(model, opt, progress)
    return str(caught.value), str(refused.value)


def test_one_member_shard_classes_still_compare_their_replicated_state() -> None:
    for text, refused in spawn(_one_replica, 2, timeout=120):
        assert "rank(s) [1] differs from rank 0's; first at object 2 (dict), key 'step'" in text, text
        assert "no rank among [1]" in refused, refused


# ---------------------------------------------------------------- what a peer announces
def _announced(comm: distcomm.Communicator, mode: str) -> tuple[float, str, list[float]]:
    """Rank 0's header lies about its bytes (fewer, more) or announces a shape torch can't make."""
    import time

    import distcomm._state_copy as sc

    state = {"a": torch.arange(4, dtype=torch.float32) if comm.rank == 0 else torch.full((4,), -1.0)}
    comm._holds_state = comm.rank == 0
    if comm.rank == 0:
        cut = sc._cut

        def lying(s: Any) -> Any:
            skeleton, specs, parts = cut(s)
            n, dtype, _, device, layout = specs[0]
            if mode == "zero_huge":
                specs[0], parts[0] = (n, dtype, (0, 2**63), device, layout), parts[0][:0]
            elif mode == "short":
                parts[0] = parts[0][:8]
            else:
                specs[0] = (n, dtype, (2,), device, layout)
            return skeleton, specs, parts

        sc._cut = lying  # type: ignore[assignment]
    began = time.monotonic()
    try:
        with pytest.raises(distcomm.SerializationError) as caught:
            comm.sync_state(state)
    finally:
        if comm.rank == 0:  # (a reused process: as it was)
            sc._cut = cut
    return time.monotonic() - began, str(caught.value), state["a"].tolist()


@pytest.mark.parametrize(("mode", "said"), [("short", "comes as 8 bytes"), ("long", "comes as 16 bytes"),
                                            ("zero_huge", "shape is malformed")])
def test_a_header_whose_bytes_are_not_its_shapes_fails_the_call_at_once(mode: str, said: str) -> None:
    for took, text, a in spawn(lambda comm: _announced(comm, mode), 2, timeout=60):
        assert said in text and took < 20, (took, text)
    assert a == [-1.0] * 4


def _tensor_for_a_number(comm: distcomm.Communicator) -> tuple[str, Any]:
    state = {"w": torch.ones(2), "lr": torch.tensor(5.0) if comm.rank == 0 else 0.1}
    with pytest.raises(distcomm.SerializationError) as caught:
        comm.sync_state(state)
    return str(caught.value), state["lr"]


def test_a_tensor_where_the_receiver_holds_a_number_is_refused() -> None:
    text, lr = spawn(_tensor_for_a_number, 2, timeout=60)[1]
    assert "a tensor is announced at 'lr', where this rank's state holds a float" in text, text
    assert lr == 0.1


# ---------------------------------------------------------------- authenticated bytes
def _changed_on_the_way(comm: distcomm.Communicator) -> tuple[str, list[float], str]:
    import distcomm._state_copy as sc

    state = {"w": torch.full((4,), 1.5) if comm.rank == 0 else torch.zeros(4), "b": torch.ones(3)}
    comm._holds_state = comm.rank == 0
    send = comm._send_message

    def on_the_way(dst: int, tag: int, parts: list[torch.Tensor], timeout: float | None) -> None:
        if tag == sc._BYTES_TAG:  # (someone on the path: the first tensor's bytes changed)
            parts = [parts[0].clone().fill_(7), *parts[1:]]
        send(dst, tag, parts, timeout)

    comm._send_message = on_the_way  # type: ignore[method-assign]
    with pytest.raises(distcomm.SerializationError) as caught:
        comm.sync_state(state)
    return str(caught.value), state["w"].tolist(), comm.serializer.name


def test_authenticated_tensor_bytes_changed_on_the_way_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCOMM_SERIALIZER", "authenticated-safe")
    outs = spawn(_changed_on_the_way, 2, timeout=60)
    for text, _, name in outs:
        assert name == "authenticated safe", name
        assert "don't match the digest in the authenticated header" in text, text
    assert outs[1][1] == [0.0] * 4  # (the changed bytes never became the receiver's state)


def _digested_with(comm: distcomm.Communicator, name: str) -> list[float]:
    import distcomm._state_copy as sc

    if comm.rank == 0:  # (the sender's CPU hashes another digest faster: it names it, the receiver follows)
        sc._faster_digest = lambda: name  # type: ignore[assignment]
    state = {"w": torch.full((4,), 1.5) if comm.rank == 0 else torch.zeros(4)}
    comm._holds_state = comm.rank == 0
    comm.sync_state(state)
    return state["w"].tolist()


@pytest.mark.parametrize("name", ["blake2b", "sha256"])
def test_an_authenticated_hand_over_takes_the_digest_its_sender_names(monkeypatch: pytest.MonkeyPatch,
                                                                     name: str) -> None:
    monkeypatch.setenv("DISTCOMM_SERIALIZER", "authenticated-safe")
    assert spawn(lambda comm: _digested_with(comm, name), 2, timeout=60) == [[1.5] * 4] * 2


def test_an_authenticated_hand_over_with_a_digest_of_no_known_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTCOMM_SERIALIZER", "authenticated-safe")
    with pytest.raises(distcomm.RankFailedError) as failed:
        spawn(lambda comm: _digested_with(comm, "md5"), 2, timeout=60)
    assert "carries no digest of each tensor's bytes (SHA-256 or blake2b)" in str(failed.value.exception), failed.value


# ---------------------------------------------------------------- a receiver lost on the way
def _one_receiver_lost(comm: distcomm.Communicator) -> str:
    """Rank 0 hands its state to ranks 1 and 2 at once; rank 2 dies as it begins to receive, and
    rank 0's send to rank 1 begins only after that."""
    import os
    import time

    import distcomm._state as st
    import distcomm._state_copy as sc

    receive, send_to = st.receive_state, sc._send_to

    def receiving(*args: Any) -> Any:
        if comm.rank == 2:
            os._exit(3)
        return receive(*args)

    def sending(c: Any, r: int, *args: Any) -> Any:
        if r == 1:
            time.sleep(3)
        return send_to(c, r, *args)

    st.receive_state, sc._send_to = receiving, sending  # type: ignore[assignment]
    comm._timeout = 10.0  # (rank 1 then waits no longer than that for a state that never comes)
    comm._holds_state = comm.rank == 0
    try:
        comm.sync_state({"w": torch.full((4,), float(comm.rank == 0))})
    except distcomm.DistCommError as e:
        return type(e).__name__
    finally:
        st.receive_state, sc._send_to = receive, send_to
    return "returned"


def test_a_receiver_lost_while_others_receive_fails_the_source_as_a_lost_rank() -> None:
    """The source's other sends fail only because its communicator broke on the loss; what it raises
    is the loss (``PeerError``), on which an elastic loop shrinks, not their ``CommunicatorStateError``."""
    source, late, lost = spawn(_one_receiver_lost, 3, timeout=60, return_exceptions=True)
    assert source == "PeerError", source
    assert isinstance(lost, distcomm.RankFailedError) and late != "returned", (late, lost)


# ---------------------------------------------------------------- a module that isn't loaded onto itself
class _Extra(torch.nn.Linear):  # (a buffer the sender's state lacks: a strict load refuses it)
    def __init__(self) -> None:
        super().__init__(2, 2)
        self.register_buffer("scale", torch.full((2,), 7.0))


class _WithExtra(torch.nn.Linear):
    def __init__(self, steps: int) -> None:
        super().__init__(2, 2)
        self.steps = steps

    def get_extra_state(self) -> Any:
        return torch.tensor([self.steps])

    def set_extra_state(self, state: Any) -> None:
        self.steps = int(state[0])


class _Transposed(torch.nn.Module):  # (its state dict holds a tensor made from its parameter, not the parameter)
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(2, 3))

    def _save_to_state_dict(self, into: Any, prefix: str, keep_vars: bool) -> None:
        into[prefix + "w_t"] = self.w.detach().t().contiguous()

    def _load_from_state_dict(self, state: Any, prefix: str, *rest: Any) -> None:
        with torch.no_grad():
            self.w.copy_(state[prefix + "w_t"].t())


class _Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight


def _handed(src: torch.nn.Module, dst: torch.nn.Module) -> str | None:
    """``src``'s state loaded into ``dst`` as a state call's receiver loads it (bytes into its own tensors)."""
    from distcomm._state import _load
    from distcomm._state_copy import _cut as cut
    from distcomm._state_copy import load_parts

    skeleton, specs, parts = cut(src.state_dict())
    return load_parts(distcomm.LocalCommunicator(), (dst,), [dst.state_dict()], [(skeleton, specs)], parts, _load)


def test_only_a_plain_module_whose_tensors_landed_in_its_own_skips_its_load() -> None:
    torch.manual_seed(0)
    why = _handed(torch.nn.Linear(2, 2), _Extra())
    assert why is not None and 'Missing key(s) in state_dict: "scale"' in why, why
    extra = _WithExtra(0)
    assert _handed(_WithExtra(100), extra) is None and extra.steps == 100
    src, dst = _Transposed(), _Transposed()
    assert _handed(src, dst) is None and torch.equal(src.w, dst.w)
    seen: list[int] = []
    hooked = torch.nn.Linear(2, 2)
    hooked.register_load_state_dict_post_hook(lambda *_: seen.append(1))
    assert _handed(torch.nn.Linear(2, 2), hooked) is None and seen == [1]
    src_t, dst_t = _Tied(), _Tied()
    assert _handed(src_t, dst_t) is None and torch.equal(src_t.a.weight, dst_t.b.weight)
    assert dst_t.a.weight is dst_t.b.weight
    plain_src, plain = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    calls = count_calls(plain, "load_state_dict")
    assert _handed(plain_src, plain) is None and torch.equal(plain.weight, plain_src.weight)
    assert calls == [0]  # (its bytes landed in its own parameters: nothing left to load)
