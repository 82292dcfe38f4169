"""Configuration of the data: how the LoaderFactory builds loaders."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, StrictBool

from nn_handler.config.base import ConfigModel

LoaderMode = Literal["distributed", "rank_cached"]


class LoaderConfig(ConfigModel):
    """How the LoaderFactory builds loaders. ``batch_size`` is per rank: the effective batch size
    of one optimizer step is ``batch_size x world_size`` (x gradient accumulation steps).

    Attributes:
        batch_size: samples per batch on each rank.
        shuffle: shuffle training data (reproducibly, from ``seed`` and the epoch). Evaluation
            loaders never shuffle.
        num_workers: worker processes per rank, clamped to the CPUs available per local rank.
            Rank-cached loaders serve from memory in the main process and use none.
        pin_memory: None: only when the device is CUDA (forced off otherwise).
        persistent_workers: None: when there are workers (forced off without workers).
        prefetch_factor: batches prefetched per worker (only with workers).
        drop_last: training only: drop the tail so every rank gets the same number of full
            batches (see docs/data.md for the exact rule); otherwise the tail is padded.
        seed: the one seed behind shuffles, shards and worker seeds, on every rank.
        mode: 'distributed' (a DistributedSampler over the dataset) or 'rank_cached' (each rank
            reads its shard once into memory).
    """

    batch_size: int = Field(default=32, ge=1, strict=True)
    shuffle: StrictBool = True
    num_workers: int = Field(default=0, ge=0, strict=True)
    pin_memory: StrictBool | None = None
    persistent_workers: StrictBool | None = None
    prefetch_factor: int | None = Field(default=None, ge=1, strict=True)
    drop_last: StrictBool = False
    seed: int = Field(default=0, ge=0, lt=2**63, strict=True)
    mode: LoaderMode = "distributed"


__all__ = ["LoaderConfig", "LoaderMode"]
