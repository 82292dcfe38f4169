"""Worker random streams that depend only on (seed, rank, epoch, worker), persistent or not.

torch seeds a worker once, when it starts. Persistent workers start in the first epoch and
their streams run on across epochs, so a run resumed at epoch k (whose workers start at k)
draws different augmentations from the run that never stopped. Here every index the sampler
yields carries the loader's pass (its epoch and a count of passes); a worker that sees a new
pass first reseeds torch, ``random`` and NumPy from (seed, rank, epoch) and its worker id, as
a freshly started worker would be. The cost is one tuple per index and one reseed per worker
and pass. Re-reading the batches already trained after a mid-epoch resume then reproduces
every worker's stream exactly.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler, get_worker_info

from nn_handler.data.samplers import derive_seed

#: Stream key of the worker seeds (distinct from the shuffles' streams).
_WORKER_STREAM = 2**32 - 2


def worker_seed(seed: int, rank: int, epoch: int, worker: int) -> int:
    """The seed of worker ``worker`` of ``rank`` in ``epoch`` (63 bits)."""
    return derive_seed(seed, rank, epoch * 4096 + worker + _WORKER_STREAM)


def seed_this_process(value: int) -> None:
    """Seed torch, ``random`` and NumPy's global generator of this process from ``value``."""
    torch.manual_seed(value)
    random.seed(value)
    np.random.seed(np.random.SeedSequence(value).generate_state(4))


class PassTaggedSampler(Sampler[Any]):
    """Yields ``(pass, index)`` for each index of ``sampler``; ``pass`` is (epoch, count).

    ``set_epoch`` is passed on to the wrapped sampler; ``len`` is the wrapped sampler's.
    """

    def __init__(self, sampler: Sampler[Any]) -> None:
        self.sampler = sampler
        self.epoch = 0
        self._passes = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)

    def __iter__(self) -> Iterator[tuple[tuple[int, int], Any]]:
        self._passes += 1
        tag = (self.epoch, self._passes)
        for index in self.sampler:
            yield tag, index

    def __len__(self) -> int:
        if not isinstance(self.sampler, Sized):
            raise TypeError(f"{type(self.sampler).__name__} has no len()")
        return len(self.sampler)

    def __getattr__(self, name: str) -> Any:  # seed, indices, ... of the wrapped sampler
        if name == "sampler":
            raise AttributeError(name)
        return getattr(self.sampler, name)


class PassSeededDataset(Dataset[Any]):
    """Reads ``dataset[index]`` for ``(pass, index)`` keys; in a worker process, a new pass
    first reseeds the worker's generators from (seed, rank, epoch, worker id)."""

    def __init__(self, dataset: Dataset[Any], seed: int, rank: int) -> None:
        self.dataset = dataset
        self.seed = seed
        self.rank = rank
        self._pass: tuple[int, int] | None = None

    def _enter(self, tag: tuple[int, int]) -> None:
        if tag == self._pass:
            return
        self._pass = tag
        info = get_worker_info()
        if info is not None:
            seed_this_process(worker_seed(self.seed, self.rank, tag[0], info.id))

    def __getitem__(self, key: tuple[tuple[int, int], Any]) -> Any:
        tag, index = key
        self._enter(tag)
        return self.dataset[index]

    def __getitems__(self, keys: list[tuple[tuple[int, int], Any]]) -> list[Any]:
        if not keys:
            return []
        self._enter(keys[0][0])
        indices = [index for _, index in keys]
        many = getattr(self.dataset, "__getitems__", None)
        if callable(many):
            return list(many(indices))
        return [self.dataset[index] for index in indices]

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # the wrapped dataset's own attributes
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


__all__ = ["PassSeededDataset", "PassTaggedSampler", "seed_this_process", "worker_seed"]
