"""Experiment tracking: a small logger-hook interface and its TensorBoard implementation.

Loggers are hooks that write on rank 0 only. They receive the epoch records (reduced, the same
on every rank) and, every ``every_n_steps`` optimizer steps, rank 0's current training loss.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from nn_handler.errors import ConfigError
from nn_handler.training.hooks import Hook


class ExperimentLogger(Hook, ABC):
    """Base of experiment loggers: implement ``log_metrics`` and ``log_hyperparams``."""

    def __init__(self, every_n_steps: int = 50) -> None:
        self.every_n_steps = every_n_steps

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Write scalars at ``step`` (called on rank 0 only)."""

    @abstractmethod
    def log_hyperparams(self, params: dict[str, Any]) -> None:
        """Write the run's configuration once (called on rank 0 only)."""

    def finalize(self) -> None:
        """Flush and close (called on rank 0 only, after training)."""

    def before_train(self) -> None:
        if self.trainer.is_main_process:
            self.log_hyperparams(self.trainer.hyperparameters())

    def after_step(self) -> None:
        state = self.trainer.state
        if (
            self.trainer.is_main_process
            and state.step_synced
            and state.global_step % self.every_n_steps == 0
            and state.last_loss is not None
        ):
            self.log_metrics({"train/loss_step": float(state.last_loss)}, state.global_step)

    def after_epoch(self) -> None:
        if self.trainer.is_main_process:
            record = self.trainer.history.last
            epoch = int(record["epoch"])
            self.log_metrics({f"epoch/{k}": v for k, v in record.items() if k != "epoch"}, epoch)

    def after_train(self) -> None:
        if self.trainer.is_main_process:
            self.finalize()


class TensorBoardLogger(ExperimentLogger):
    """Scalars per step and per epoch, hyperparameters once, in ``log_dir`` (rank 0 only).

    Needs the tensorboard package: ``pip install 'nn_handler[tensorboard]'``.
    """

    def __init__(self, log_dir: str | Path, every_n_steps: int = 50) -> None:
        super().__init__(every_n_steps)
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def _get_writer(self) -> Any:
        if self._writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ConfigError(
                    "TensorBoardLogger needs tensorboard: pip install 'nn_handler[tensorboard]'."
                ) from error
            self._writer = SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        writer = self._get_writer()
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        writer = self._get_writer()
        lines = [f"{key}: {value}" for key, value in sorted(params.items())]
        writer.add_text("hparams", "\n".join(lines))

    def finalize(self) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


__all__ = ["ExperimentLogger", "TensorBoardLogger"]
