"""The run's settings as the trackers log them and as checkpoints store them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nn_handler.checkpoint.run_identity import fingerprint
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.config.training import EmaConfig, PrecisionConfig, TrainerConfig
from nn_handler.training.checkpoint_format import plain_config


def run_config_of(
    config: TrainerConfig,
    precision: PrecisionConfig | None,
    ema: EmaConfig | None,
    checkpoint: CheckpointConfig,
) -> dict[str, Any]:
    """A Trainer's configuration as plain values (NNHandler stores its whole HandlerConfig
    instead)."""
    return {
        "trainer": plain_config(config),
        "precision": plain_config(precision or PrecisionConfig()),
        "ema": plain_config(ema or EmaConfig()),
        "checkpoint": plain_config(checkpoint),
    }


def hyperparameters_of(
    run_config: Mapping[str, Any],
    resolved: Mapping[str, Any],
    optimizer: torch.optim.Optimizer | None,
) -> dict[str, Any]:
    """Flat ``section.field`` keys with plain values: the run configuration (NNHandler's
    whole config), then the ``resolved`` settings (precision, world size, strategy, EMA), the
    optimizer's class and first learning rate."""
    config = run_config["handler"] if set(run_config) == {"handler"} else run_config
    params = flatten(config)
    params.update(resolved)
    if optimizer is not None:
        params["optimizer"] = type(optimizer).__name__
        params["lr"] = optimizer.param_groups[0]["lr"]
    return params


def run_fingerprint(hyperparameters: dict[str, Any], initial_lr: float | None) -> dict[str, Any]:
    """What defines a run (checkpoint/run_identity.py): its hyperparameters, with the
    learning rate the optimizer had when the Trainer got it (a scheduler moves it)."""
    if initial_lr is not None:
        hyperparameters["lr"] = initial_lr
    return fingerprint(hyperparameters)


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``a.b.c`` keys; lists and other values as they are."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


__all__ = ["flatten", "hyperparameters_of", "run_config_of", "run_fingerprint"]
