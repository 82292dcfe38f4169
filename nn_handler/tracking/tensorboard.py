"""TensorBoardLogger: the protocol on torch.utils.tensorboard's SummaryWriter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nn_handler.tracking.base import ExperimentLogger, plain_params, require


class TensorBoardLogger(ExperimentLogger):
    """Scalars, the hyperparameters (as text) and the curves in ``log_dir``; rank 0 only.

    Needs the tensorboard package: ``pip install 'nn_handler[tensorboard]'``.
    """

    def __init__(
        self, log_dir: str | Path, every_n_steps: int = 50, log_curves: bool = True
    ) -> None:
        super().__init__(every_n_steps, log_curves)
        require("tensorboard", "tensorboard", "tensorboard")
        self.log_dir = Path(log_dir)
        self._writer: Any = None

    def _get_writer(self) -> Any:
        if self._writer is None:
            board = require("torch.utils.tensorboard", "tensorboard", "tensorboard", "tensorboard")
            self._writer = board.SummaryWriter(log_dir=str(self.log_dir))
        return self._writer

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        lines = [f"{key}: {value}" for key, value in sorted(plain_params(params).items())]
        self._get_writer().add_text("hparams", "\n".join(lines))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        writer = self._get_writer()
        for key, value in metrics.items():
            writer.add_scalar(key, value, step)

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        self._get_writer().add_figure(name, figure, step, close=False)

    def finish(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


__all__ = ["TensorBoardLogger"]
