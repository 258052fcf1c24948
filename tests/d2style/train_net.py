"""A training and evaluation job written exactly as detectron2 code is: module helpers, no comm object."""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch

from tests.d2style.utils import comm
from tests.d2style.utils.comm import launch


class TrainingSampler:
    """detectron2's sampler: every rank draws the same shuffled stream and takes its stride of it."""

    def __init__(self, size: int, seed: int | None = None) -> None:
        self._size = size
        self._seed = int(comm.shared_random_seed()) if seed is None else seed
        self._rank, self._world = comm.get_rank(), comm.get_world_size()

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator()
        g.manual_seed(self._seed)
        epochs = (torch.randperm(self._size, generator=g).tolist() for _ in itertools.count())
        stream = itertools.chain.from_iterable(epochs)
        yield from itertools.islice(stream, self._rank, None, self._world)


class Evaluator:
    def reset(self) -> None:
        self._preds: list[dict[str, Any]] = []

    def process(self, idx: int) -> None:
        self._preds.append({"id": idx, "score": idx * 0.5})

    def evaluate(self) -> dict[str, Any] | None:
        comm.synchronize()
        preds = comm.gather(self._preds, dst=0)
        if not comm.is_main_process():
            return {}
        flat = list(itertools.chain(*preds))
        return {"n": len(flat), "ids": sorted(p["id"] for p in flat), "mean": sum(p["score"] for p in flat) / len(flat)}


def main(cfg: dict[str, Any]) -> dict[str, Any]:
    rank = comm.get_rank()
    sampler = TrainingSampler(cfg["size"])
    it = iter(sampler)
    logged = []
    for step in range(cfg["steps"]):
        batch = [next(it) for _ in range(2)]
        loss_dict = {"loss_cls": torch.tensor(float(sum(batch))), "loss_box": torch.tensor([float(rank), step + 1.0])}
        reduced = comm.reduce_dict(loss_dict)
        if comm.is_main_process():
            logged.append({k: v.tolist() for k, v in reduced.items()})
        else:
            assert reduced is not loss_dict and all(reduced[k] is loss_dict[k] for k in loss_dict)
    comm.synchronize()
    path = os.path.join(cfg["out"], "model_final.json")
    if comm.is_main_process():
        with open(path, "w") as f:
            json.dump({"steps": cfg["steps"]}, f)
    comm.synchronize()
    with open(path) as f:
        loaded = json.load(f)
    evaluator = Evaluator()
    evaluator.reset()
    for idx in range(rank, cfg["size"], comm.get_world_size()):  # an inference sampler's shard
        evaluator.process(idx)
    result = {
        "rank": rank, "world": comm.get_world_size(), "local_rank": comm.get_local_rank(),
        "local_group_is_none": comm._LOCAL_PROCESS_GROUP is None, "seed": sampler._seed,
        "first": [next(iter(sampler)) for _ in range(1)], "logged": logged, "loaded": loaded,
        "metrics": evaluator.evaluate(),
    }
    with open(os.path.join(cfg["out"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    return result


if __name__ == "__main__":
    cfg = {"size": 10, "steps": 3, "out": sys.argv[1]}
    launch(main, int(sys.argv[2]), 1, 0, "auto", (cfg,))  # detectron2's positional order
