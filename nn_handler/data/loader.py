"""EpochDataLoader: a DataLoader with set_epoch, reproducible shuffles and worker seeds."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from nn_handler.data.samplers import derive_seed


class EpochDataLoader(DataLoader[Any]):
    """A torch DataLoader whose :meth:`set_epoch` makes each epoch reproducible.

    ``set_epoch(e)`` sets the sampler's epoch (a new order that is the same on every run) and
    reseeds the loader's generator from (seed, rank, e). torch draws each epoch's worker seed
    from that generator, and seeds torch, random and numpy in worker ``w`` from it plus ``w``:
    so worker streams depend only on (seed, rank, epoch, worker). With persistent workers the
    workers start once and are seeded from the epoch in which they started.

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
