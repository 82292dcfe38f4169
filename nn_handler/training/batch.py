"""Batches: moving nested tensors to a device, finding how many samples a batch holds."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """``batch`` with every tensor (in nested tuples, lists and dicts) on ``device``; a flat
    tuple or list of tensors already there comes back as it is."""
    if type(batch) in (tuple, list) and all(
        type(v) is torch.Tensor and v.device == device for v in batch
    ):
        return batch
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        return {k: move_to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(move_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        moved = [move_to_device(v, device, non_blocking) for v in batch]
        return moved if type(batch) is list else type(batch)(moved)
    return batch


def _first_tensor(batch: Any) -> torch.Tensor | None:
    if isinstance(batch, torch.Tensor):
        return batch
    values = batch.values() if isinstance(batch, Mapping) else batch
    if isinstance(batch, (Mapping, list, tuple)):
        for value in values:
            found = _first_tensor(value)
            if found is not None:
                return found
    return None


def batch_size_of(batch: Any) -> int:
    """Samples in ``batch``: dim 0 of its first tensor (1 when it holds none, or a scalar)."""
    if type(batch) in (tuple, list) and batch and type(batch[0]) is torch.Tensor:
        tensor: torch.Tensor | None = batch[0]
    else:
        tensor = _first_tensor(batch)
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() else 1


__all__ = ["batch_size_of", "move_to_device"]
