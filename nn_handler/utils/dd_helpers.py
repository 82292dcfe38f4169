"""Seed 001's distributed data helpers, over the Communicator (thin adapter).

NaN rule (from Communicator.reduce_dict): a rank whose value is NaN contributes a zero sum and a
zero count, so the mean is over the ranks with a value; all-NaN gives NaN. Every rank still
takes part in the collective, so a NaN on one rank never desynchronises the group.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from nn_handler.config import LoaderConfig, LoaderMode
from nn_handler.config.base import validate_config
from nn_handler.data.factory import LoaderFactory
from nn_handler.distributed.functional import communicator, get_dist_info
from nn_handler.errors import ConfigError


def _checked_communicator(world_size: int, what: str) -> Any:
    comm = communicator()
    if world_size != comm.world_size:
        raise ConfigError(
            f"{what}: world_size={world_size} but the process group has {comm.world_size} "
            f"process(es); pass get_world_size()."
        )
    return comm


def aggregate_metrics(
    metrics_dict: Mapping[str, float], world_size: int, device: torch.device | None = None
) -> dict[str, float]:
    """Average each metric over all ranks, leaving out ranks whose value is NaN (seed 001:
    "handle potential NaN values gracefully"). Every rank must call this.

    ``device`` is accepted for compatibility: values travel on the communicator's device (CUDA
    for nccl, CPU for gloo). Works in one process (returns the values as floats).
    """
    comm = _checked_communicator(world_size, "aggregate_metrics")
    reduced = comm.reduce_dict(dict(metrics_dict), average=True, ignore_nan=True)
    return {key: float(value) for key, value in reduced.items()}


def aggregate_loss(
    loss_value: float | torch.Tensor, world_size: int, device: torch.device | None = None
) -> float:
    """Average a loss over all ranks (NaN-aware). Every rank must call this."""
    comm = _checked_communicator(world_size, "aggregate_loss")
    value = loss_value.detach() if isinstance(loss_value, torch.Tensor) else float(loss_value)
    return float(comm.reduce_dict({"loss": value}, average=True, ignore_nan=True)["loss"])


def broadcast_data(data: Any, src: int = 0) -> Any:
    """Every rank gets rank ``src``'s picklable ``data``. Every rank must call this."""
    return communicator().broadcast_object(data, src)


def broadcast_if_ddp(data: Any, src: int = 0) -> Any:
    """Broadcast from ``src`` when distributed is active, else return ``data`` unchanged."""
    return communicator().broadcast_object(data, src)


def _loader(
    dataset: Dataset[Any],
    loader_kwargs: Mapping[str, Any],
    device: torch.device | str,
    log_fn: Callable[[str], None] | None,
    is_eval: bool,
    mode: LoaderMode,
) -> tuple[DataLoader[Any], Any]:
    kwargs = dict(loader_kwargs)
    collate_fn = kwargs.pop("collate_fn", None)
    config = validate_config(LoaderConfig, {"mode": mode, **kwargs}, "loader_kwargs")
    factory = LoaderFactory(config, get_dist_info(), torch.device(device), log_fn)
    loader = (
        factory.eval_loader(dataset, collate_fn)
        if is_eval
        else factory.train_loader(dataset, collate_fn)
    )
    return loader, loader.sampler


def _create_distributed_loader(
    dataset: Dataset[Any],
    loader_kwargs: Mapping[str, Any],
    device: torch.device | str,
    log_fn: Callable[[str], None] | None,
    is_eval: bool = False,
) -> tuple[DataLoader[Any], Any]:
    """A DataLoader with a DistributedSampler for this rank, and the sampler.

    ``loader_kwargs``: LoaderConfig fields (batch_size, shuffle, num_workers, pin_memory,
    persistent_workers, prefetch_factor, drop_last, seed) and ``collate_fn``. Training loaders
    give every rank the same number of batches; ``is_eval=True`` visits every sample exactly
    once, unshuffled (an ExactEvalSampler, a DistributedSampler without padding). ``log_fn``
    receives the final settings once, on rank 0. Call ``loader.set_epoch(epoch)`` each epoch.
    """
    return _loader(dataset, loader_kwargs, device, log_fn, is_eval, "distributed")


def _create_rank_cached_dataloader(
    dataset: Dataset[Any],
    loader_kwargs: Mapping[str, Any],
    device: torch.device | str,
    log_fn: Callable[[str], None] | None,
    is_eval: bool = False,
) -> tuple[DataLoader[Any], Any]:
    """A DataLoader over this rank's shard, read once into memory, and its batch sampler.

    Same arguments as ``_create_distributed_loader``; later epochs never call the
    dataset's ``__getitem__``.
    """
    return _loader(dataset, loader_kwargs, device, log_fn, is_eval, "rank_cached")


__all__ = [
    "_create_distributed_loader",
    "_create_rank_cached_dataloader",
    "aggregate_loss",
    "aggregate_metrics",
    "broadcast_data",
    "broadcast_if_ddp",
]
