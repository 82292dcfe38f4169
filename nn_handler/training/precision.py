"""Mixed precision: torch.autocast for the forward, torch.amp.GradScaler for fp16 backward."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from nn_handler.config.training import PrecisionConfig, PrecisionName
from nn_handler.errors import ConfigError

_NOTHING = contextlib.nullcontext()  # stateless and reentrant: one shared instance


def resolve_precision(precision: PrecisionName, device: torch.device) -> str:
    """The concrete precision ('32', 'bf16' or 'fp16') on ``device``.

    'amp' (seed 003's ``use_amp=True``) is fp16 on CUDA and bf16 elsewhere. fp16 off CUDA is
    a ConfigError: CPU autocast to float16 has no GradScaler support and trains badly.
    """
    if precision == "amp":
        return "fp16" if device.type == "cuda" else "bf16"
    if precision == "fp16" and device.type != "cuda":
        raise ConfigError(
            f"precision='fp16' needs a CUDA device, but this rank trains on {device}; use "
            f"precision='bf16' (autocast works on CPU) or 'amp' (fp16 on CUDA, bf16 elsewhere)."
        )
    return precision


class Precision:
    """The forward context and the backward/step protocol of one precision.

    ``autocast()`` wraps the forward pass; ``scaler`` (fp16 only) scales the loss before its
    backward (``Optimization.backward``); ``unscale(optimizer)`` must precede gradient
    clipping; ``step(optimizer)`` steps and updates the scaler (which skips steps whose
    gradients overflowed).
    """

    def __init__(self, config: PrecisionConfig, device: torch.device) -> None:
        self.name = resolve_precision(config.precision, device)
        self.device = device
        self.dtype: torch.dtype | None = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            self.name
        )
        self.scaler: torch.amp.GradScaler | None = None
        if self.name == "fp16":
            self.scaler = torch.amp.GradScaler(
                device.type, init_scale=config.init_scale, growth_interval=config.growth_interval
            )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The forward-pass context: autocast to the reduced dtype, or nothing for '32'."""
        if self.dtype is None:
            return _NOTHING
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        return {} if self.scaler is None else {"scaler": self.scaler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def __repr__(self) -> str:
        return f"Precision({self.name!r}, device={self.device})"


__all__ = ["Precision", "resolve_precision"]
