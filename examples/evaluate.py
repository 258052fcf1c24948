"""Distributed evaluation: each rank predicts on its shard (comm.shard), gather_in_order() brings the
predictions to rank 0 in dataset order.

A second way gives every rank the scores: each rank takes a contiguous block, exscan() gives its
offset into the dataset, and all_gather_tensor() lays the blocks' scores end to end.

Run it on 2 CPU processes:  python examples/evaluate.py --nproc 2
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

import distcomm

NUM_SAMPLES = 1000


def predict(indices: np.ndarray) -> list[dict[str, Any]]:
    """A toy classifier: label = index is a multiple of 3; it is wrong on multiples of 7."""
    preds = []
    for i in indices.tolist():
        truth = i % 3 == 0
        guess = (not truth) if i % 7 == 0 else truth
        preds.append({"id": i, "label": int(guess), "score": float(np.float32(0.9 if guess else 0.1))})
    return preds


def evaluate(comm: distcomm.Communicator) -> dict[str, float] | None:
    shard = comm.shard(NUM_SAMPLES, sharding="interleaved")  # rank r: r, r + world_size, ... (uneven is fine)
    preds = comm.gather_in_order(predict(np.asarray(shard)), size=NUM_SAMPLES, sharding="interleaved")
    if preds is None:  # not rank 0
        return None
    assert [p["id"] for p in preds] == list(range(NUM_SAMPLES)), "every sample exactly once, in dataset order"
    correct = sum(p["label"] == int(p["id"] % 3 == 0) for p in preds)
    return {"samples": float(len(preds)), "accuracy": correct / len(preds)}


def evaluate_in_order(comm: distcomm.Communicator) -> torch.Tensor:
    """Every sample's score, in dataset order, on every rank."""
    per_rank, extra = divmod(NUM_SAMPLES, comm.world_size)
    count = per_rank + (comm.rank < extra)  # contiguous blocks of uneven size
    start = comm.exscan(count, "sum") or 0  # this rank's offset: the sizes of the blocks before it
    preds = predict(np.arange(start, start + count))
    scores = torch.tensor([p["score"] for p in preds], dtype=torch.float32)
    return comm.all_gather_tensor(scores)  # rank order = dataset order


def _run() -> None:
    comm = distcomm.current()
    ordered = evaluate_in_order(comm)
    result = evaluate(comm)
    if result is not None:
        sizes = [len(range(r, NUM_SAMPLES, comm.world_size)) for r in range(comm.world_size)]
        print(f"evaluated {int(result['samples'])} samples on {comm.world_size} process(es) "
              f"(shards {sizes}); gathered on rank 0 in dataset order: accuracy = {result['accuracy']:.4f}")
        st = comm.stats["gather_in_order"]
        print(f"gather_in_order on rank 0: {st.bytes_received} bytes received; "
              f"serialize {st.serialize_s * 1e3:.2f} ms, transfer {st.transfer_s * 1e3:.2f} ms, "
              f"deserialize {st.deserialize_s * 1e3:.2f} ms")
        print(f"all_gather_tensor: {ordered.numel()} scores in dataset order on every rank, "
              f"mean score {float(ordered.mean()):.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    distcomm.launch(_run, args.nproc, timeout=120)


if __name__ == "__main__":
    main()
