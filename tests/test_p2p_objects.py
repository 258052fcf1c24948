"""Point-to-point objects: send/recv and isend/irecv over real gloo processes, the threaded world,
the fake and a world of one."""

from __future__ import annotations

import fractions
import os
import time
from typing import Any

import numpy as np
import pytest
import torch

import distcomm
from distcomm.testing import FakeCommunicator, run_threaded, spawn


def _exchange(comm: distcomm.Communicator) -> Any:
    """Rank 0 sends objects on two tags (large arrays out of band); rank 1 receives them by tag."""
    if comm.rank == 0:
        hs = [comm.isend(("x", i, np.arange(100_000) + i), 1, tag=i % 2) for i in range(4)]
        comm.send({"small": 1}, 1, tag=7)
        for h in hs:
            assert h.wait() is None
        return comm.recv(1, tag=5)
    odd = [comm.recv(0, tag=1) for _ in range(2)]  # tag 1 first: tags are matched, not arrival order
    small = comm.irecv(0, tag=7)
    even = [comm.irecv(0, tag=0) for _ in range(2)]
    got = odd + [h.wait() for h in even]
    comm.send("thanks", 0, tag=5)
    assert small.wait() == {"small": 1}
    return [(g[1], int(g[2][0]), g[2].shape) for g in got]


_EXPECTED = [(1, 1, (100_000,)), (3, 3, (100_000,)), (0, 0, (100_000,)), (2, 2, (100_000,))]


def test_messages_by_tag_in_order_over_gloo_and_threads() -> None:
    for got in (spawn(_exchange, 2, timeout=120), run_threaded(_exchange, 2, timeout=60)):
        assert got == ["thanks", _EXPECTED]


def _bad_input(comm: distcomm.Communicator) -> list[str]:
    out = []
    for call in (lambda: comm.send(1, comm.rank), lambda: comm.send(1, 5), lambda: comm.recv(-1),
                 lambda: comm.isend(1, 1 - comm.rank, tag=-1), lambda: comm.irecv(1 - comm.rank, tag=1 << 30),
                 lambda: comm.send(1, "1")):  # type: ignore[arg-type]
        with pytest.raises((ValueError, TypeError)) as e:
            call()
        out.append(type(e.value).__name__)
    comm.synchronize()  # nothing was sent: the communicator is as it was
    return out


def test_bad_input_raises_before_anything_moves() -> None:
    want = ["ValueError"] * 5 + ["TypeError"]
    assert spawn(_bad_input, 2, timeout=120) == [want, want]
    with distcomm.LocalCommunicator() as comm:
        with pytest.raises(ValueError, match="itself"):
            comm.send(1, 0)
        with pytest.raises(ValueError, match="out of range"):
            comm.recv(1)


def _timeout(comm: distcomm.Communicator) -> str:
    if comm.rank == 0:
        with pytest.raises(distcomm.CollectiveTimeoutError, match=r"recv from rank 1 \(tag 3\)") as e:
            comm.recv(1, tag=3, timeout=1.0)
        with pytest.raises(distcomm.CommunicatorStateError):  # the pair's connection is gone
            comm.recv(1, tag=3)
        return type(e.value).__name__
    time.sleep(3)
    return "idle"


def test_a_receive_that_times_out_is_a_clear_error() -> None:
    assert spawn(_timeout, 2, timeout=120, reuse=False) == ["CollectiveTimeoutError", "idle"]


def _dead_peer(comm: distcomm.Communicator) -> str:
    if comm.rank == 1:
        time.sleep(0.5)
        os._exit(0)
    with pytest.raises((distcomm.PeerError, distcomm.CollectiveTimeoutError)) as e:
        comm.recv(1, timeout=60)
    return type(e.value).__name__


def test_a_dead_peer_is_a_clear_error() -> None:
    got = spawn(_dead_peer, 2, timeout=120, reuse=False, return_exceptions=True)
    assert got[0] == "PeerError"


def _over_max_bytes(comm: distcomm.Communicator) -> str:
    if comm.rank == 0:
        with pytest.raises(distcomm.PayloadTooLargeError, match="over max_bytes"):
            comm.send(np.zeros(10_000), 1)  # refused before anything is sent
        comm.send(np.zeros(10), 1)
        return "sent"
    return str(comm.recv(0).shape)


def test_max_bytes_on_the_sender_and_the_receiver() -> None:
    assert spawn(_over_max_bytes, 2, timeout=120, max_bytes=4096) == ["sent", "(10,)"]
    # a receiver refuses an announced size over its max_bytes without allocating it
    big = FakeCommunicator(0, 2, peers=lambda op, r, tag: np.zeros(10_000))
    small = FakeCommunicator(0, 2, peers=lambda op, r, tag: np.zeros(10_000), max_bytes=4096)
    assert big.recv(1).shape == (10_000,)
    with pytest.raises(distcomm.PayloadTooLargeError, match="over max_bytes"):
        small.recv(1)


def _forged_size(comm: distcomm.Communicator) -> str:
    from distcomm._transfer import messages as _messages

    if comm.rank == 0:  # a peer announcing 2**62 bytes, one segment: no max_bytes set
        head = _messages._HEAD.pack(_messages._MAGIC, _messages._VERSION, 1, 1 << 62)
        comm._send_message(1, 0, [torch.frombuffer(bytearray(head), dtype=torch.uint8)], 30)
        return "sent"
    with pytest.raises(distcomm.PayloadTooLargeError, match="more than this machine's memory"):
        comm.recv(0)
    return "refused"


def test_a_receiver_without_max_bytes_refuses_a_size_over_its_memory_before_allocating() -> None:
    assert run_threaded(_forged_size, 2, timeout=60) == ["sent", "refused"]


def _a_tag_per_step(comm: distcomm.Communicator) -> int:
    for step in range(200):
        if comm.rank == 0:
            comm.send(step, 1, tag=step)
        else:
            assert comm.recv(0, tag=step) == step
    return comm._queues.lanes()


def test_idle_lanes_are_let_go() -> None:
    """A tag per step doesn't keep a lane (a queue) per step."""
    from distcomm._handles import LANES_KEPT

    assert max(run_threaded(_a_tag_per_step, 2, timeout=60)) <= LANES_KEPT + 1


def test_safe_serializer_refuses_what_it_does_not_allow() -> None:
    fake = FakeCommunicator(0, 2, peers=lambda op, r, tag: fractions.Fraction(1, 3),
                            serializer=distcomm.SafeSerializer())
    with pytest.raises(distcomm.UnsafePayloadError):
        fake.recv(1)


def test_the_fake_scripts_and_records_messages() -> None:
    fake = FakeCommunicator(0, 3, peers=lambda op, r, tag: {"from": r, "tag": tag})
    assert fake.recv(2, tag=4) == {"from": 2, "tag": 4}
    assert fake.irecv(1).wait() == {"from": 1, "tag": 0}
    fake.isend([1, 2], 1, tag=9).wait()
    assert fake.calls[-1] == distcomm.testing.Call("send", {"obj": [1, 2], "dst": 1, "tag": 9})
    with pytest.raises(ValueError, match="itself"):
        fake.send(1, 0)


def _crossed_tags(size: int) -> Any:
    def fn(comm: distcomm.Communicator) -> Any:
        a, b = np.zeros(size, np.uint8), np.ones(size, np.uint8)
        try:
            if comm.rank == 0:
                comm.send(a, 1, tag=5, timeout=3)
                a[:] = 7  # a small send has gone from a copy: changing the object changes nothing
                comm.send(b, 1, tag=7, timeout=3)
                return "sent"
            got7, got5 = comm.recv(0, tag=7, timeout=3), comm.recv(0, tag=5, timeout=3)
            return (int(got5.sum()), int(got7.sum()))
        except distcomm.CollectiveTimeoutError as e:
            return str(e)

    return fn


def test_small_sends_on_crossed_tags_do_not_wait_for_the_receiver() -> None:
    """Used to wait the whole timeout on both ranks, each saying the other didn't take part."""
    assert spawn(_crossed_tags(100), 2, timeout=120, reuse=False) == ["sent", (0, 100)]


def test_large_sends_on_crossed_tags_say_what_each_side_waited_for() -> None:
    sender, receiver = spawn(_crossed_tags(1 << 20), 2, timeout=120, reuse=False)
    assert sender.startswith("send to rank 1 (tag 5) timed out after 3"), sender
    assert "it was waiting in recv from rank 0 (tag 7)" in sender, sender
    assert receiver.startswith("recv from rank 0 (tag 7) timed out after 3"), receiver
    assert "it was waiting in send to rank 1 (tag 5)" in receiver, receiver


def test_the_fake_refuses_a_recv_nobody_scripted() -> None:
    """Without ``peers=``, no peer has anything to send: a clear error, not the tag as the object."""
    fake = FakeCommunicator(0, 2)
    with pytest.raises(ValueError, match=r"recv from rank 1 \(tag 9\): .*peers="):
        fake.recv(1, tag=9)
    with pytest.raises(ValueError, match="peers="):
        fake.irecv(1).wait()
    sub = fake.new_group([0, 1])
    assert sub is not None
    with pytest.raises(ValueError, match="peers="):
        sub.recv(1)
    assert fake.all_gather(5) == [5, 5]  # still usable


def _many_small_sends_at_once(comm: distcomm.Communicator) -> Any:
    import sys

    if comm.rank == 0:
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)  # threads switch often: the lanes' sends interleave
        try:
            handles = [comm.isend({"i": i}, 1, tag=i) for i in range(64)]
            for h in handles:
                h.wait(timeout=60)
        finally:
            sys.setswitchinterval(interval)
        return "sent"
    time.sleep(1.0)  # every send is posted, eagerly, before anything is received
    return [comm.recv(0, tag=i, timeout=60)["i"] for i in range(64)]


def test_eager_sends_on_many_lanes_at_once_all_arrive() -> None:
    """Each lane posts from a thread of its own: the list of sends in flight is shared (a send
    dropped from it lost its message and broke the pair)."""
    assert spawn(_many_small_sends_at_once, 2, timeout=120, reuse=False) == ["sent", list(range(64))]


def _producer_faster_than_its_consumer(comm: distcomm.Communicator) -> Any:
    from distcomm._transfer.messages import EAGER_PENDING

    if comm.rank == 0:
        most = 0
        for i in range(EAGER_PENDING + 100):
            comm.send(i, 1, tag=1)
            most = max(most, len(comm._eager))  # type: ignore[attr-defined]
        return most <= EAGER_PENDING
    time.sleep(2.0)
    return [comm.recv(0, tag=1, timeout=60) for _ in range(EAGER_PENDING + 100)] == list(range(EAGER_PENDING + 100))


def test_eager_sends_in_flight_are_bounded() -> None:
    """Past EAGER_PENDING a send waits for its receiver: a faster producer holds no more, in order."""
    assert spawn(_producer_faster_than_its_consumer, 2, timeout=180, reuse=False) == [True, True]


LAST_SEND = """
import os, sys, time
import distcomm

comm = distcomm.from_env(timeout=60)  # never closed, as many scripts do
if comm.rank == 0:
    comm.send({"final": "metrics"}, 1, tag=1)  # eager: returns before rank 1 receives it
else:
    time.sleep(1.0)  # rank 0 has reached its exit by now
    print("GOT", comm.recv(0, tag=1), flush=True)
"""


@pytest.mark.slow
def test_the_last_eager_send_before_exit_arrives(tmp_path: Any) -> None:
    import subprocess
    import sys

    script = tmp_path / "last.py"
    script.write_text(LAST_SEND)
    port = str(distcomm.free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "RANK": str(r),
                                              "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in (0, 1)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "GOT {'final': 'metrics'}" in outs[1], outs


def _crossed_tags_one_side_sooner(comm: distcomm.Communicator) -> Any:
    big = np.zeros(1 << 20, np.uint8)
    try:
        if comm.rank == 0:
            comm.send(big, 1, tag=5, timeout=2)  # gives up first, which closes the pair's connection
            return "sent"
        return comm.recv(0, tag=7, timeout=60)
    except distcomm.DistCommError as e:
        return f"{type(e).__name__}: {e}"


def test_a_peer_whose_timeout_fired_first_is_no_lost_peer() -> None:
    """Its timeout closed the connection: the other side used to report a lost peer (PeerError)."""
    sender, receiver = spawn(_crossed_tags_one_side_sooner, 2, timeout=120, reuse=False)
    assert sender.startswith("CollectiveTimeoutError: send to rank 1 (tag 5) timed out after 2"), sender
    assert receiver.startswith("CollectiveTimeoutError: recv from rank 0 (tag 7) timed out after 60"), receiver
    assert "it was waiting in send to rank 1 (tag 5)" in receiver and "its timeout fired first" in receiver, receiver
