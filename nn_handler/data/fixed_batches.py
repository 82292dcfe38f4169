"""Loaders of the reproducible mode (TrainerConfig.reproducible): batches fixed by the data
and the seed, never by the number of ranks.

Training: an epoch's order is one permutation of the dataset drawn from (seed, epoch), the
same on every rank. Optimizer step ``s`` takes the samples ``order[s*G:(s+1)*G]`` (G: the
global batch size), cut into micro-batches of ``m`` samples; micro-batch ``j`` of a step runs
on rank ``j % W``. So the samples of a step, and how they are cut, do not depend on W; a rank
may own no micro-batch of a step (W larger than G/m, or a short last step) and still takes part
in it. Evaluation: batches of ``batch_size`` samples in dataset order, batch ``j`` on rank
``j % W``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sized
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from nn_handler.data.samplers import derive_seed
from nn_handler.errors import ConfigError

#: The stream of the seed the epochs' orders use (beyond any rank's own stream).
_ORDER_STREAM = 2**31 - 7


def steps_per_epoch(n: int, global_batch_size: int, drop_last: bool) -> int:
    """Optimizer steps per epoch: every full global batch, and a short last one unless
    ``drop_last``. Raises ConfigError when there is none."""
    steps = n // global_batch_size if drop_last else math.ceil(n / global_batch_size)
    if steps < 1:
        raise ConfigError(
            f"the dataset has {n} samples, fewer than global_batch_size={global_batch_size} "
            f"with drop_last=True: no optimizer step. Lower global_batch_size or set "
            f"drop_last=False."
        )
    return steps


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's order of all ``n`` samples: the same on every rank and every world size."""
    if not shuffle:
        return list(range(n))
    generator = torch.Generator().manual_seed(derive_seed(seed, _ORDER_STREAM, epoch))
    return torch.randperm(n, generator=generator).tolist()


def micro_batches(
    order: list[int], step: int, global_batch_size: int, micro_batch_size: int
) -> list[list[int]]:
    """The micro-batches of optimizer step ``step``: its samples cut in order into lists of
    ``micro_batch_size`` (the last of a short step may be shorter)."""
    samples = order[step * global_batch_size : (step + 1) * global_batch_size]
    return [samples[i : i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]


def owns(index: int, rank: int, world_size: int) -> bool:
    """Whether rank ``rank`` of ``world_size`` runs micro-batch (or evaluation batch) ``index``."""
    return index % world_size == rank


class MicroBatch:
    """One micro-batch of a step: its index in the step, its number of samples, the batch.
    Given ``load`` instead of a batch, the batch is loaded when first read (once)."""

    __slots__ = ("_batch", "_load", "index", "size")

    def __init__(
        self, index: int, size: int, batch: Any = None, load: Callable[[], Any] | None = None
    ) -> None:
        self.index, self.size = index, size
        self._batch, self._load = batch, load

    @property
    def batch(self) -> Any:
        if self._load is not None:
            self._batch, self._load = self._load(), None
        return self._batch

    @property
    def loaded(self) -> bool:
        """Whether the batch is in memory (read once, or given)."""
        return self._load is None

    def __repr__(self) -> str:
        return f"MicroBatch(index={self.index}, size={self.size}, loaded={self.loaded})"


@dataclass(frozen=True)
class StepBatch:
    """What one rank trains in one optimizer step: its micro-batches (possibly none) and the
    number of samples of the whole step (every rank's)."""

    step: int
    micro: tuple[MicroBatch, ...]
    samples: int


class _OnDemandBatches(Sampler[list[int]]):
    """Yields, each time the loader asks, the list of indices set last (``pending``): a
    single-process DataLoader over it loads one batch when told to."""

    def __init__(self) -> None:
        self.pending: list[int] = []

    def __iter__(self) -> Iterator[list[int]]:
        while True:
            yield self.pending


class _ListedBatches(Sampler[list[int]]):
    """Yields the lists of indices it is given (the loader sets them before each pass)."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self.batches))

    def __len__(self) -> int:
        return len(self.batches)


def _length(dataset: Dataset[Any]) -> int:
    if not isinstance(dataset, Sized):
        raise ConfigError(
            f"the reproducible mode needs a map-style dataset with __len__, got "
            f"{type(dataset).__name__}."
        )
    return len(dataset)


class FixedBatchLoader:
    """This rank's training loader in the reproducible mode: one StepBatch per optimizer
    step. ``set_epoch(e)`` before each epoch; ``start_at(s)`` makes the next pass begin at
    step ``s`` of the epoch (a resumed epoch, at any world size) without loading the steps
    before it. ``on_demand`` (without workers): each micro-batch is loaded when first read,
    not when its step is yielded (a fault-tolerant member reads only the micro-batches it
    trains; with workers, which load ahead, every one is loaded).

    Attributes:
        batch_size: the global batch size (what a checkpoint records of the loader).
        seed: the seed of the epochs' orders.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        global_batch_size: int,
        micro_batch_size: int,
        seed: int,
        shuffle: bool,
        drop_last: bool,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        on_demand: bool = False,
        **loader_kwargs: Any,
    ) -> None:
        self.n = _length(dataset)
        self.steps = steps_per_epoch(self.n, global_batch_size, drop_last)
        self.batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.seed, self.shuffle = seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self._start = 0
        self._sampler = _ListedBatches()
        self._generator = torch.Generator()  # the DataLoader never draws from the global RNG
        self._loader: DataLoader[Any] = DataLoader(
            dataset,
            batch_sampler=self._sampler,
            collate_fn=collate_fn,
            generator=self._generator,
            **loader_kwargs,
        )
        self._pending = _OnDemandBatches()
        self._demand: DataLoader[Any] | None = None
        if on_demand and not loader_kwargs.get("num_workers"):
            self._demand = DataLoader(
                dataset,
                batch_sampler=self._pending,
                collate_fn=collate_fn,
                generator=self._generator,
                **loader_kwargs,
            )

    @property
    def on_demand(self) -> bool:
        """Whether micro-batches are loaded when first read (``on_demand`` and no workers)."""
        return self._demand is not None

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, step: int) -> None:
        """The next pass begins at step ``step`` of the epoch (once)."""
        if not 0 <= step <= self.steps:
            raise ConfigError(
                f"cannot start at step {step}: an epoch of this loader has {self.steps} steps."
            )
        self._start = step

    def __len__(self) -> int:
        return self.steps

    def plan(self, start: int = 0) -> list[list[tuple[int, list[int]]]]:
        """This rank's micro-batches (index in the step, sample indices) of every step of the
        epoch from ``start``, in order."""
        order = epoch_order(self.n, self.seed, self.epoch, self.shuffle)
        rank, world = self.rank, self.world_size
        return [
            [(j, idx) for j, idx in enumerate(cut) if owns(j, rank, world)]
            for cut in (
                micro_batches(order, step, self.batch_size, self.micro_batch_size)
                for step in range(start, self.steps)
            )
        ]

    def __iter__(self) -> Iterator[StepBatch]:
        start, self._start = self._start, 0
        plan = self.plan(start)
        self._generator.manual_seed(derive_seed(self.seed, self.rank, self.epoch))
        if self._demand is not None:
            read = functools.partial(self._read, iter(self._demand))
            for offset, owned in enumerate(plan):
                micro = tuple(
                    MicroBatch(j, len(idx), load=functools.partial(read, idx)) for j, idx in owned
                )
                yield self._step(start + offset, micro)
            return
        self._sampler.batches = [idx for step in plan for _, idx in step]
        batches = iter(self._loader)
        for offset, owned in enumerate(plan):
            micro = tuple(MicroBatch(j, len(idx), next(batches)) for j, idx in owned)
            yield self._step(start + offset, micro)

    def _step(self, step: int, micro: tuple[MicroBatch, ...]) -> StepBatch:
        return StepBatch(step, micro, min(self.batch_size, self.n - step * self.batch_size))

    def _read(self, batches: Iterator[Any], indices: list[int]) -> Any:
        """Those samples as one batch, through ``batches`` (the on-demand loader's iterator:
        any indices, in any order, any number of times)."""
        self._pending.pending = indices
        return next(batches)


class FixedEvalLoader:
    """This rank's evaluation loader in the reproducible mode: batches of ``batch_size`` in
    dataset order, batch ``j`` on rank ``j % W``.

    Attributes:
        batch_ids: the index of each batch this rank takes, in order.
        total_batches: the batches of every rank.
        indices: the dataset indices this rank visits, in order (for ``predict``).
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        **loader_kwargs: Any,
    ) -> None:
        n = _length(dataset)
        every = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
        self.batch_size = batch_size
        self.total_batches = len(every)
        self.batch_ids = [j for j in range(len(every)) if owns(j, rank, world_size)]
        self.indices = [i for j in self.batch_ids for i in every[j]]
        sampler = _ListedBatches()
        sampler.batches = [every[j] for j in self.batch_ids]
        self._loader: DataLoader[Any] = DataLoader(
            dataset, batch_sampler=sampler, collate_fn=collate_fn, **loader_kwargs
        )

    def set_epoch(self, epoch: int) -> None:
        """Nothing to do: evaluation batches do not change between epochs."""

    def __len__(self) -> int:
        return len(self.batch_ids)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)


__all__ = [
    "FixedBatchLoader",
    "FixedEvalLoader",
    "MicroBatch",
    "StepBatch",
    "epoch_order",
    "micro_batches",
    "owns",
    "steps_per_epoch",
]
