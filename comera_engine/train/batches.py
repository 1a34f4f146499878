"""Deterministic batches: the batch of step ``s`` is a pure function of ``(seed, s, rank)``.

Each epoch is a fresh permutation of the training set drawn from ``(seed, epoch)``; step
``s`` takes the ``s``-th slice of ``global_batch = batch_size * world_size`` indices
(incomplete last slices are dropped, so every batch has the same shape, as CUDA graphs
need) and process ``rank`` takes its own ``batch_size`` part. Random collation (MLM
masking) runs under a generator seeded from ``(seed, s, rank)``. So a run resumed at step
``k`` sees exactly the batches an uninterrupted run sees, with or without workers.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

Batch = dict[str, torch.Tensor]


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers (splitmix-style mixing; stable across runs/platforms)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x ^= (int(p) + 0x9E3779B97F4A7C15 + (x << 6) + (x >> 2)) & 0xFFFFFFFFFFFFFFFF
        x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


class BatchPlan:
    """Which examples process ``rank`` trains on at each step."""

    def __init__(self, n: int, batch_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.n = n
        self.batch_size = batch_size
        self.global_batch = batch_size * world_size
        if self.global_batch > n:
            raise ValueError(
                f"train.batch_size: a global batch of {self.global_batch} is larger than "
                f"the {n} training examples"
            )
        self.steps_per_epoch = n // self.global_batch
        self.seed = seed
        self.rank = rank
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None

    def epoch_of(self, step: int) -> int:
        return step // self.steps_per_epoch

    def indices(self, step: int) -> torch.Tensor:
        """Example indices [batch_size] of 0-based ``step`` for this process."""
        epoch, within = divmod(step, self.steps_per_epoch)
        if epoch != self._perm_epoch:
            gen = torch.Generator().manual_seed(mix_seed(self.seed, epoch, 0xDA7A))
            self._perm = torch.randperm(self.n, generator=gen)
            self._perm_epoch = epoch
        start = within * self.global_batch + self.rank * self.batch_size
        return self._perm[start : start + self.batch_size]


class StepBatches(Dataset):
    """Map-style dataset whose item ``s`` is the whole batch of step ``s`` (for a
    ``DataLoader`` with ``batch_size=None``, which then prefetches in workers)."""

    def __init__(
        self,
        dataset: Dataset,
        plan: BatchPlan,
        start: int,
        stop: int,
        collate_fn: Callable[[list[Batch]], Batch] | None = None,
    ) -> None:
        self.dataset = dataset
        self.plan = plan
        self.start = start
        self.stop = stop
        self.collate_fn = collate_fn
        self._columns = getattr(dataset, "tensors", None)

    def __len__(self) -> int:
        return max(self.stop - self.start, 0)

    def __getitem__(self, i: int) -> Batch:
        step = self.start + i
        idx = self.plan.indices(step)
        seed = mix_seed(self.plan.seed, step, self.plan.rank, 0xC011A7E)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            fn = self.collate_fn
            if fn is not None and hasattr(fn, "reseed"):
                fn.reseed(seed)  # e.g. MLMCollator: masking stream restarts per step
            if isinstance(self._columns, dict):
                columns = {k: v[idx] for k, v in self._columns.items()}
                if fn is None:
                    return columns
                if hasattr(fn, "mask_batch"):
                    return fn.mask_batch(columns)
            items = [self.dataset[int(j)] for j in idx]
            if fn is None:
                return torch.utils.data.default_collate(items)
            return _call_collate(fn, items, seed)


def _call_collate(fn: Callable[..., Batch], items: list[Batch], seed: int) -> Batch:
    """Collate with a seeded generator when the collate accepts one."""
    target = fn if inspect.isfunction(fn) or inspect.ismethod(fn) else fn.__call__
    if "generator" in inspect.signature(target).parameters:
        return fn(items, generator=torch.Generator().manual_seed(seed))
    return fn(items)


def iterate_batches(
    dataset: Dataset,
    plan: BatchPlan,
    start: int,
    stop: int,
    collate_fn: Callable[[list[Batch]], Batch] | None = None,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Iterator[tuple[int, Batch]]:
    """``(step, batch)`` for 0-based steps ``start .. stop-1``."""
    steps = StepBatches(dataset, plan, start, stop, collate_fn)
    if num_workers == 0:
        for i in range(len(steps)):
            batch = steps[i]
            yield start + i, _pin(batch) if pin_memory else batch
        return
    loader = DataLoader(
        steps,
        batch_size=None,
        shuffle=False,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        prefetch_factor=4,
    )
    for i, batch in enumerate(loader):
        yield start + i, batch


def eval_batch_count(n: int, batch_size: int, max_batches: int | None = None) -> int:
    """How many batches :func:`eval_batches` yields for ``n`` examples."""
    count = -(-n // batch_size)
    return count if max_batches is None else min(count, max_batches)


def eval_batches(
    dataset: Dataset, batch_size: int, max_batches: int | None = None
) -> Iterator[Batch]:
    """The eval split in order, ``batch_size`` at a time (last batch may be short)."""
    columns: Any = getattr(dataset, "tensors", None)
    n = len(dataset)
    count = 0
    for lo in range(0, n, batch_size):
        if max_batches is not None and count >= max_batches:
            return
        hi = min(lo + batch_size, n)
        if isinstance(columns, dict):
            yield {k: v[lo:hi] for k, v in columns.items()}
        else:
            yield torch.utils.data.default_collate([dataset[i] for i in range(lo, hi)])
        count += 1


def _pin(batch: Batch) -> Batch:
    return {k: v.pin_memory() for k, v in batch.items()}
