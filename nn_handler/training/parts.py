"""TrainerParts: the attributes every part of the Trainer (step.py, evaluation.py,
optimization.py) reads, declared once for the type checker; Trainer sets them."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nn_handler.config.training import TrainerConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.strategies import Strategy
from nn_handler.training.ema import ModelEma
from nn_handler.training.hooks import HookList
from nn_handler.training.position import LoopPosition
from nn_handler.training.precision import Precision
from nn_handler.training.sharded_ema import ShardedEma
from nn_handler.training.state import TrainerState


class TrainerParts:
    """Declarations only: no behaviour, no values."""

    config: TrainerConfig
    comm: Communicator
    device: torch.device
    log: Any
    state: TrainerState
    position: LoopPosition
    hooks: HookList
    strategy: Strategy
    module: nn.Module
    model: nn.Module
    precision: Precision
    ema: ModelEma | ShardedEma | None
    optimizer: torch.optim.Optimizer | None
    scheduler: Any


__all__ = ["TrainerParts"]
