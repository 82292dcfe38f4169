"""Seed 001's distributed data helpers, over the Communicator (thin adapter).

NaN rule (from Communicator.reduce_dict): a rank whose value is NaN contributes a zero sum and a
zero count, so the mean is over the ranks with a value; all-NaN gives NaN. Every rank still
takes part in the collective, so a NaN on one rank never desynchronises the group.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nn_handler.distributed.functional import communicator
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
    """Average each metric over all ranks (NaN-aware). Every rank must call this.

    ``device`` is accepted for compatibility: values travel on the communicator's device (CUDA
    for nccl, CPU for gloo). Works in one process (returns the values as floats).
    """
    comm = _checked_communicator(world_size, "aggregate_metrics")
    reduced = comm.reduce_dict(dict(metrics_dict), average=True)
    return {key: float(value) for key, value in reduced.items()}


def aggregate_loss(
    loss_value: float | torch.Tensor, world_size: int, device: torch.device | None = None
) -> float:
    """Average a loss over all ranks (NaN-aware). Every rank must call this."""
    comm = _checked_communicator(world_size, "aggregate_loss")
    value = loss_value.detach() if isinstance(loss_value, torch.Tensor) else float(loss_value)
    return float(comm.reduce_dict({"loss": value}, average=True)["loss"])


def broadcast_data(data: Any, src: int = 0) -> Any:
    """Every rank gets rank ``src``'s picklable ``data``. Every rank must call this."""
    return communicator().broadcast_object(data, src)


def broadcast_if_ddp(data: Any, src: int = 0) -> Any:
    """Broadcast from ``src`` when distributed is active, else return ``data`` unchanged."""
    return communicator().broadcast_object(data, src)


__all__ = ["aggregate_loss", "aggregate_metrics", "broadcast_data", "broadcast_if_ddp"]
