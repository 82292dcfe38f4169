"""One training step: on the first micro-batch of an accumulation window the gradients are
zeroed, then forward and backward on each micro-batch, then (on the last one) unscale, clip,
the non-finite check, the optimizer step, EMA and a per-step scheduler, the same on every rank.
Mixed into Trainer; override ``run_step`` / ``optimizer_step`` there.

Why the gradients are zeroed when the next window starts, not right after ``step()``: freeing
them (``set_to_none``) between ``step()`` and the next forward hands their memory back to the
allocator just before the forward needs as much again, and with glibc's malloc that costs
thousands of minor page faults per step on a ResNet (5-10% of the step on a CPU). Zeroing just
before the forward, as the hand-written loop does, reuses the memory at once
(benchmarks/realistic.py records the faults per step)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nn_handler.errors import ConfigError, NonFiniteError
from nn_handler.training.batch import batch_size_of, is_scalar, move_to_device
from nn_handler.training.nonfinite import BufferSnapshot, GradientFiniteCheck
from nn_handler.training.parts import TrainerParts


class StepMixin(TrainerParts):
    """``run_step`` and ``optimizer_step``."""

    _params: list[nn.Parameter]
    _guard: bool
    _finite: GradientFiniteCheck
    _buffers: BufferSnapshot | None
    _window_losses: list[torch.Tensor]
    _non_blocking: bool
    _window_open: bool
    _optimizers: list[torch.optim.Optimizer]
    _schedulers: list[Any]
    automatic_optimization: bool

    def training_step(self, batch: Any) -> torch.Tensor | Mapping[str, torch.Tensor]:
        raise NotImplementedError

    def run_step(self, batch: Any, sync: bool = True, window: int = 1) -> torch.Tensor:
        """One micro-batch: forward and backward, then the optimizer step when ``sync``.

        ``window`` is the number of micro-batches accumulated into this optimizer step; the
        loss is divided by it so the gradient is the window's mean. Returns the detached loss.
        """
        batch = move_to_device(batch, self.device, self._non_blocking)
        if not self.automatic_optimization:
            return self._manual_step(batch)
        if not sync:
            # Gradients are synchronised across ranks only on the last micro-batch of a window.
            with self.strategy.no_sync():
                return self._forward_backward(batch, window)
        loss = self._forward_backward(batch, window)
        if sync:
            self.optimizer_step()
        return loss

    def _forward_backward(self, batch: Any, window: int) -> torch.Tensor:
        if not self._window_open:
            self._open_window()
        with self.precision.autocast():
            output = self.training_step(batch)
            loss = self._loss_of(output)
        self._record_extras(output, batch)
        if self._guard and self.strategy.reduces_gradients:
            # Backward seeded with 0 * loss + 1/window: NaN when the loss is NaN/inf, so this
            # rank's gradients turn NaN and DDP's averaging carries that to every rank; one
            # check of the synchronised gradients then decides for all ranks.
            self.precision.backward(loss, loss.detach().mul(0.0).add_(1.0 / window))
            return loss.detach()
        self.precision.backward(loss / window if window > 1 else loss)
        detached = loss.detach()
        if self._guard:  # without DDP the window's losses join the gradients' finite check
            self._window_losses.append(detached)
        return detached

    def _open_window(self) -> None:
        """The first micro-batch of an optimizer step: the previous step's gradients are
        dropped (here, not after ``step()``: see the module's docstring) and the buffers are
        snapshotted for the non-finite guard."""
        self._window_open = True
        optimizer = self.optimizer or self._require_optimizer()
        optimizer.zero_grad(set_to_none=True)
        if self._buffers is not None:
            self._buffers.take()

    def _record_extras(self, output: Any, batch: Any) -> None:
        """Other scalars the step returned: sample-weighted per epoch, no host sync here."""
        running = self.position.running
        if not isinstance(output, Mapping) or len(output) < 2 or running is None:
            return
        extras = {
            k: v.detach().reshape(()) if isinstance(v, torch.Tensor) else v
            for k, v in output.items()
            if k != "loss" and is_scalar(v)
        }
        if extras:
            running.extras.update(extras, batch_size_of(batch))

    # ----------------------------------------------------------------- manual optimization
    def _manual_step(self, batch: Any) -> torch.Tensor:
        """``automatic_optimization = False``: ``training_step`` does its own backward
        (``manual_backward``) and optimizer steps; the loop advances once per batch: the
        global step, the EMA and every per-step scheduler."""
        with self.precision.autocast():
            output = self.training_step(batch)
        self._record_extras(output, batch)
        loss = output if isinstance(output, torch.Tensor) else None
        if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            loss = output["loss"]
        if self.ema is not None:
            self.ema.update()
        if self.config.scheduler_interval == "step":
            for scheduler in self._schedulers:
                scheduler.step()
        self.state.global_step += 1
        self.state.skipped_in_a_row = 0
        if loss is None:  # nothing to log as train_loss: left out of its mean
            return torch.full((), float("nan"), device=self.device)
        return loss.detach()

    def manual_backward(self, loss: torch.Tensor) -> None:
        """Backward for manual optimization (gradients synchronised across ranks as in the
        automatic loop). Call it in ``training_step`` instead of ``loss.backward()``."""
        self.precision.backward(loss)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer, in the order ``configure_optimizers`` returned them."""
        return list(self._optimizers)

    def lr_schedulers(self) -> list[Any]:
        """Every LR scheduler, in the order ``configure_optimizers`` returned them."""
        return list(self._schedulers)

    def optimizer_step(self) -> bool:
        """Unscale, clip, check, then step (or skip) on every rank alike; returns whether the
        optimizer stepped. Also updates the EMA and a per-step scheduler, and closes the
        accumulation window: the gradients stay until the next window's first micro-batch
        zeroes them (readable in ``after_optimizer_step`` hooks)."""
        optimizer = self.optimizer or self._require_optimizer()
        if self.precision.scaler is not None:
            self.precision.unscale(optimizer)
        if self.config.gradient_clip_val is not None:
            self.strategy.clip_grad_norm(
                self._params,
                self.config.gradient_clip_val,
                self.config.gradient_clip_norm_type,
            )
        stepped = self._finite.all_finite(self._window_losses) if self._guard else True
        if self._guard and self.strategy.shards_gradients:  # each rank checked its shard
            stepped = self.strategy.agree(stepped)
        self._window_losses.clear()
        if stepped:
            scaler = self.precision.scaler
            if scaler is not None:
                scale = scaler.get_scale()
                self.precision.step(optimizer)
                stepped = scaler.get_scale() >= scale
            else:
                optimizer.step()
            self.state.skipped_in_a_row = 0
        else:
            if self._buffers is not None:
                self._buffers.restore()
            self._on_nonfinite()
        if stepped:
            if self.ema is not None:
                self.ema.update()
            if self.scheduler is not None and self.config.scheduler_interval == "step":
                self.scheduler.step()
        self._window_open = False
        self.state.global_step += 1
        return stepped

    def _on_nonfinite(self) -> None:
        where = f"epoch {self.state.epoch + 1}, optimizer step {self.state.global_step + 1}"
        if self.config.nonfinite == "raise":
            raise NonFiniteError(
                f"the loss or gradients were NaN/inf on at least one rank at {where}; every "
                f"rank stops here. Use TrainerConfig(nonfinite='skip') to skip such steps."
            )
        state = self.state
        state.skipped_steps += 1
        state.skipped_in_a_row += 1
        limit = self.config.max_consecutive_skipped_steps
        if limit is not None and state.skipped_in_a_row >= limit:
            raise NonFiniteError(
                f"the loss or gradients were NaN/inf on at least one rank for "
                f"{state.skipped_in_a_row} optimizer steps in a row (the last at {where}); the "
                f"run has diverged, so every rank stops here. Lower the learning rate, check the "
                f"data, or raise TrainerConfig(max_consecutive_skipped_steps=...)."
            )
        self.log.warning("skipped the optimizer step at {}: NaN/inf loss or gradients", where)

    def _loss_of(self, output: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            return output["loss"]
        keys = f" with keys {sorted(output)}" if isinstance(output, Mapping) else ""
        raise ConfigError(
            f"training_step must return the loss tensor or a dict with a 'loss' tensor, got "
            f"{type(output).__name__}{keys}."
        )

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise ConfigError(
                "training needs an optimizer: pass optimizer= (an instance or a factory such as "
                "lambda params: torch.optim.Adam(params, lr=1e-3)) or override "
                "configure_optimizers."
            )
        return self.optimizer


__all__ = ["StepMixin"]
