"""LoaderFactory: training and evaluation loaders for this rank, from one LoaderConfig."""

from __future__ import annotations

import os
from collections.abc import Callable, Sized
from typing import Any

import torch
from loguru import logger
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data.distributed import DistributedSampler

from nn_handler.config import LoaderConfig, ReproducibleConfig
from nn_handler.data.fixed_batches import FixedBatchLoader, FixedEvalLoader
from nn_handler.data.loader import EpochDataLoader
from nn_handler.data.rank_cached import RankCachedDataset
from nn_handler.data.samplers import ExactEvalSampler, ShardBatchSampler, derive_seed
from nn_handler.data.sharding import eval_indices, train_shard, train_steps_per_rank
from nn_handler.distributed.context import DistributedContext
from nn_handler.distributed.env import DistributedInfo
from nn_handler.errors import ConfigError

CollateFn = Callable[[list[Any]], Any]
_SHARD_STREAM = 2**32 - 1


def cpus_available() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


class LoaderFactory:
    """Builds this rank's loaders: every rank must build them with the same config and dataset.

    - ``train_loader``: every rank gets the same number of batches per epoch (docs/data.md has
      the rule), shuffled reproducibly per epoch.
    - ``eval_loader``: every sample exactly once across ranks, no padding, in order.
    Both return an ``EpochDataLoader``; call ``set_epoch(epoch)`` before each epoch.
    The final settings (after the defaults below) are logged once, on rank 0: pin_memory only
    on CUDA, persistent_workers and prefetch_factor only with workers, num_workers clamped to
    the CPUs available per local rank, no workers for rank-cached loaders.
    """

    def __init__(
        self,
        config: LoaderConfig,
        info: DistributedInfo,
        device: torch.device,
        log_fn: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.info = info
        self.device = device
        self.log_fn = log_fn
        self.settings, self.adjustments = self._resolve()
        self._logged = False

    @classmethod
    def from_context(
        cls,
        config: LoaderConfig,
        context: DistributedContext,
        log_fn: Callable[[str], None] | None = None,
    ) -> LoaderFactory:
        return cls(config, context.info, context.device, log_fn)

    def _resolve(self) -> tuple[dict[str, Any], list[str]]:
        c = self.config
        notes: list[str] = []
        workers = c.num_workers
        budget = max(0, cpus_available() // self.info.local_world_size)
        if c.mode == "rank_cached" and workers:
            notes.append(f"num_workers {workers} -> 0 (rank-cached data is served from memory)")
            workers = 0
        elif workers > budget:
            notes.append(
                f"num_workers {workers} -> {budget} ({cpus_available()} CPUs for "
                f"{self.info.local_world_size} local rank(s))"
            )
            workers = budget
        cuda = self.device.type == "cuda"
        pin = cuda if c.pin_memory is None else c.pin_memory and cuda
        if c.pin_memory and not cuda:
            notes.append(f"pin_memory -> False (device {self.device} is not CUDA)")
        persistent = workers > 0 if c.persistent_workers is None else c.persistent_workers
        if persistent and workers == 0:
            notes.append("persistent_workers -> False (no workers)")
            persistent = False
        prefetch = c.prefetch_factor if workers else None
        if c.prefetch_factor is not None and not workers:
            notes.append("prefetch_factor dropped (no workers)")
        settings = {
            "mode": c.mode,
            "batch_size": c.batch_size,
            "effective_batch_size": c.batch_size * self.info.world_size,
            "shuffle": c.shuffle,
            "drop_last": c.drop_last,
            "num_workers": workers,
            "pin_memory": pin,
            "persistent_workers": persistent,
            "prefetch_factor": prefetch,
            "seed": c.seed,
        }
        return settings, notes

    def _log_once(self) -> None:
        if self._logged or self.info.rank != 0:
            return
        self._logged = True
        text = "loaders: " + ", ".join(f"{k}={v}" for k, v in self.settings.items())
        if self.adjustments:
            text += " (adjusted: " + "; ".join(self.adjustments) + ")"
        logger.info(text)
        if self.log_fn is not None:
            self.log_fn(text)

    def _length(self, dataset: Dataset[Any]) -> int:
        if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized):
            raise ConfigError(
                f"LoaderFactory needs a map-style dataset with __len__, got "
                f"{type(dataset).__name__}; wrap it, or pass a ready DataLoader instead."
            )
        return len(dataset)

    def _worker_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "num_workers": self.settings["num_workers"],
            "pin_memory": self.settings["pin_memory"],
            "persistent_workers": self.settings["persistent_workers"],
        }
        if self.settings["prefetch_factor"] is not None:
            kwargs["prefetch_factor"] = self.settings["prefetch_factor"]
        return kwargs

    def train_loader(
        self, dataset: Dataset[Any], collate_fn: CollateFn | None = None
    ) -> EpochDataLoader:
        """This rank's training loader: equal batches per epoch on every rank."""
        n = self._length(dataset)
        c, rank, world = self.config, self.info.rank, self.info.world_size
        train_steps_per_rank(n, world, c.batch_size, c.drop_last)  # rejects empty epochs
        self._log_once()
        if c.mode == "rank_cached":
            order = list(range(n))
            if c.shuffle:  # a random, fixed shard: sorted datasets still split fairly
                # The same order on every rank: a stream of the seed that no rank's own uses.
                generator = torch.Generator().manual_seed(derive_seed(c.seed, _SHARD_STREAM, 0))
                order = torch.randperm(n, generator=generator).tolist()
            shard = train_shard(order, world, rank, c.drop_last)
            cached = RankCachedDataset(dataset, shard, collate_fn)
            sampler = ShardBatchSampler(
                len(cached), c.batch_size, c.shuffle, c.drop_last, c.seed, rank
            )
            return self._cached_loader(cached, sampler, indices=None)
        distributed: DistributedSampler[Any] = DistributedSampler(
            dataset,
            num_replicas=world,
            rank=rank,
            shuffle=c.shuffle,
            seed=c.seed,
            drop_last=c.drop_last,
        )
        return EpochDataLoader(
            dataset,
            seed=c.seed,
            rank=rank,
            batch_size=c.batch_size,
            sampler=distributed,
            drop_last=c.drop_last,
            collate_fn=collate_fn,
            **self._worker_kwargs(),
        )

    def eval_loader(
        self, dataset: Dataset[Any], collate_fn: CollateFn | None = None
    ) -> EpochDataLoader:
        """This rank's evaluation loader: every sample exactly once across ranks, in order.

        Ranks may take one batch more or less than each other: a collective inside an
        evaluation step must not assume equal counts (gather results after the loop, e.g. with
        ``nn_handler.data.gather_in_dataset_order``).
        """
        n = self._length(dataset)
        c, rank, world = self.config, self.info.rank, self.info.world_size
        self._log_once()
        if c.mode == "rank_cached":
            indices = list(eval_indices(n, world, rank))
            cached = RankCachedDataset(dataset, indices, collate_fn)
            sampler = ShardBatchSampler(len(cached), c.batch_size, False, False, c.seed, rank)
            return self._cached_loader(cached, sampler, indices=indices)
        exact = ExactEvalSampler(dataset, world, rank)  # type: ignore[arg-type]
        return EpochDataLoader(
            dataset,
            seed=c.seed,
            rank=rank,
            indices=exact.indices,
            batch_size=c.batch_size,
            sampler=exact,
            collate_fn=collate_fn,
            **self._worker_kwargs(),
        )

    def reproducible_train_loader(
        self,
        dataset: Dataset[Any],
        reproducible: ReproducibleConfig,
        collate_fn: CollateFn | None = None,
        on_demand: bool = False,
    ) -> FixedBatchLoader:
        """This rank's training loader for TrainerConfig.reproducible: one StepBatch per
        optimizer step, the step's samples fixed at any world size (data/fixed_batches.py).
        The loader's seed, shuffle, drop_last and worker settings apply. ``on_demand``: each
        micro-batch loaded when first read (without workers; a fault-tolerant member's)."""
        c = self._reproducible_config()
        if "global_batch_size" not in self.settings:  # the step's sizes (they ignore W)
            rest = dict(self.settings)
            self.settings = {
                "mode": rest.pop("mode"),
                "global_batch_size": reproducible.global_batch_size,
                "micro_batch_size": reproducible.micro_batch_size,
                "evaluation_batch_size": rest.pop("batch_size"),
            }
            rest.pop("effective_batch_size", None)
            self.settings.update(rest)
        self._log_once()
        return FixedBatchLoader(
            dataset,
            global_batch_size=reproducible.global_batch_size,
            micro_batch_size=reproducible.micro_batch_size,
            seed=c.seed,
            shuffle=c.shuffle,
            drop_last=c.drop_last,
            rank=self.info.rank,
            world_size=self.info.world_size,
            collate_fn=collate_fn,
            on_demand=on_demand,
            **self._worker_kwargs(),
        )

    def reproducible_eval_loader(
        self, dataset: Dataset[Any], collate_fn: CollateFn | None = None
    ) -> FixedEvalLoader:
        """This rank's evaluation loader for TrainerConfig.reproducible: batches of
        ``batch_size`` in dataset order, batch j on rank j % W."""
        c = self._reproducible_config()
        self._log_once()
        return FixedEvalLoader(
            dataset,
            batch_size=c.batch_size,
            rank=self.info.rank,
            world_size=self.info.world_size,
            collate_fn=collate_fn,
            **self._worker_kwargs(),
        )

    def _reproducible_config(self) -> LoaderConfig:
        if self.config.mode == "rank_cached":
            raise ConfigError(
                "reproducible: loader mode 'rank_cached' gives each rank a shard of its own, "
                "while the mode's steps take fixed samples at any world size; use mode "
                "'distributed'."
            )
        return self.config

    def _cached_loader(
        self, cached: RankCachedDataset, sampler: ShardBatchSampler, indices: list[int] | None
    ) -> EpochDataLoader:
        # batch_size=None: the sampler yields whole batches of positions and the cached
        # dataset returns a ready batch for each, with no per-sample Python work.
        return EpochDataLoader(
            cached,
            seed=self.config.seed,
            rank=self.info.rank,
            indices=indices,
            batch_size=None,
            sampler=sampler,
            collate_fn=_identity,
            pin_memory=self.settings["pin_memory"],
        )


def _identity(batch: Any) -> Any:
    return batch


__all__ = ["LoaderFactory", "cpus_available"]
