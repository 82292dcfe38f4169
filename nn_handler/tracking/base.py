"""The experiment-logger protocol: what a tracker implements and when the Trainer calls it.

An ``ExperimentLogger`` is a hook that acts on one process, the Trainer's reporting process
(``Trainer.is_reporting_process``: rank 0; in a fault-tolerant run the first member of the
step, which changes when that member is lost). The Trainer drives it at fixed points, always
with the optimizer steps done so far as ``step`` (one monotonic axis, which W&B and MLflow
need):

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

A tracker opens its run (``open_run``: by default ``log_hyperparams``) on the process that
reports, at its first write. When another process takes over (a fault-tolerant run's first
member lost or back), the one that stops reporting calls ``release`` (let go of its handle,
not the run) and the new one opens the same run again: ``Trainer.run_key`` names it, the same
on every member, and each tracker skips the points its run already holds.
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
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
    ``log_figure`` and ``finish`` where the tracker has them. Called on the reporting process only.

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
        self._open = False  # the run is open on this process (see _writes)
        #: A fault-tolerant run's member that does not report: the last step's points.
        self._kept: list[tuple[dict[str, float], int]] = []

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

    def open_run(self) -> None:
        """Start the run, or continue it (resumed, or taken over from another process), on
        this process before its first write: by default, log the hyperparameters."""
        self.log_hyperparams(self.trainer.hyperparameters())

    @property
    def run_key(self) -> str | None:
        """The attached Trainer's ``run_key`` (None: none, or not attached)."""
        return getattr(self.attached_trainer, "run_key", None)

    def release(self) -> None:
        """Let go of the run on this process, which stops reporting while the run goes on
        (another process writes it now): close handles, leave the run's status alone."""

    def replay(self, metrics: dict[str, float], step: int) -> None:
        """Write a point that the process this one took over from may have written already
        (it was lost between the step's commit and its write, or not): default
        ``log_metrics``; a tracker that would then hold it twice skips it instead."""
        self.log_metrics(metrics, step)

    def _writes(self) -> bool:
        """Whether this process writes now: it opens the run at its first write (then writes
        the points it kept while another process reported), and releases it when another
        process has taken over."""
        if not self.trainer.is_reporting_process:
            if self._open:
                self._open = False
                self.release()
            return False
        if not self._open:
            self._open = True
            self.open_run()
            kept, self._kept = self._kept, []
            for metrics, step in kept:
                self.replay(metrics, step)
        return True

    def _point(self, metrics: Callable[[], dict[str, float]], step: int) -> None:
        """Write a point of the run at ``step``, or, on a fault-tolerant run's member that
        does not report, keep the last step's points for a takeover (the reporting member
        may be lost between a step's commit and its write)."""
        if self._writes():
            self.log_metrics(metrics(), step)
        elif self.run_key is not None:
            self._kept = [(m, s) for m, s in self._kept if s == step] + [(metrics(), step)]

    # ----------------------------------------------------------------- hook points
    def before_train(self) -> None:
        self._writes()

    def after_step(self) -> None:
        state = self.trainer.state
        if (
            state.step_synced
            and state.global_step % self.every_n_steps == 0
            and state.last_loss is not None
        ):
            self._point(self._step_metrics, state.global_step)

    def _step_metrics(self) -> dict[str, float]:
        state = self.trainer.state
        metrics = {"train_loss_step": float(state.last_loss)}
        if math.isnan(metrics["train_loss_step"]) and not self.trainer.automatic_optimization:
            del metrics["train_loss_step"]  # a manual training_step that returned no loss
        metrics.update({f"train_{k}_step": float(v) for k, v in state.last_scalars.items()})
        return metrics

    def after_log(self, metrics: dict[str, float], step: int) -> None:
        # Outside a fit (before it, or after it closed the run) the values go straight to
        # the tracker, as they always did; a fault-tolerant run's member opens the run first.
        if not (self._open or self.run_key is not None) or self._writes():
            self.log_metrics(metrics, step)

    def after_epoch(self) -> None:
        trainer = self.trainer
        self._point(lambda: dict(trainer.history.last), trainer.state.global_step)

    def after_train(self) -> None:
        trainer = self.trainer
        # A run never opened here is not opened to be closed; except by the member that
        # reports at a fault-tolerant run's end (it may not have written since taking over).
        if not (self._open or self.run_key is not None) or not self._writes():
            return
        self._open = False
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
