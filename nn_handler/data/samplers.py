"""Samplers: exact evaluation over a DistributedSampler, and shard batches for cached data."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized

import numpy as np
import torch
from torch.utils.data import Sampler
from torch.utils.data.distributed import DistributedSampler

from nn_handler.data.sharding import eval_indices


def derive_seed(seed: int, rank: int, epoch: int) -> int:
    """A well-mixed 63-bit seed from (seed, rank, epoch): distinct streams, reproducible."""
    state = np.random.SeedSequence([seed, rank, epoch]).generate_state(1, dtype=np.uint64)
    return int(state[0]) & (2**63 - 1)


class ExactEvalSampler(DistributedSampler[int]):
    """Every index exactly once across ranks, in order: rank r yields r, r + W, r + 2W, ...

    No padding and no dropping, unlike DistributedSampler; ranks hold floor(N/W) or ceil(N/W)
    indices. ``indices`` lists this rank's indices in the order they are visited.
    """

    def __init__(self, dataset: Sized, num_replicas: int, rank: int) -> None:
        super().__init__(
            dataset,  # type: ignore[arg-type]
            num_replicas=num_replicas,
            rank=rank,
            shuffle=False,
            drop_last=False,
        )
        self.indices = list(eval_indices(len(dataset), num_replicas, rank))
        self.num_samples = len(self.indices)
        self.total_size = len(dataset)

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return self.num_samples


class ShardBatchSampler(Sampler[list[int]]):
    """Batches of positions 0..size-1 within this rank's cached shard.

    With ``shuffle``, each epoch's order is a permutation drawn from (seed, rank, epoch):
    the same on every run, different between epochs.
    """

    def __init__(
        self, size: int, batch_size: int, shuffle: bool, drop_last: bool, seed: int, rank: int
    ) -> None:
        self.size = size
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = seed
        self.rank = rank
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(derive_seed(self.seed, self.rank, self.epoch))
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        for batch in range(len(self)):
            yield order[batch * self.batch_size : (batch + 1) * self.batch_size]

    def __len__(self) -> int:
        if self.drop_last:
            return self.size // self.batch_size
        return math.ceil(self.size / self.batch_size)


__all__ = ["ExactEvalSampler", "ShardBatchSampler", "derive_seed"]
