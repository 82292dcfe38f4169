"""What a ``training_step`` returned: the loss to train on and the other scalars to log."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from nn_handler.errors import ConfigError
from nn_handler.training.batch import batch_size_of, is_scalar
from nn_handler.training.metrics import RunningLoss


def loss_of(output: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The loss tensor of a step's output (the tensor, or its 'loss' entry)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    keys = f" with keys {sorted(output)}" if isinstance(output, Mapping) else ""
    raise ConfigError(
        f"training_step must return the loss tensor or a dict with a 'loss' tensor, got "
        f"{type(output).__name__}{keys}."
    )


def manual_loss(output: Any, device: torch.device) -> torch.Tensor:
    """The detached loss a manual-optimization step returned; NaN (left out of the epoch's
    train_loss) when it returned none."""
    loss = output if isinstance(output, torch.Tensor) else None
    if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
        loss = output["loss"]
    if loss is None:
        return torch.full((), float("nan"), device=device)
    return loss.detach()


def record_extras(running: RunningLoss | None, output: Any, batch: Any) -> dict[str, Any]:
    """Other scalars the step returned: sample-weighted per epoch, no host sync here.
    Returns them (detached), for the trackers' per-step rows."""
    if not isinstance(output, Mapping) or len(output) < 2 or running is None:
        return {}
    extras = {
        k: v.detach().reshape(()) if isinstance(v, torch.Tensor) else v
        for k, v in output.items()
        if k != "loss" and is_scalar(v)
    }
    if extras:
        running.extras.update(extras, batch_size_of(batch))
    return extras


def scalar_value(key: object, value: Any) -> float:
    """``value`` as a float for the trackers, or a ConfigError naming ``key``."""
    if not is_scalar(value):
        what = (
            f"a tensor of shape {tuple(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__name__
        )
        raise ConfigError(
            f"log_metrics: {key!r} is {what}, not a number or a one-element tensor; log a "
            f"reduction of it (e.g. .mean()) or one entry per key."
        )
    return float(value)


__all__ = ["loss_of", "manual_loss", "record_extras", "scalar_value"]
