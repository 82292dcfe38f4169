"""The optimizer and the LR scheduler: building them (factories, a two-argument scheduler
factory that needs the run's length), the run's length in optimizer steps, and stepping a
scheduler per epoch. Mixed into Trainer; override ``configure_optimizers`` there."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from nn_handler.errors import ConfigError
from nn_handler.training.batch import loader_length
from nn_handler.training.history import Record
from nn_handler.training.limits import limited, stepping_batches
from nn_handler.training.parts import TrainerParts

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class OptimizationMixin(TrainerParts):
    """``configure_optimizers``, ``estimated_stepping_batches`` and scheduler stepping."""

    _scheduler_factory: Callable[[Any, int], Any] | None
    initial_lr: float | None
    _pending_scheduler_state: Any
    _optimizers: list[torch.optim.Optimizer]
    _schedulers: list[Any]
    automatic_optimization: bool

    def configure_optimizers(self, optimizer: Any, scheduler: Any) -> tuple[Any, Any]:
        """Build the optimizer and scheduler (override to construct them yourself).

        Called once, after the model is wrapped and once ``state``, ``history``, ``hooks``,
        ``metrics`` and ``strategy`` exist; factories receive ``self.model.parameters()`` and
        the optimizer respectively. Returns (optimizer, scheduler), or (a list of optimizers,
        a list of schedulers or None) for several, which needs manual optimization
        (``automatic_optimization = False``); a list passed as ``optimizer=`` is used as is.
        """
        if isinstance(optimizer, (list, tuple)):
            schedulers = scheduler if isinstance(scheduler, (list, tuple)) else []
            return list(optimizer), list(schedulers)
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise ConfigError(
                    f"optimizer must be a torch.optim.Optimizer or a factory taking the "
                    f"parameters, got {type(optimizer).__name__}."
                )
            optimizer = optimizer(self.model.parameters())
        if scheduler is not None and optimizer is None:
            raise ConfigError("a scheduler needs an optimizer: pass optimizer= as well.")
        if scheduler is not None and not hasattr(scheduler, "step") and callable(scheduler):
            if _required_positional(scheduler) >= 2:
                # lambda opt, total_steps: ... -> built when fit knows the run's length.
                self._scheduler_factory = scheduler
                return optimizer, None
            scheduler = scheduler(optimizer)
        return optimizer, scheduler

    def _adopt_optimizers(self, built: tuple[Any, Any]) -> None:
        """Keep what ``configure_optimizers`` returned: ``optimizer``/``scheduler`` are the
        first ones; several optimizers need manual optimization."""
        optimizers, schedulers = built
        self._optimizers = _as_list(optimizers)
        self._schedulers = _as_list(schedulers)
        for index, optimizer in enumerate(self._optimizers):
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise ConfigError(
                    f"optimizer {index} is a {type(optimizer).__name__}, not a "
                    f"torch.optim.Optimizer."
                )
        self.optimizer = self._optimizers[0] if self._optimizers else None
        self.scheduler = self._schedulers[0] if self._schedulers else None
        # The run's learning rate as configured, before a deferred scheduler or training
        # moves it: the same in a relaunched run (checkpoint/run_identity.py).
        self.initial_lr = None if self.optimizer is None else self.optimizer.param_groups[0]["lr"]
        if len(self._optimizers) > 1 and self.automatic_optimization:
            raise ConfigError(
                f"{len(self._optimizers)} optimizers need manual optimization: set "
                f"automatic_optimization = False on your Trainer subclass and call "
                f"self.manual_backward(loss), optimizer.step() and optimizer.zero_grad() in "
                f"training_step (the global step, EMA and per-step schedulers still advance "
                f"once per batch)."
            )
        if not self.automatic_optimization:
            self._check_manual()

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

    def _build_deferred_scheduler(self, loader: Iterable[Any], epochs: int) -> None:
        factory, self._scheduler_factory = self._scheduler_factory, None
        if factory is None:
            return
        self.scheduler = factory(self.optimizer, self.estimated_stepping_batches(loader, epochs))
        self._schedulers = [self.scheduler]
        self._check_scheduler()
        pending, self._pending_scheduler_state = self._pending_scheduler_state, None
        if pending is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(pending)

    def _check_scheduler(self) -> None:
        plateau = any(
            isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) for s in self._schedulers
        )
        if plateau and self.config.scheduler_interval == "step":
            raise ConfigError(
                "ReduceLROnPlateau steps on an epoch metric: use "
                "TrainerConfig(scheduler_interval='epoch')."
            )

    def _train_limit(self) -> int | float | None:
        return self.config.fast_dev_run or self.config.limit_train_batches

    def estimated_stepping_batches(self, loader: Iterable[Any], epochs: int | None = None) -> int:
        """The optimizer steps ``fit(loader, epochs=epochs)`` will have taken in total when it
        ends (steps already done included; limit_train_batches, accumulation and max_steps
        applied): the length a per-step LR schedule needs. ``loader`` must have len()."""
        batches = limited(loader_length(loader), self._train_limit())
        if batches is None:
            raise ConfigError(
                "estimated_stepping_batches needs a loader with len(); pass the number of "
                "steps to the scheduler yourself for an iterable loader."
            )
        epochs = epochs if epochs is not None else self.config.epochs
        if self.config.fast_dev_run:
            epochs = self.state.epoch + 1
        return stepping_batches(
            batches,
            self.config.accumulate_grad_batches,
            epochs,
            epochs_done=self.state.epoch,
            steps_done=self.state.global_step,
            max_steps=self.config.max_steps,
        )

    def _warn_if_the_schedule_ends_early(self, epochs: int, loader: Iterable[Any]) -> None:
        """An LR schedule with a horizon (T_max, total_steps, total_iters) that this fit would
        step past: it does not stretch to the run (a finished cosine rises again), so say so
        before training, e.g. when a resumed run's epochs are extended."""
        horizon = next(
            (
                (name, int(getattr(self.scheduler, name)))
                for name in ("T_max", "total_steps", "total_iters")
                if isinstance(getattr(self.scheduler, name, None), int)
            ),
            None,
        )
        if horizon is None:
            return
        name, length = horizon
        unit = "epochs"
        total = epochs
        if self.config.scheduler_interval == "step":
            if loader_length(loader) is None:
                return
            total = self.estimated_stepping_batches(loader, epochs)
            unit = "optimizer steps"
        if total <= length:
            return
        self.log.warning(
            "the LR scheduler {} has {}={} but this run goes to {} {}: past its end it goes on "
            "with its own formula (a cosine schedule's learning rate rises again). Build it "
            "for {} {} to anneal over the whole run (extending epochs on resume keeps the "
            "saved {}).",
            type(self.scheduler).__name__,
            name,
            length,
            total,
            unit,
            total,
            unit,
            name,
        )

    def _step_scheduler_per_epoch(self, record: Record) -> None:
        if self.config.scheduler_interval != "epoch":
            return
        for scheduler in self._schedulers:
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                monitor = self.config.scheduler_monitor
                if monitor not in record:
                    raise ConfigError(
                        f"ReduceLROnPlateau monitors {monitor!r}, but the epoch record has only "
                        f"{sorted(record)}; set TrainerConfig(scheduler_monitor=...)."
                    )
                scheduler.step(record[monitor])
            else:
                scheduler.step()


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _required_positional(fn: Callable[..., Any]) -> int:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: the one-argument form
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in kinds and p.default is inspect.Parameter.empty)


__all__ = ["OptimizationMixin", "OptimizerFactory"]
