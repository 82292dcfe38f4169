"""Starting and stopping distributed mode: init_dist / shutdown_dist (seed 004) and
initialize_ddp / should_use_distributed (seed 002), all over DistributedContext."""

from __future__ import annotations

import dataclasses
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from nn_handler.config import Backend, DistributedConfig
from nn_handler.distributed.context import DistributedContext, collect_before_destroy
from nn_handler.distributed.device import resolve_device
from nn_handler.distributed.env import parse_distributed_env
from nn_handler.distributed.functional import is_dist_active
from nn_handler.distributed.local_groups import destroy_local_process_group

#: Rendezvous used by a manual init_dist(rank=..., world_size=...) when MASTER_ADDR/PORT are unset.
DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


def init_dist(
    backend: Backend = "nccl", rank: int | None = None, world_size: int | None = None
) -> None:
    """Initialise the default process group (every rank must call this).

    Under torchrun omit ``rank`` and ``world_size``; for a manual launch pass both (the
    rendezvous is MASTER_ADDR:MASTER_PORT, or 127.0.0.1:29500 when unset). The default backend
    is nccl, as documented; on a machine without CUDA pass 'gloo' (or 'auto').
    Raises ValueError (``ConfigError``) when only one of ``rank``/``world_size`` is given
    and ``DistributedError`` when the rendezvous fails. A no-op when already initialised.
    """
    info = parse_distributed_env(os.environ, rank=rank, world_size=world_size)
    if info.launcher == "manual":
        info = dataclasses.replace(
            info,
            master_addr=info.master_addr or DEFAULT_MASTER_ADDR,
            master_port=info.master_port or DEFAULT_MASTER_PORT,
        )
    DistributedContext(DistributedConfig(backend=backend, enabled=True), info=info).setup()


def shutdown_dist() -> None:
    """Destroy the local and default process groups, if any. Idempotent.

    Every rank must call this."""
    destroy_local_process_group()
    if is_dist_active():
        collect_before_destroy()
        dist.destroy_process_group()


def should_use_distributed(use_distributed: bool | None = None) -> bool:
    """Whether to run with DDP: False disables it; True enables it when possible (warns and
    returns False in a single-process environment); None decides from the environment
    (a launcher describing more than one process, or an initialised group)."""
    if use_distributed is False:
        return False
    if is_dist_active():
        return True
    possible = dist.is_available() and parse_distributed_env(os.environ).world_size > 1
    if use_distributed and not possible:
        warnings.warn(
            "distributed training was requested but this process was not started by a "
            "multi-process launcher (torchrun, SLURM srun, nn_handler.launch); running without "
            "DDP.",
            RuntimeWarning,
            stacklevel=2,
        )
    return possible


def initialize_ddp(
    timeout: timedelta | None = None,
) -> tuple[bool, int, int, int, torch.device] | None:
    """Initialise DDP from the launcher's environment unless already done (seed 002).

    Returns None when a process group was already initialised, else
    ``(distributed, rank, local_rank, world_size, device)``; without a multi-process launcher
    that is ``(False, 0, -1, 1, device)``, local rank -1 as the original's. ``timeout``
    defaults to 60 minutes. Backend: nccl on CUDA, gloo otherwise. Every rank must call this.
    """
    if is_dist_active():
        return None
    info = parse_distributed_env(os.environ)
    if not should_use_distributed(None):
        return False, 0, -1, 1, resolve_device("auto", 0)
    config = DistributedConfig(timeout=timeout or timedelta(minutes=60))
    context = DistributedContext(config, info=info).setup()
    return True, info.rank, info.local_rank, info.world_size, context.device


__all__ = [
    "DEFAULT_MASTER_ADDR",
    "DEFAULT_MASTER_PORT",
    "init_dist",
    "initialize_ddp",
    "should_use_distributed",
    "shutdown_dist",
]
