"""Pure arithmetic of who gets which sample: equal training shards and exact evaluation shards.

Training (every rank must take the same number of steps, or DDP waits on the rank that ran out):
    per-rank samples S = ceil(N / W)  (drop_last=False: the tail is padded by repeating samples
                                       from the start of the epoch's order, as DistributedSampler)
                       = floor(N / W) (drop_last=True: the last N mod W samples are dropped)
    steps per rank     = ceil(S / B)  (drop_last=False: the last batch may be smaller)
                       = floor(S / B) (drop_last=True: only full batches)
Evaluation (every sample exactly once): rank r visits indices r, r + W, r + 2W, ... < N, so ranks
hold floor(N / W) or ceil(N / W) samples and may take one batch more or less than each other.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from nn_handler.errors import ConfigError


def _check(n: int, world_size: int, batch_size: int = 1) -> None:
    if n < 1:
        raise ConfigError("the dataset is empty: a loader needs at least one sample.")
    if world_size < 1 or batch_size < 1:
        raise ConfigError(f"world_size={world_size} and batch_size={batch_size} must be >= 1.")


def train_samples_per_rank(n: int, world_size: int, drop_last: bool) -> int:
    """Samples each rank sees per training epoch (the same on every rank)."""
    _check(n, world_size)
    return n // world_size if drop_last else math.ceil(n / world_size)


def train_steps_per_rank(n: int, world_size: int, batch_size: int, drop_last: bool) -> int:
    """Batches each rank takes per training epoch (the same on every rank).

    Raises ConfigError when drop_last leaves no full batch, instead of training on nothing.
    """
    _check(n, world_size, batch_size)
    samples = train_samples_per_rank(n, world_size, drop_last)
    steps = samples // batch_size if drop_last else math.ceil(samples / batch_size)
    if steps == 0:
        raise ConfigError(
            f"with drop_last=True, {n} samples over {world_size} rank(s) give each rank "
            f"{samples} sample(s), fewer than batch_size={batch_size}: no full batch. Lower "
            f"batch_size or set drop_last=False."
        )
    return steps


def train_shard(order: Sequence[int], world_size: int, rank: int, drop_last: bool) -> list[int]:
    """Rank ``rank``'s training indices from an epoch's ``order`` of all N indices.

    Pads ``order`` cyclically (or truncates it) to a multiple of ``world_size``, then takes every
    ``world_size``-th index from position ``rank``: the same rule as DistributedSampler.
    """
    n = len(order)
    per_rank = train_samples_per_rank(n, world_size, drop_last)
    total = per_rank * world_size
    padded = list(order[:total])
    while len(padded) < total:
        padded.extend(order[: total - len(padded)])
    return padded[rank:total:world_size]


def eval_indices(n: int, world_size: int, rank: int) -> range:
    """Rank ``rank``'s evaluation indices: every sample exactly once across the ranks."""
    _check(n, world_size)
    return range(rank, n, world_size)


def eval_steps(n: int, world_size: int, rank: int, batch_size: int) -> int:
    """Batches rank ``rank`` takes in evaluation (may differ by one between ranks)."""
    return math.ceil(len(eval_indices(n, world_size, rank)) / batch_size)


__all__ = [
    "eval_indices",
    "eval_steps",
    "train_samples_per_rank",
    "train_shard",
    "train_steps_per_rank",
]
