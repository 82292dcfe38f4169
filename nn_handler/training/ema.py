"""Exponential moving average of a model's weights on torch's foreach kernels.

Like ``torch.optim.swa_utils``: tensors are grouped by device and dtype once, and every update
is one ``torch._foreach_lerp_`` per group, with no per-parameter Python work.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from nn_handler.checkpoint.model_state import unwrap_model
from nn_handler.config.training import EmaConfig

_Group = tuple[list[torch.Tensor], list[torch.Tensor]]


def _grouped(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[_Group]:
    groups: dict[tuple[torch.device, torch.dtype], _Group] = defaultdict(lambda: ([], []))
    for target, source in pairs:
        targets, sources = groups[(target.device, target.dtype)]
        targets.append(target)
        sources.append(source)
    return list(groups.values())


class EmaUpdates:
    """The update rule every EMA here shares: ``_averaged`` and ``_copied`` are (targets,
    sources) groups; subclasses fill them, plus ``config``, ``num_updates`` and
    ``_optimizer_steps``."""

    config: EmaConfig
    num_updates: int
    _optimizer_steps: int
    _averaged: list[_Group]
    _copied: list[_Group]

    def decay(self) -> float:
        """The decay of the next update (with warm-up: ``min(decay, (1+n)/(10+n))``)."""
        if self.config.warmup:
            n = self.num_updates
            return min(self.config.decay, (1 + n) / (10 + n))
        return self.config.decay

    @torch.no_grad()
    def update(self) -> None:
        """Fold the model's current weights in, as configured (every N-th step, after the
        start step; before the start step the EMA copies the weights)."""
        self._optimizer_steps += 1
        if self._optimizer_steps <= self.config.start_step:
            self.copy_from_model()
            return
        if (self._optimizer_steps - self.config.start_step) % self.config.update_every:
            return
        weight = 1.0 - self.decay()
        for targets, sources in self._averaged:
            torch._foreach_lerp_(targets, sources, weight)
        for targets, sources in self._copied:
            torch._foreach_copy_(targets, sources)
        self.num_updates += 1

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Make the EMA equal to the model's current weights and buffers."""
        for group in (*self._averaged, *self._copied):
            torch._foreach_copy_(*group)


class ModelEma(EmaUpdates):
    """An EMA copy of ``model`` (unwrapped from DDP/compile), updated from its weights.

    ``update()`` after each optimizer step. Updated from weights that DDP keeps identical on
    every rank, the EMA is identical on every rank with no communication. ``module`` is the
    averaged model, in eval mode and without gradients; ``num_updates`` is checkpointed.
    """

    def __init__(self, model: nn.Module, config: EmaConfig) -> None:
        self.config = config
        source = unwrap_model(model)
        self.module = copy.deepcopy(source).eval().requires_grad_(False)
        self.num_updates = 0
        self._optimizer_steps = 0
        self._bind(source)

    def _bind(self, source: nn.Module) -> None:
        params: list[tuple[torch.Tensor, torch.Tensor]] = list(
            zip(self.module.parameters(), source.parameters(), strict=True)
        )
        buffers = list(zip(self.module.buffers(), source.buffers(), strict=True))
        averaged = [(e, s) for e, s in params if e.is_floating_point()]
        copied = [(e, s) for e, s in params if not e.is_floating_point()]
        for ema_buffer, buffer in buffers:
            floating = ema_buffer.is_floating_point()
            target = averaged if floating and self.config.buffers == "average" else copied
            target.append((ema_buffer, buffer))
        self._averaged = _grouped(averaged)
        self._copied = _grouped(copied)

    def state_dict(self) -> dict[str, Any]:
        return {
            "module": self.module.state_dict(),
            "num_updates": self.num_updates,
            "optimizer_steps": self._optimizer_steps,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.num_updates = int(state["num_updates"])
        self._optimizer_steps = int(state["optimizer_steps"])

    def __repr__(self) -> str:
        return f"ModelEma(decay={self.config.decay}, updates={self.num_updates})"


__all__ = ["EmaUpdates", "ModelEma", "unwrap_model"]
