"""The step mode a TrainerConfig asks for (modes/base.py): the normal mode, the reproducible
mode (``reproducible``), or a fault-tolerant member around it (``fault_tolerance``, which
needs ``reproducible``: config/training.py checks it)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.config.training import TrainerConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.strategies.exact_gradients import ExactGradients
from nn_handler.training.fault_tolerance.mode import MemberMode
from nn_handler.training.modes.base import StepMode
from nn_handler.training.precision import Precision
from nn_handler.training.reproducible.mode import ReproducibleMode


def select_mode(
    config: TrainerConfig,
    module: nn.Module,
    comm: Communicator,
    device: torch.device,
    precision: Precision,
    automatic: bool,
    metrics: Mapping[str, Any],
    gradients: Callable[[list[nn.Parameter]], ExactGradients],
) -> StepMode:
    """The Trainer's mode over its plain ``module``, its checks made now, before the first
    step (after ``configure_optimizers``: the parameters that train are known)."""
    if config.reproducible is None:
        return StepMode(comm)
    non_blocking = config.non_blocking and device.type == "cuda"
    exact = ReproducibleMode.build(
        config.reproducible, module, comm, device, precision, automatic, metrics, gradients,
        non_blocking,
    )  # fmt: skip
    if config.fault_tolerance is None:
        return exact
    return MemberMode(config.fault_tolerance, exact, exact.exact, comm)


def checkpoint_of_this_process(
    config: TrainerConfig, checkpoint: CheckpointConfig
) -> CheckpointConfig:
    """``checkpoint`` as this process writes it: a fault-tolerant run's member writes its own
    folder in ``checkpoint.dir`` (FaultToleranceConfig.member_folder)."""
    members = config.fault_tolerance
    if members is None:
        return checkpoint
    return checkpoint.model_copy(update={"dir": members.member_folder(checkpoint.dir)})


__all__ = ["checkpoint_of_this_process", "select_mode"]
