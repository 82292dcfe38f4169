"""Optimization: the Trainer's part that owns the optimizers and LR schedulers, the precision
(autocast, GradScaler), the accumulation window, the non-finite guard with its buffer snapshot,
gradient clipping, the EMA and the per-step scheduler; it names its own checkpoint parts.

Why the gradients are zeroed when the next window opens, not right after ``step()``: freeing
them (``set_to_none``) between ``step()`` and the next forward hands their memory back to the
allocator just before the forward needs as much again, and with glibc's malloc that costs
thousands of minor page faults per step on a ResNet (5-10% of the step on a CPU). Zeroing just
before the forward, as the hand-written loop does, reuses the memory at once
(benchmarks/realistic.py records the faults per step)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from loguru import logger
from torch import nn

from nn_handler.checkpoint.registry import Part
from nn_handler.config.training import EmaConfig, TrainerConfig
from nn_handler.errors import ConfigError
from nn_handler.strategies import Strategy
from nn_handler.training.ema import ModelEma
from nn_handler.training.history import Record
from nn_handler.training.nonfinite_guard import NonFiniteGuard, Verdict
from nn_handler.training.optimization_parts import ema_part, optimizer_parts, scheduler_parts
from nn_handler.training.position import LoopPosition
from nn_handler.training.precision import Precision
from nn_handler.training.schedules import (
    check_schedulers,
    check_the_schedule_length,
    estimated_steps,
    required_positional,
    step_per_epoch,
)
from nn_handler.training.sharded_ema import ShardedEma
from nn_handler.training.state import TrainerState

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class Optimization:
    """How one Trainer's gradients become weight updates, the same on every rank.

    Attributes:
        optimizers / schedulers: every optimizer and LR scheduler, in the order
            ``configure_optimizers`` returned them (the first of each is the Trainer's
            ``optimizer`` / ``scheduler``).
        precision: autocast for the forward, the GradScaler for an fp16 backward.
        ema: the model's exponential moving average (None when off).
        initial_lr: the first optimizer's learning rate as configured, before a scheduler or
            training moved it (part of the run's identity, checkpoint/run_identity.py).
    """

    def __init__(
        self,
        config: TrainerConfig,
        precision: Precision,
        strategy: Strategy,
        state: TrainerState,
        ema: EmaConfig | None,
        rank: int = 0,
    ) -> None:
        self.config = config
        self.precision = precision
        self.strategy = strategy
        self.state = state
        self.optimizers: list[torch.optim.Optimizer] = []
        self.schedulers: list[Any] = []
        self.initial_lr: float | None = None
        self.ema: ModelEma | ShardedEma | None = None
        self.log = logger.bind(rank=rank)
        self._ema_config = ema
        self._deferred: Callable[[Any, int], Any] | None = None
        self._pending_scheduler_state: Any = None
        self._params: list[nn.Parameter] = []
        self.guard = NonFiniteGuard(config, state, self.log)
        #: The last step's verdict: skipped (a bool, or a device flag read at a log step).
        self.skipped: Verdict = False
        self._window_losses: list[torch.Tensor] = []
        self._window_open = False  # the next micro-batch opens an optimizer step

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.optimizers[0] if self.optimizers else None

    @property
    def scheduler(self) -> Any:
        return self.schedulers[0] if self.schedulers else None

    # ----------------------------------------------------------------- building
    def build(self, optimizer: Any, scheduler: Any, model: nn.Module) -> tuple[Any, Any]:
        """The default ``configure_optimizers``: an optimizer factory gets the model's
        parameters and a scheduler factory the optimizer; a two-argument scheduler factory
        (``lambda opt, total_steps: ...``) is kept until ``begin_fit`` knows the run's length.
        A list of optimizers (and of schedulers) is used as it is."""
        if isinstance(optimizer, (list, tuple)):
            schedulers = scheduler if isinstance(scheduler, (list, tuple)) else []
            return list(optimizer), list(schedulers)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise ConfigError(
                    f"optimizer must be a torch.optim.Optimizer or a factory taking the "
                    f"parameters, got {type(optimizer).__name__}."
                )
            optimizer = optimizer(model.parameters())
        if scheduler is not None and optimizer is None:
            raise ConfigError("a scheduler needs an optimizer: pass optimizer= as well.")
        if scheduler is not None and not hasattr(scheduler, "step") and callable(scheduler):
            if required_positional(scheduler) >= 2:
                self._deferred = scheduler
                return optimizer, None
            scheduler = scheduler(optimizer)
        return optimizer, scheduler

    def adopt(self, built: tuple[Any, Any], module: nn.Module, automatic: bool) -> None:
        """Keep what ``configure_optimizers`` returned, then set up what depends on it (the
        parameters that train, the non-finite guard, the EMA). Several optimizers need manual
        optimization (``automatic`` False)."""
        optimizers, schedulers = built
        self.optimizers[:] = _as_list(optimizers)
        self.schedulers[:] = _as_list(schedulers)
        for index, optimizer in enumerate(self.optimizers):
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ConfigError(
                    f"optimizer {index} is a {type(optimizer).__name__}, not a "
                    f"torch.optim.Optimizer."
                )
        first = self.optimizer
        self.initial_lr = None if first is None else first.param_groups[0]["lr"]
        if len(self.optimizers) > 1 and automatic:
            raise ConfigError(
                f"{len(self.optimizers)} optimizers need manual optimization: set "
                f"automatic_optimization = False on your Trainer subclass and call "
                f"self.manual_backward(loss), optimizer.step() and optimizer.zero_grad() in "
                f"training_step (the global step, EMA and per-step schedulers still advance "
                f"once per batch)."
            )
        if not automatic:
            self._check_manual()
        check_schedulers(self.schedulers, self.config)
        ema, strategy = self._ema_config, self.strategy
        if ema is not None and ema.enabled:  # a sharded model's EMA stays sharded
            sharded = strategy.collective_state
            self.ema = ShardedEma(module, ema, strategy) if sharded else ModelEma(module, ema)
        self._params = [p for p in module.parameters() if p.requires_grad]
        scaled = self.precision.scaler is not None
        self.guard.adopt(self._params, module, self.optimizer, self.strategy, scaled)

    def _check_manual(self) -> None:
        config, reasons = self.config, []
        if config.accumulate_grad_batches != 1:
            reasons.append("accumulate_grad_batches must be 1 (accumulate in training_step)")
        if config.gradient_clip_val is not None:
            reasons.append(
                "gradient_clip_val is not applied (clip in training_step with "
                "self.strategy.clip_grad_norm)"
            )
        if self.precision.scaler is not None:
            reasons.append("fp16's GradScaler is not supported yet (use bf16 or 32)")
        if reasons:
            raise ConfigError("with manual optimization " + "; ".join(reasons) + ".")

    def require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise ConfigError(
                "training needs an optimizer: pass optimizer= (an instance or a factory such as "
                "lambda params: torch.optim.Adam(params, lr=1e-3)) or override "
                "configure_optimizers."
            )
        return self.optimizer

    # ----------------------------------------------------------------- schedules
    def begin_fit(self, loader: Iterable[Any], epochs: int) -> None:
        """Build a scheduler that needed the run's length (before a resume loads its
        state)."""
        factory, self._deferred = self._deferred, None
        if factory is not None:
            steps = estimated_steps(self.config, self.state, loader, epochs)
            self.schedulers[:] = [factory(self.optimizer, steps)]
            check_schedulers(self.schedulers, self.config)
            pending, self._pending_scheduler_state = self._pending_scheduler_state, None
            if pending is not None and self.scheduler is not None:
                self.scheduler.load_state_dict(pending)

    def check_horizon(self, loader: Iterable[Any], epochs: int, position: LoopPosition) -> None:
        """Warn when the schedule would end before the run does (after a resume), refuse it
        where torch would raise past its end; ``position``: where the loop is in its epoch."""
        check_the_schedule_length(
            self.scheduler, self.config, self.state, loader, epochs, position.epoch_batches_done
        )

    def step_per_epoch(self, record: Record) -> None:
        """The epoch's end: step every scheduler stepped per epoch (scheduler_interval)."""
        step_per_epoch(self.schedulers, self.config, record, self.state.counts)

    # ----------------------------------------------------------------- one step
    def backward(self, loss: torch.Tensor, window: int) -> torch.Tensor:
        """Backward of one micro-batch of a ``window``-batch accumulation window (the loss is
        divided by it: the gradient is the window's mean). Returns the detached loss."""
        scaler = self.precision.scaler
        guarded = self.guard.enabled
        if guarded and self.strategy.reduces_gradients:
            # Backward seeded with 0 * loss + 1/window: NaN when the loss is NaN/inf, so this
            # rank's gradients turn NaN and DDP's averaging carries that to every rank; one
            # check of the synchronised gradients then decides for all ranks.
            loss.backward(loss.detach().mul(0.0).add_(1.0 / window))  # type: ignore[no-untyped-call]
            return loss.detach()
        scaled = loss / window if window > 1 else loss
        (scaled if scaler is None else scaler.scale(scaled)).backward()  # type: ignore[no-untyped-call]
        detached = loss.detach()
        if guarded:  # without DDP the window's losses join the gradients' finite check
            self._window_losses.append(detached)
        return detached

    def open_window(self) -> None:
        """Before a micro-batch's forward: the first one of an optimizer step drops the
        previous step's gradients (here, not after ``step()``: see the module's docstring)
        and snapshots the buffers for the non-finite guard."""
        if self._window_open:
            return
        self._window_open = True
        self.require_optimizer().zero_grad(set_to_none=True)
        self.guard.open_window()

    def step(self) -> bool:
        """Unscale, clip, check, then step (or skip) on every rank alike; returns False when the
        guard skipped the step on the host (a step the guard decides on the device, or fp16's
        GradScaler, returns True and skips there: nonfinite_guard.py). Then the EMA and a
        per-step scheduler, skipped steps included, and the window closes: the gradients stay
        until the next window's first micro-batch (readable in ``after_optimizer_step``
        hooks). No host read here unless the guard decides on the host."""
        optimizer, state, guard = self.require_optimizer(), self.state, self.guard
        if self.precision.scaler is not None:
            self.precision.unscale(optimizer)
        clip = self.config.gradient_clip_val
        if clip is not None and self.config.gradient_clip_algorithm == "value":
            torch.nn.utils.clip_grad_value_(self._params, clip)  # elementwise: shards alike
        elif clip is not None:
            self.strategy.clip_grad_norm(self._params, clip, self.config.gradient_clip_norm_type)
        skipped = self.skipped = guard.decide(self.strategy, self._window_losses)
        self._window_losses.clear()
        if isinstance(skipped, torch.Tensor):
            guard.step_unless(optimizer, skipped)
        elif skipped:
            guard.skip()
        else:
            self.precision.step(optimizer)
            guard.took()
        # A skipped step is still a step: the EMA averages the unchanged weights and the
        # schedule goes on, as for a step GradScaler skips (and as timm's EMA does).
        if self.ema is not None:
            self.ema.update()
        if self.scheduler is not None and self.config.scheduler_interval == "step":
            self.scheduler.step()
        self._window_open = False
        state.global_step += 1
        return skipped is not True

    def settle(self, check: bool = True) -> None:
        """Count the skipped steps the guard decided on the device since the last call (one
        host read; none when there are none). Every rank must call it at the same steps: the
        loop does at every log step and at the end of an epoch. May raise NonFiniteError."""
        self.guard.settle(check)

    def after_manual_step(self) -> None:
        """Manual optimization advances once per batch: the EMA, every per-step scheduler and
        the global step."""
        if self.ema is not None:
            self.ema.update()
        if self.config.scheduler_interval == "step":
            for scheduler in self.schedulers:
                scheduler.step()
        self.state.global_step += 1
        self.state.skipped_in_a_row = 0

    def reset_window(self) -> None:
        """A new epoch: nothing left of an epoch that raised (its partial window's gradients
        are zeroed when the next window opens, its unread verdicts forgotten)."""
        self._window_losses.clear()
        self._window_open = False
        self.guard.discard()

    # ----------------------------------------------------------------- checkpoints
    def parts(self) -> list[Part]:
        """This part's state in checkpoints: optimizers, schedulers, the scaler, the EMA."""
        parts = optimizer_parts(self.strategy, self.optimizers)
        parts += scheduler_parts(
            self.schedulers,
            first=self._deferred is not None or bool(self.schedulers),
            load_first=self._load_scheduler,
        )
        precision = self.precision
        parts.append(
            Part(
                "precision",
                precision.state_dict,
                lambda state, _source: precision.load_state_dict(state or {}),
                missing="ignore",
            )
        )
        if self.ema is not None:
            parts.append(ema_part(self.ema))
        return parts

    def _load_scheduler(self, state: Any, _source: str) -> None:
        if self.scheduler is None:  # built at the start of fit (it needs the run's length)
            self._pending_scheduler_state = state
        else:
            self.scheduler.load_state_dict(state)


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


__all__ = ["Optimization", "OptimizerFactory"]
