"""The non-finite guard of a Trainer's optimizer steps (``TrainerConfig.nonfinite``): which
steps are skipped, and what a skipped step leaves as it was.

Two ways to decide, the same decisions:

- **On the host** (any optimizer): one boolean read per optimizer step, then the step is taken
  or not. ``nonfinite: raise`` always decides here (it stops at the step), and so does a
  sharded model (each rank checks its shard; the ranks agree in one all_reduce).
- **On the device** (an optimizer whose ``step`` takes GradScaler's ``found_inf``: torch's
  fused SGD, Adam, AdamW, Adagrad), with no host read in the step: the verdict is a device
  flag the optimizer skips on, the BatchNorm statistics are put back where it is set, and the
  flags are read at the next log step (``settle``), all of them in one read: only then are the
  skipped steps counted, logged and checked against ``max_consecutive_skipped_steps``.

A skipped step is still a step of the run: the global step, a per-step LR schedule and the
EMA (which averages the unchanged weights) go on, as they do for a step GradScaler skips.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nn_handler.config.training import TrainerConfig
from nn_handler.errors import NonFiniteError
from nn_handler.strategies import Strategy
from nn_handler.training.nonfinite import BufferSnapshot, GradientFiniteCheck
from nn_handler.training.state import TrainerState

Verdict = bool | torch.Tensor
"""Whether a step was skipped: a bool decided on the host, or a device flag (1.0: skipped)."""


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer.step`` takes a ``found_inf`` flag and skips on the device (torch's
    fused optimizers set ``_step_supports_amp_scaling``: GradScaler's contract)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """``optimizer.step()``, skipped on the device where ``found_inf`` is 1 (no host read):
    the weights and the optimizer's state, its step count included, stay as they were."""
    optimizer.grad_scale = None  # type: ignore[attr-defined]
    optimizer.found_inf = found_inf  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale  # type: ignore[attr-defined]
        del optimizer.found_inf  # type: ignore[attr-defined]


class NonFiniteGuard:
    """Decides, once per optimizer step and alike on every rank, whether the step is skipped.

    ``adopt`` sets it up for the Trainer's parameters and first optimizer; ``open_window``
    snapshots the buffers; ``decide`` returns the verdict (``Verdict``); ``skip`` (a host
    verdict) puts the buffers back and counts the step; ``took`` counts a step taken;
    ``step_unless`` (a device verdict) steps the optimizer unless the flag is set; ``settle``
    counts the device verdicts since the last call (one host read). Every rank must call
    ``settle`` at the same steps: it may raise NonFiniteError, on every rank alike.
    """

    def __init__(self, config: TrainerConfig, state: TrainerState, log: Any) -> None:
        self.config = config
        self.state = state
        self.log = log
        self.enabled = False
        self.on_device = False
        self._finite = GradientFiniteCheck([])
        self._buffers: BufferSnapshot | None = None
        self._pending: list[tuple[int, int, torch.Tensor]] = []  # (epoch, step, flag)
        self._diverged: str | None = None

    def adopt(
        self,
        params: list[nn.Parameter],
        module: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        strategy: Strategy,
        scaled: bool,
    ) -> None:
        """Guard ``params``' gradients (off under fp16, whose GradScaler skips on its own:
        ``scaled``) and ``module``'s buffers; decide on the device when ``optimizer`` can skip
        there, the policy is 'skip' and neither a sharded model nor the reproducible mode
        (which reads the host once per step anyway) asks for a host decision."""
        config = self.config
        self.enabled = config.nonfinite != "off" and not scaled
        self.on_device = (
            self.enabled
            and config.nonfinite == "skip"
            and optimizer is not None
            and skips_on_device(optimizer)
            and not strategy.shards_gradients
            and config.reproducible is None
        )
        self._finite = GradientFiniteCheck(params)
        snapshot = BufferSnapshot(module)
        self._buffers = snapshot if self.enabled and snapshot.has_buffers else None

    def open_window(self) -> None:
        """The first micro-batch of an optimizer step: snapshot the buffers."""
        if self._buffers is not None:
            self._buffers.take()

    def decide(self, strategy: Strategy, losses: list[torch.Tensor]) -> Verdict:
        """Whether this step is skipped (``losses``: the window's detached losses, checked with
        the gradients when no DDP carries a NaN loss into them). False when the guard is off."""
        if not self.enabled:
            return False
        if self.on_device:
            return self._finite.found_nonfinite(losses)
        finite = self._finite.all_finite(losses)
        if strategy.shards_gradients:  # each rank checked its shard
            finite = strategy.agree(finite)
        return not finite

    def step_unless(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """A device verdict: step unless ``found_inf`` is set, put the buffers back where it is,
        and keep the flag for ``settle``."""
        step_unless(optimizer, found_inf)
        if self._buffers is not None:
            self._buffers.restore_where(found_inf)
        state = self.state
        self._pending.append((state.epoch, state.global_step, found_inf))

    def skip(self) -> None:
        """A host verdict to skip: the buffers as they were before the step; counted now."""
        if self._buffers is not None:
            self._buffers.restore()
        self._count(self.state.epoch, self.state.global_step, skipped=True)
        self._raise_if_diverged()

    def took(self) -> None:
        """A host verdict to step (or no guard): the run of skipped steps ends."""
        self.state.skipped_in_a_row = 0

    def settle(self, check: bool = True) -> None:
        """Count, log and check the device verdicts since the last call (one host read, none
        when there are none). ``check`` False only counts (a checkpoint being written): the
        NonFiniteError of a run that diverged is raised by the next checking call."""
        pending, self._pending = self._pending, []
        if pending:
            flags = torch.stack([flag for *_, flag in pending]).tolist()
            for (epoch, step, _), flag in zip(pending, flags, strict=True):
                self._count(epoch, step, skipped=flag > 0)
        if check:
            self._raise_if_diverged()

    def discard(self) -> None:
        """Forget the unread verdicts (an epoch that raised)."""
        self._pending.clear()

    def _count(self, epoch: int, step: int, skipped: bool) -> None:
        state = self.state
        if not skipped:
            state.skipped_in_a_row = 0
            return
        where = f"epoch {epoch + 1}, optimizer step {step + 1}"
        if self.config.nonfinite == "raise":
            raise NonFiniteError(
                f"the loss or gradients were NaN/inf on at least one rank at {where}; every "
                f"rank stops here. Use TrainerConfig(nonfinite='skip') to skip such steps."
            )
        state.skipped_steps += 1
        state.skipped_in_a_row += 1
        self.log.warning("skipped the optimizer step at {}: NaN/inf loss or gradients", where)
        limit = self.config.max_consecutive_skipped_steps
        if limit is not None and state.skipped_in_a_row >= limit and self._diverged is None:
            self._diverged = (
                f"the loss or gradients were NaN/inf on at least one rank for "
                f"{state.skipped_in_a_row} optimizer steps in a row (the last at {where}); the "
                f"run has diverged, so every rank stops here. Lower the learning rate, check the "
                f"data, or raise TrainerConfig(max_consecutive_skipped_steps=...)."
            )

    def _raise_if_diverged(self) -> None:
        message, self._diverged = self._diverged, None
        if message is not None:
            raise NonFiniteError(message)


__all__ = ["NonFiniteGuard", "Verdict", "skips_on_device", "step_unless"]
