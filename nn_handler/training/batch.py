"""Batches: moving nested tensors to a device, finding how many samples a batch holds."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sized
from typing import Any

import torch

from nn_handler.data.fixed_batches import StepBatch


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
    """Samples in ``batch``: dim 0 of its first tensor (1 when it holds none, or a scalar);
    a reproducible step's (StepBatch): the samples of the whole step."""
    if isinstance(batch, StepBatch):
        return batch.samples
    if type(batch) in (tuple, list) and batch and type(batch[0]) is torch.Tensor:
        tensor: torch.Tensor | None = batch[0]
    else:
        tensor = _first_tensor(batch)
    return int(tensor.shape[0]) if tensor is not None and tensor.dim() else 1


def loader_length(loader: Iterable[Any]) -> int | None:
    """``len(loader)``, or None for a loader without one."""
    if isinstance(loader, Sized):
        try:
            return len(loader)
        except TypeError:
            return None
    return None


def set_epoch(loader: Iterable[Any], epoch: int) -> None:
    """Call ``set_epoch(epoch)`` on the loader, its sampler or its batch sampler's sampler
    (the first that has one), so shuffles differ per epoch and repeat per run."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates: list[Any] = [
        loader,
        getattr(loader, "sampler", None),
        getattr(batch_sampler, "sampler", None),
    ]
    for target in candidates:
        if target is not None and callable(getattr(target, "set_epoch", None)):
            target.set_epoch(epoch)
            return


def is_scalar(value: Any) -> bool:
    """A one-element tensor or a Python number (not a bool): what the History can log."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, int | float) and not isinstance(value, bool)


__all__ = ["batch_size_of", "is_scalar", "loader_length", "move_to_device", "set_epoch"]
