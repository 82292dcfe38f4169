"""The rest of an interrupted epoch on another number of ranks, every sample exactly once.

The LoaderFactory's training loaders shard an epoch's order the DistributedSampler way: rank r
of W takes positions r, r + W, r + 2W, ... So after ``b`` batches of ``B`` on every rank, the
samples visited are exactly the first ``b * B * W`` of the epoch's order (a prefix), whatever
W. The rest of the order is then split over the W' ranks of the resumed run:

- rank r' takes positions r', r' + W', ... of the rest (sizes differ by at most one);
- every rank takes the same number of batches, ``ceil(rest / (W' * B'))`` (DDP and FSDP pair
  the ranks' steps): full batches first, then smaller ones, none empty;
- no sample is repeated, except in two corners where equal step counts need it: fewer
  samples left than ranks (a rank with none takes the first remaining one), and batches of one
  sample with an uneven split (a rank one sample short repeats its last).

Later epochs use the ordinary loader of W' ranks.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch.utils.data import DataLoader, Sampler
from torch.utils.data.distributed import DistributedSampler

from nn_handler.data.samplers import ExactEvalSampler
from nn_handler.data.worker_seeds import PassSeededDataset, PassTaggedSampler
from nn_handler.errors import CheckpointError


def rest_batches(
    rest: Sequence[int], world_size: int, rank: int, batch_size: int
) -> list[list[int]]:
    """Rank ``rank``'s batches of the samples ``rest`` (see the module docstring)."""
    steps = math.ceil(len(rest) / (world_size * batch_size))
    if steps == 0:
        return []
    mine = list(rest[rank::world_size]) or [rest[0]]
    batches: list[list[int]] = []
    start = 0
    for step in range(steps):
        left = steps - step - 1  # batches still to fill after this one, one sample each
        take = max(1, min(batch_size, len(mine) - start - left))
        batches.append(mine[start : start + take] if start < len(mine) else [mine[-1]])
        start += take
    return batches


class _Batches(Sampler[list[int]]):
    def __init__(self, batches: list[list[int]]) -> None:
        self.batches = batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def epoch_order(sampler: DistributedSampler[Any]) -> list[int]:
    """The whole epoch's order of a DistributedSampler (its current epoch), before sharding."""
    whole = copy.copy(sampler)
    whole.num_replicas, whole.rank = 1, 0
    whole.drop_last = False
    whole.num_samples = whole.total_size = len(sampler.dataset)  # type: ignore[arg-type]
    return list(iter(whole))


def rest_of_epoch(
    loader: Iterable[Any],
    *,
    saved_world: int,
    saved_batch_size: int,
    batches_done: int,
    rank: int,
    world_size: int,
) -> DataLoader[Any]:
    """A loader of this rank's part of the rest of the current epoch, which ``saved_world``
    ranks with batches of ``saved_batch_size`` (0: this loader's) had trained
    ``batches_done`` batches of (call ``loader.set_epoch`` first). Raises CheckpointError
    for loaders it cannot follow: it follows the LoaderFactory's distributed training loaders
    (a DataLoader over a DistributedSampler) only."""
    sampler: Any = getattr(loader, "sampler", None)
    if isinstance(sampler, PassTaggedSampler):
        sampler = sampler.sampler
    followed = isinstance(sampler, DistributedSampler) and not isinstance(sampler, ExactEvalSampler)
    if not followed or not isinstance(loader, DataLoader):
        raise CheckpointError(
            f"a mid-epoch checkpoint written by {saved_world} rank(s) can continue on "
            f"{world_size} only with the LoaderFactory's distributed training loader (pass the "
            f"dataset to train(), with loader.mode='distributed'); this loader's sampler is "
            f"{type(sampler).__name__}. Resume with {saved_world} rank(s), or from a checkpoint "
            f"written between epochs."
        )
    batch_size = loader.batch_size or saved_batch_size or 1
    saved_batch_size = saved_batch_size or batch_size  # 0: not recorded, as this loader's
    order = epoch_order(sampler)
    rest = order[min(batches_done * saved_batch_size * saved_world, len(order)) :]
    batches = rest_batches(rest, world_size, rank, batch_size)
    dataset = loader.dataset
    if isinstance(dataset, PassSeededDataset):
        dataset = dataset.dataset
    return DataLoader(
        dataset,
        batch_sampler=_Batches(batches),
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
    )


__all__ = ["epoch_order", "rest_batches", "rest_of_epoch"]
