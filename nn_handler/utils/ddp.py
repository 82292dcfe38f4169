"""Seed 002's DDP core utilities, over nn_handler.distributed (thin adapter, no logic)."""

from __future__ import annotations

import torch

from nn_handler.distributed.device import DeviceSpec, resolve_device
from nn_handler.distributed.functional import get_local_rank
from nn_handler.distributed.lifecycle import initialize_ddp, should_use_distributed


def _should_use_distributed(use_distributed_flag: bool | None) -> bool:
    """True to run with DDP: False disables, True enables when possible, None auto-detects."""
    return should_use_distributed(use_distributed_flag)


def _resolve_device(device: DeviceSpec, local_rank: int | None = None) -> torch.device:
    """Resolve a device spec; 'cuda'/'gpu' pick cuda:LOCAL_RANK; CPU (with a warning) when the
    requested accelerator is absent. See nn_handler.distributed.device.resolve_device_spec."""
    return resolve_device(device, get_local_rank() if local_rank is None else local_rank)


__all__ = ["_resolve_device", "_should_use_distributed", "initialize_ddp"]
