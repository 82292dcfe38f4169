"""How the model is parallelised: a Strategy per kind (see base.py), chosen by
``TrainerConfig.strategy``."""

from __future__ import annotations

from typing import Any

import torch

from nn_handler.config.training import TrainerConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError
from nn_handler.strategies.base import Strategy
from nn_handler.strategies.ddp import DDPStrategy
from nn_handler.strategies.replicated import ReplicatedStrategy
from nn_handler.strategies.single import SingleDeviceStrategy

STRATEGIES: dict[str, type[Strategy]] = {"single": SingleDeviceStrategy, "ddp": DDPStrategy}


def strategy_name(config: TrainerConfig, world: int, grouped: bool = True) -> str:
    """The strategy a run of ``world`` ranks (``grouped``: with a process group) takes:
    'replicated' under the reproducible mode unless 'fsdp' (its exact sum replaces DDP's),
    'auto' as DDP with more than one rank in a group, else as given. ConfigError for
    'single' over several ranks."""
    name = config.strategy
    if config.reproducible is not None and name != "fsdp":
        return "replicated"
    if name == "auto":
        return "ddp" if world > 1 and grouped else "single"
    if name == "single" and world > 1:
        raise ConfigError(
            f"strategy 'single' trains one replica without synchronising gradients, but the "
            f"run has {world} ranks: the replicas would drift apart. Use 'ddp' (or 'auto')."
        )
    return name


def select_strategy(
    comm: Communicator, device: torch.device, config: TrainerConfig, precision: str = "32"
) -> Strategy:
    """The strategy ``config.strategy`` names; 'auto' is DDP when the run has more than one
    rank and a process group, one device otherwise (a test double of several ranks without a
    group trains its one replica as it is). ``precision`` is the run's resolved precision
    ('32', 'bf16', 'fp16'), which a sharded strategy applies to its communication."""
    import torch.distributed as dist

    grouped = dist.is_available() and dist.is_initialized()
    name = strategy_name(config, comm.world_size, grouped)
    if name == "replicated":
        return ReplicatedStrategy(comm, device, config, precision)
    if name == "fsdp":  # imported when chosen: torch.distributed.checkpoint costs ~1 s
        from nn_handler.strategies.fsdp import FSDP2Strategy

        return FSDP2Strategy(comm, device, config, precision)
    return STRATEGIES[name](comm, device, config, precision)


def __getattr__(name: str) -> Any:
    if name == "FSDP2Strategy":
        from nn_handler.strategies.fsdp import FSDP2Strategy

        return FSDP2Strategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "STRATEGIES",
    "DDPStrategy",
    "FSDP2Strategy",
    "ReplicatedStrategy",
    "SingleDeviceStrategy",
    "Strategy",
    "select_strategy",
    "strategy_name",
]
