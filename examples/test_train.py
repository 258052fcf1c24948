"""Unit tests of the example trainer and evaluator, written with distcomm.testing."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from distcomm.testing import FakeCommunicator, run_threaded
from examples.evaluate import NUM_SAMPLES, evaluate, evaluate_in_order, predict
from examples.train import Trainer


def test_trainer_logs_on_main_process_only(threaded_world: Any) -> None:
    logs: dict[int, list[str]] = {0: [], 1: [], 2: []}
    histories = threaded_world(lambda comm: Trainer(comm, steps=10, log=logs[comm.rank].append).fit(), world_size=3)
    assert logs[1] == [] and logs[2] == []
    assert any("trained on 3 process(es)" in line for line in logs[0])
    assert histories[1] == [] and len(histories[0]) == 10
    assert histories[0][-1]["loss"] < histories[0][0]["loss"]


def test_trainer_averages_with_reduce_dict() -> None:
    comm = FakeCommunicator(rank=0, world_size=4)
    Trainer(comm, steps=3, log=lambda s: None).fit()
    ops = [c.op for c in comm.calls]
    assert ops.count("reduce_dict") == 3 and ops[0] == "shared_random_seed"
    assert ops.count("all_reduce") == 6  # weight and bias gradients, every step
    assert all(c.args["op"] == "mean" for c in comm.calls if c.op == "all_reduce")
    first = next(c for c in comm.calls if c.op == "reduce_dict")
    assert set(first.result) == {"loss", "mae"}


def test_trainer_on_a_nonzero_rank_does_not_log() -> None:
    lines: list[str] = []
    assert Trainer(FakeCommunicator(rank=2, world_size=4), steps=2, log=lines.append).fit() == []
    assert lines == []


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_evaluate_gathers_every_sample_once(world_size: int) -> None:
    results = run_threaded(evaluate, world_size)
    assert results[0] is not None and results[0]["samples"] == NUM_SAMPLES
    assert results[1:] == [None] * (world_size - 1)
    expected = sum(1 for i in range(NUM_SAMPLES) if i % 7 != 0) / NUM_SAMPLES
    assert results[0]["accuracy"] == pytest.approx(expected)


def test_trainer_failure_names_the_rank() -> None:
    from distcomm.testing import RankFailedError

    class Broken(Trainer):
        def fit(self) -> list[dict[str, float]]:
            if self.comm.rank == 1:
                raise RuntimeError("disk full")
            return super().fit()

    with pytest.raises(RankFailedError, match="rank 1 raised RuntimeError: disk full") as info:
        run_threaded(lambda comm: Broken(comm, steps=2, log=lambda s: None).fit(), 2, timeout=30)
    assert info.value.rank == 1
    assert torch.is_tensor(torch.tensor(0))


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_evaluate_in_order_lays_blocks_end_to_end(world_size: int) -> None:
    import numpy as np

    want = [p["score"] for p in predict(np.arange(NUM_SAMPLES))]
    for scores in run_threaded(evaluate_in_order, world_size):
        assert scores.tolist() == want


def _weights(comm: Any, ddp: bool) -> list[float]:
    trainer = Trainer(comm, steps=5, log=lambda s: None, ddp=ddp)
    trainer.fit()
    return [round(float(p.detach().sum()), 5) for p in trainer.model.parameters()]


@pytest.mark.slow
def test_trainer_with_ddp_over_the_communicators_group() -> None:
    """DDP over comm.group and the tensor all-reduce train the same weights, the same on every rank."""
    from distcomm.testing import spawn

    with_ddp = spawn(lambda comm: _weights(comm, True), 2, timeout=120)
    by_hand = spawn(lambda comm: _weights(comm, False), 2, timeout=120)
    assert with_ddp[0] == with_ddp[1]
    assert by_hand[0] == by_hand[1]


def test_trainer_weights_agree_across_threads() -> None:
    """Ranks as threads share torch's global generator: the trainer seeds a generator of its own."""
    from distcomm.testing import run_threaded

    for _ in range(3):
        weights = run_threaded(lambda comm: _weights(comm, False), 4, timeout=120)
        assert all(w == weights[0] for w in weights)
