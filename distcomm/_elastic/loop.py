"""``ElasticLoop``: docs/elastic.md's loop (the state goes round at the start, after a shrink and
after an admit; every collective inside the ``try``; newcomers let in at step boundaries), run for
the user around a step function, with the training data re-sharded over each new membership from
where the members are in the epoch."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Iterator, Sized
from typing import Any, ParamSpec, TypeVar

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from .._communicator import Communicator
from .._errors import is_rank_loss

__all__ = ["ElasticLoop", "ShardedLoader", "shard_of"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _stderr(message: str) -> None:
    print(f"distcomm: {message}", file=sys.stderr, flush=True)


class ElasticLoop:
    """A training loop that outlives lost ranks: docs/elastic.md's loop, run for you.

    ``model``, ``optimizer`` and ``state`` (schedulers, grad scalers, dicts) go round with the
    loop's own ``progress`` (epoch, step, and how far into the epoch's samples the members are)
    at the start, after a ``shrink()`` and after an ``admit()``; ``on_change(comm)`` then runs, to
    build DDP (or anything else made over ``comm.group``) again over the new membership. Each step
    runs in ``run_step``, where a lost rank makes the survivors shrink, newcomers are let in after
    the step, and ``check_identical`` runs every ``check_every`` steps and once at the end.

    ``optimizer`` is required (``None`` where there is none): a replacement handed the model
    alone starts with empty optimizer state (Adam's moments, momentum) and drifts from the others.
    ``log(message)`` is called on the main process when the membership changes and at the end.
    """

    def __init__(self, comm: Communicator, model: Any, optimizer: torch.optim.Optimizer | None, *state: Any,
                 on_change: Callable[[Communicator], object] | None = None, check_every: int = 100,
                 allow: Iterable[Any] = (), log: Callable[[str], object] | None = _stderr) -> None:
        _check_model(model, optimizer)
        _check_state(optimizer, state)
        if isinstance(check_every, bool) or not isinstance(check_every, int) or check_every < 0:
            raise ValueError(f"check_every must be an int >= 0 (0: only at the end), got {check_every!r}")
        self.progress: dict[str, int] = {"epoch": 0, "step": 0, "sample": 0}
        self._comm = comm
        self._state = (model, *(() if optimizer is None else (optimizer,)), *state, self.progress)
        self._on_change, self._check_every, self._allow, self._log = on_change, check_every, tuple(allow), log
        self._share = True  # the state goes round before the first step
        self._generation = 0  # memberships the state went round in: a shard's plan is made for one
        self._pending = 0  # samples the batch being stepped on covers, over every rank
        self._shard: ShardedLoader | None = None

    @property
    def comm(self) -> Communicator:
        """The communicator of the current membership (a new one after each shrink or admit)."""
        return self._comm

    def shard(self, loader: DataLoader[Any]) -> ShardedLoader:
        """This rank's batches of ``loader``'s dataset for the current epoch, sharded as
        ``DistributedSampler`` shards them over the current membership and sharded again, from
        where the members are in the epoch, after each shrink or admit. ``loader``'s sampler says
        the order (a ``DistributedSampler``'s shuffle, seed and drop_last; a ``RandomSampler``:
        shuffled with seed 0 plus the epoch; a ``SequentialSampler``: in order); its batch size,
        workers and collate function are kept. Call it before ``epochs()``."""
        self._shard = ShardedLoader(self, loader)
        return self._shard

    def epochs(self, epochs: int | range) -> Iterator[int]:
        """The epochs still to run, as the members agree on them: ``range(start, stop)`` starts a
        job resumed from its checkpoint at ``start``. The final ``check_identical`` runs when they
        are done."""
        span = range(epochs) if isinstance(epochs, int) else epochs
        if span.step != 1:
            raise ValueError(f"epochs() takes an int or a range of step 1, got {span!r}")
        if self.progress["epoch"] < span.start:  # (a newcomer's is overwritten by the members')
            self.progress.update(epoch=span.start, sample=0)
        while True:
            self._ready()
            epoch = self.progress["epoch"]
            if epoch >= span.stop:
                break
            if self._shard is not None and not self._shard._plan():  # a member had finished it
                self._next_epoch()
                continue
            yield epoch
            if self.progress["epoch"] == epoch:
                self._next_epoch()
        self._finish()

    def steps(self, total: int) -> Iterator[int]:
        """The step numbers still to run up to ``total``, for a loop without epochs: call
        ``run_step`` once in each (a step lost to a rank's loss comes again). The final
        ``check_identical`` runs when they are done."""
        while True:
            self._ready()
            if self.progress["step"] >= total:
                break
            yield self.progress["step"]
        self._finish()

    def run_step(self, fn: Callable[_P, _R], *args: _P.args, **kwargs: _P.kwargs) -> _R | None:
        """``fn(*args, **kwargs)``, one training step, where a lost rank is survived: its result,
        or None when a rank was lost in it (the survivors shrank; the step's batch comes again,
        re-sharded). Then ``progress`` moves on by one step (and the batch, from ``shard()``),
        the state is checked every ``check_every`` steps, and waiting replacements are let in.
        Keep the step's collectives before ``optimizer.step()``: a loss after it leaves the
        survivors' state a step ahead of ``progress``, and that batch is trained on twice."""
        self._ready()
        return self._guarded(lambda: self._step(fn(*args, **kwargs)))[1]

    def _step(self, result: _R) -> _R:
        self.progress["step"] += 1
        self.progress["sample"] += self._pending
        self._pending = 0
        if self._check_every and self.progress["step"] % self._check_every == 0:
            self._comm.check_identical(*self._state)
        old, new = self._comm, self._comm.admit()  # at a step boundary: every member is here
        if new is not old:
            self._comm, self._share = new, True
            self._say(f"admitted job rank(s) {list(new.membership.admitted)} at step {self.progress['step']}; "
                      f"{new.world_size} ranks", old)  # (the new main process may be a newcomer: it knows not)
        return result

    def _guarded(self, fn: Callable[[], _R]) -> tuple[bool, _R | None]:
        """(True, fn()), or (False, None) once the survivors of a lost rank shrank: the state goes
        round before anything else. A bug, a mismatch, raises: no shrink makes it go away."""
        try:
            return True, fn()
        except Exception as e:
            if not is_rank_loss(e):
                raise
            self._comm, self._share = self._comm.shrink(), True
            self._say(f"lost job rank(s) {list(self._comm.membership.lost)} at step {self.progress['step']} "
                      f"({type(e).__name__}); going on with {self._comm.world_size} ranks")
            return False, None

    def _ready(self) -> None:
        while self._share:
            self._guarded(self._share_state)

    def _share_state(self) -> None:
        self._comm.sync_state(*self._state, allow=self._allow)
        if self._on_change is not None:
            self._on_change(self._comm)
        self._share = False
        self._generation += 1

    def _next_epoch(self) -> None:
        self.progress.update(epoch=self.progress["epoch"] + 1, sample=0)

    def _finish(self) -> None:
        while not self._guarded(lambda: self._comm.check_identical(*self._state))[0]:
            self._ready()
        self._say(f"finished at step {self.progress['step']} on {self._comm.world_size} ranks; "
                  "check_identical: every member holds the same state")

    def _say(self, message: str, among: Communicator | None = None) -> None:
        """``log(message)`` on the main process of ``among`` (default: the current membership)."""
        if self._log is not None and (among or self._comm).is_main_process:
            self._log(message)


class ShardedLoader:
    """``ElasticLoop.shard(loader)``: iterating gives this rank's batches of the epoch the loop is
    in, re-sharded after each change of membership; ``len()``, how many are left for this rank."""

    def __init__(self, loop: ElasticLoop, loader: DataLoader[Any]) -> None:
        self._shuffle, self._seed, self._drop_tail = _sampling_of(loader)
        self._loop, self._loader = loop, loader
        self._orders: dict[int, list[int]] = {}

    def __len__(self) -> int:
        return len(self._plan())

    def __iter__(self) -> Iterator[Any]:
        loop = self._loop
        loop._ready()
        epoch, generation = loop.progress["epoch"], -1
        batches: Iterator[tuple[list[int], Any]] = iter(())
        while True:
            loop._ready()
            if loop.progress["epoch"] != epoch:  # the members' state moved on past this epoch
                return
            if generation != loop._generation:  # a new membership: re-plan from where the members are
                generation, plan = loop._generation, self._plan()
                batches = zip(plan, _loader_like(self._loader, plan), strict=True)
            step = next(batches, None)
            if step is None:
                return
            loop._pending = len(step[0]) * loop.comm.world_size  # (every rank's batch is as long)
            yield step[1]

    def _plan(self) -> list[list[int]]:
        """This rank's batches (dataset indices) of what is left of the epoch, over the current membership."""
        progress, comm, size = self._loop.progress, self._loop.comm, self._loader.batch_size
        assert size is not None  # (refused in _sampling_of)
        left = self._order(progress["epoch"])[progress["sample"]:]
        mine = shard_of(left, comm.world_size, comm.rank, drop_tail=self._drop_tail)
        plan = [mine[i:i + size] for i in range(0, len(mine), size)]
        if self._loader.drop_last and plan and len(plan[-1]) < size:
            plan.pop()
        return plan

    def _order(self, epoch: int) -> list[int]:
        """The epoch's order of the dataset, the same on every rank: DistributedSampler's."""
        if epoch not in self._orders:
            n = len(self._loader.dataset)  # type: ignore[arg-type]  # (a map-style dataset: _sampling_of)
            if self._shuffle:
                order = torch.randperm(n, generator=torch.Generator().manual_seed(self._seed + epoch)).tolist()
            else:
                order = list(range(n))
            self._orders = {epoch: order}  # (one epoch at a time: a big dataset's order is kept once)
        return self._orders[epoch]


def shard_of(indices: list[int], world: int, rank: int, *, drop_tail: bool = False) -> list[int]:
    """Rank ``rank``'s share of ``indices`` among ``world`` ranks, as DistributedSampler deals
    them: every ``world``-th one from ``rank``, padded from the start (or, ``drop_tail``, cut) to
    the same count on every rank, so that every rank takes as many steps."""
    if not indices:
        return []
    per = len(indices) // world if drop_tail else math.ceil(len(indices) / world)
    total = per * world
    padded = (indices * math.ceil(total / len(indices)))[:total]
    return padded[rank:total:world]


def _sampling_of(loader: DataLoader[Any]) -> tuple[bool, int, bool]:
    """(shuffle, seed, drop_tail) of ``loader``'s sampler; a loader that can't be re-sharded is refused."""
    if not isinstance(loader, DataLoader) or isinstance(loader.dataset, IterableDataset) \
            or not isinstance(loader.dataset, Sized):
        raise TypeError(f"shard() takes a DataLoader over a map-style dataset (one with len()), got {loader!r}")
    if loader.batch_size is None:
        raise TypeError("shard() needs the DataLoader's batch_size (it makes the batches); this one has a "
                        "batch_sampler of its own or no batching")
    sampler = loader.sampler
    if isinstance(sampler, DistributedSampler):
        return sampler.shuffle, sampler.seed, sampler.drop_last
    if isinstance(sampler, RandomSampler) and not sampler.replacement and sampler._num_samples is None:
        return True, 0, False
    if isinstance(sampler, SequentialSampler):
        return False, 0, False
    raise TypeError(f"shard() re-shards a DataLoader over a DistributedSampler, a RandomSampler (without "
                    f"replacement) or a SequentialSampler (shuffle=True or False); this one's is {sampler!r}")


# What a DataLoader keeps of its arguments, passed on to the loader over a plan's batches (those the
# installed torch has: in_order came in 2.6; in_order=True below all the same, so batches match the plan).
_KEPT = ("num_workers", "collate_fn", "pin_memory", "timeout", "worker_init_fn", "multiprocessing_context",
         "generator", "prefetch_factor", "persistent_workers", "pin_memory_device")


def _loader_like(loader: DataLoader[Any], plan: list[list[int]]) -> DataLoader[Any]:
    kept = {name: getattr(loader, name) for name in _KEPT if hasattr(loader, name)}
    if hasattr(loader, "in_order"):
        kept["in_order"] = True
    return DataLoader(loader.dataset, batch_sampler=plan, **kept)


def _check_model(model: Any, optimizer: Any) -> None:
    """Refused before any communication: what sync_state couldn't hand over whole."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError("ElasticLoop takes the model DDP wraps (ddp.module): DDP is built again over each "
                        "new membership, in on_change")
    if not (callable(getattr(model, "state_dict", None)) and callable(getattr(model, "load_state_dict", None))):
        raise TypeError(f"the model must have state_dict() and load_state_dict(), got {type(model).__name__}")
    if optimizer is None:
        return
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, or None where there is none, got "
                        f"{type(optimizer).__name__}")
    if isinstance(model, torch.nn.Module):
        own = {id(p) for p in model.parameters()}
        if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
            raise ValueError("the optimizer steps parameters that are not the model's: pass the model it was "
                             "made for (its state and the model's go round together)")


def _check_state(optimizer: Any, state: tuple[Any, ...]) -> None:
    for obj in state:
        if isinstance(obj, torch.optim.Optimizer) and optimizer is None:
            raise TypeError("pass the optimizer as ElasticLoop's third argument, not among the other state")
        if not isinstance(obj, dict) and not (callable(getattr(obj, "state_dict", None))
                                              and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"state objects have state_dict() and load_state_dict(), or are dicts; got "
                            f"{type(obj).__name__}")
    # A scheduler marks the step of the optimizer it drives (torch's own marker): its last_epoch and
    # learning rate must go round too, or a replacement trains with the first epoch's rate.
    scheduled = optimizer is not None and hasattr(optimizer.step, "_wrapped_by_lr_sched")
    if scheduled and not any(isinstance(obj, torch.optim.lr_scheduler.LRScheduler) for obj in state):
        raise ValueError("a learning-rate scheduler drives this optimizer: pass it too "
                         "(ElasticLoop(comm, model, optimizer, scheduler, ...))")
