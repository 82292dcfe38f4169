"""The experiment-logger protocol: what a tracker implements and when the Trainer calls it.

An ``ExperimentLogger`` is a hook that acts on rank 0 only. The Trainer drives it at fixed
points, always with the optimizer steps done so far as ``step`` (one monotonic axis, which
W&B and MLflow need):

- ``log_hyperparams(params)``: once, before the first epoch (``Trainer.hyperparameters()``:
  the flat configuration, precision, world size, optimizer and learning rate);
- ``log_metrics(metrics, step)``: every ``every_n_steps`` optimizer steps, ``train_loss_step``
  and ``train_<key>_step`` for every other scalar the step's ``training_step`` returned (rank
  0's values for that batch); each epoch's History record (``epoch`` included) when the epoch
  ends; and whatever the training code logs with ``trainer.log_metrics`` (the ``after_log``
  hook point), at the step it names;
- ``log_figure(name, figure, step)``: the History's curves (a matplotlib Figure) when training
  ends, if matplotlib is installed (default: ignored);
- ``finish(status)``: once, 'success' or 'failed' (also when training raised).
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from loguru import logger

from nn_handler.errors import ConfigError
from nn_handler.training.hooks import Hook


def require(module: str, tracker: str, extra: str, package: str | None = None) -> ModuleType:
    """Import ``module`` for ``tracker``, or a ConfigError naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise ConfigError(
            f"the {tracker} tracker needs the {package or module} package, which is not "
            f"installed: pip install 'nn_handler[{extra}]' (or remove {extra!r} from "
            f"logging.trackers)."
        ) from error


def plain_params(params: Mapping[str, Any]) -> dict[str, str | int | float | bool]:
    """Hyperparameters as scalars: None and collections become their text."""
    plain: dict[str, str | int | float | bool] = {}
    for key, value in params.items():
        plain[key] = value if isinstance(value, (str, int, float, bool)) else str(value)
    return plain


class ExperimentLogger(Hook, ABC):
    """Base of experiment trackers: implement ``log_hyperparams`` and ``log_metrics``; override
    ``log_figure`` and ``finish`` where the tracker has them. Called on rank 0 only.

    Args:
        every_n_steps: log the training loss every this many optimizer steps (a host sync
            on rank 0 at those steps only).
        log_curves: log the History's curves as a figure when training ends.
    """

    order = 10  # after the monitors, which complete the epoch record it logs

    def __init__(self, every_n_steps: int = 50, log_curves: bool = True) -> None:
        if every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be at least 1, got {every_n_steps}.")
        self.every_n_steps = every_n_steps
        self.log_curves = log_curves

    @abstractmethod
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Write the run's configuration once."""

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write scalars at ``step`` (optimizer steps done)."""

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        """Write a matplotlib figure (default: not kept)."""

    def finish(self, status: str) -> None:
        """Flush and close the run; ``status`` is 'success' or 'failed'."""

    # ----------------------------------------------------------------- hook points
    def before_train(self) -> None:
        if self.trainer.is_main_process:
            self.log_hyperparams(self.trainer.hyperparameters())

    def after_step(self) -> None:
        state = self.trainer.state
        if (
            state.step_synced
            and state.global_step % self.every_n_steps == 0
            and state.last_loss is not None
            and self.trainer.is_main_process
        ):
            metrics = {"train_loss_step": float(state.last_loss)}
            if math.isnan(metrics["train_loss_step"]) and not self.trainer.automatic_optimization:
                del metrics["train_loss_step"]  # a manual training_step that returned no loss
            metrics.update({f"train_{k}_step": float(v) for k, v in state.last_scalars.items()})
            self.log_metrics(metrics, state.global_step)

    def after_log(self, metrics: dict[str, float], step: int) -> None:
        self.log_metrics(metrics, step)

    def after_epoch(self) -> None:
        trainer = self.trainer
        if trainer.is_main_process:
            self.log_metrics(dict(trainer.history.last), trainer.state.global_step)

    def after_train(self) -> None:
        trainer = self.trainer
        if not trainer.is_main_process:
            return
        failed = bool(getattr(trainer, "training_failed", False))
        try:
            if self.log_curves and not failed and len(trainer.history):
                self._log_curves(trainer)
        finally:
            self.finish("failed" if failed else "success")

    def _log_curves(self, trainer: Any) -> None:
        try:
            import matplotlib.pyplot as plt

            figure = trainer.history.figure()
        except (ImportError, ConfigError):
            logger.debug("no curves logged: matplotlib is not installed")
            return
        try:
            self.log_figure("curves", figure, trainer.state.global_step)
        finally:
            plt.close(figure)


__all__ = ["ExperimentLogger", "plain_params", "require"]
