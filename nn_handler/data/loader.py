"""EpochDataLoader: a DataLoader with set_epoch, reproducible shuffles and worker seeds."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from nn_handler.data.samplers import derive_seed
from nn_handler.data.worker_seeds import PassSeededDataset, PassTaggedSampler


class EpochDataLoader(DataLoader[Any]):
    """A torch DataLoader whose ``set_epoch`` makes each epoch reproducible.

    ``set_epoch(e)`` sets the sampler's epoch (a new order that is the same on every run) and
    reseeds the loader's generator from (seed, rank, e). With workers, each worker reseeds
    torch, ``random`` and NumPy at the start of every pass over the data from (seed, rank,
    epoch, worker id) (see worker_seeds.py), persistent workers included: worker streams
    depend only on those, so a run resumed at any epoch, or mid-epoch, draws the same random
    augmentations as the run that never stopped. ``dataset`` and ``sampler`` are then thin
    wrappers of the ones given (their attributes read through).

    Attributes:
        indices: for evaluation loaders, the dataset indices this rank visits, in order.
        epoch: the last epoch set.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        *,
        seed: int,
        rank: int,
        indices: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        generator = torch.Generator()
        generator.manual_seed(derive_seed(seed, rank, 0))
        sampler = kwargs.get("sampler")
        if kwargs.get("num_workers", 0) > 0 and sampler is not None:
            dataset = PassSeededDataset(dataset, seed, rank)
            kwargs["sampler"] = PassTaggedSampler(sampler)
        super().__init__(dataset, generator=generator, **kwargs)
        self._seed_generator = generator
        self.seed = seed
        self.rank = rank
        self.epoch = 0
        self.indices = indices

    def set_epoch(self, epoch: int) -> None:
        """Select epoch ``epoch``'s order and worker seeds. Call it before iterating."""
        self.epoch = epoch
        for sampler in (self.sampler, self.batch_sampler):
            set_sampler_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_sampler_epoch):
                set_sampler_epoch(epoch)
        self._seed_generator.manual_seed(derive_seed(self.seed, self.rank, epoch))


__all__ = ["EpochDataLoader"]
