"""A whole mmengine Runner job (train with DDP, validate with a metric, checkpoint every epoch),
run on mmengine's own dist functions or, with ``install()``, on distcomm's: see
tests/test_mmengine_runner.py. Usage: job.py mmengine|distcomm WORK_DIR (under torchrun)."""

import json
import os
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import Dataset


class Data(Dataset):
    def __len__(self):
        return 37

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(4, generator=g)
        return dict(x=x, y=x.sum())


def main(mode, workdir):
    if mode == "distcomm":
        import distcomm.compat.mmengine as dist
        dist.install()  # the Runner's init_dist is then distcomm's
    else:  # mmengine's own init_dist calls torch.cuda.set_device, which CPU-only torch lacks
        import torch.distributed as tdist
        tdist.init_process_group("gloo")
    from mmengine.evaluator import BaseMetric
    from mmengine.model import BaseModel
    from mmengine.runner import Runner

    class Toy(BaseModel):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def forward(self, x, y, mode="tensor"):
            out = self.lin(x).squeeze(-1)
            if mode == "loss":
                return {"loss": ((out - y) ** 2).mean()}
            if mode == "predict":
                return [(float(o), float(t)) for o, t in zip(out, y)]
            return out

    class MSE(BaseMetric):
        def process(self, data_batch, data_samples):
            for o, t in data_samples:
                self.results.append((o - t) ** 2)

        def compute_metrics(self, results):
            return {"mse": sum(results) / len(results), "n": len(results)}

    loader = dict(dataset=Data(), sampler=dict(type="DefaultSampler", shuffle=True, seed=3), batch_size=4,
                  collate_fn=dict(type="default_collate"), num_workers=0)
    torch.manual_seed(0)  # the model is built before the Runner seeds anything
    runner = Runner(model=Toy(), work_dir=workdir, train_dataloader=loader,
                    val_dataloader=dict(loader, sampler=dict(type="DefaultSampler", shuffle=False)),
                    val_evaluator=dict(type=MSE), train_cfg=dict(by_epoch=True, max_epochs=2, val_interval=1),
                    val_cfg=dict(), optim_wrapper=dict(optimizer=dict(type="SGD", lr=0.05)),
                    default_hooks=dict(checkpoint=dict(type="CheckpointHook", interval=1),
                                       logger=dict(type="LoggerHook", interval=2)),
                    launcher="pytorch", randomness=dict(seed=7), env_cfg=dict(dist_cfg=dict(backend="gloo")),
                    # DDP on CPU: mmengine's default wrapper passes device_ids=[LOCAL_RANK], which CPU modules refuse
                    cfg=dict(model_wrapper_cfg=dict(type="MMDistributedDataParallel", device_ids=None)))
    runner.train()
    metrics = runner.val()
    import torch.distributed as tdist
    if tdist.get_rank() == 0:
        with open(os.path.join(workdir, "result.json"), "w") as f:
            json.dump({"val": metrics}, f)
    if mode == "mmengine":
        # torch's own job aborts at exit in about a quarter of runs without this ("terminate called without an
        # active exception"): a gloo worker thread frees the last broadcast's tensors after the caller's wait has
        # returned, needs the GIL for that, and is ended inside a noexcept frame if the interpreter is finalizing
        # by then. Sleeping lets it take the GIL first, as distcomm's close does (_torch.py, _shutdown).
        time.sleep(0.5)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
