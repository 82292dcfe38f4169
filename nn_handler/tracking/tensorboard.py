"""TensorBoardLogger: the protocol on torch.utils.tensorboard's SummaryWriter."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nn_handler.tracking.base import ExperimentLogger, plain_params, require


class TensorBoardLogger(ExperimentLogger):
    """Scalars, the hyperparameters (as text) and the curves in ``log_dir``; the reporting
    process only.

    Needs the tensorboard package: ``pip install 'nn_handler[tensorboard]'``.
    """

    def __init__(
        self, log_dir: str | Path, every_n_steps: int = 50, log_curves: bool = True
    ) -> None:
        super().__init__(every_n_steps, log_curves)
        require("tensorboard", "tensorboard", "tensorboard")
        self.log_dir = Path(log_dir)
        self._writer: Any = None
        self._purge_step: int | None = None
        self._held: set[tuple[str, int]] = set()

    def open_run(self) -> None:
        # A resumed run redoes the steps after its checkpoint: SummaryWriter's purge_step
        # drops the events a killed run wrote past it, and the points already held at the
        # checkpoint's own step (an epoch's record logged just before the kill) are skipped,
        # so no step is shown twice. A process taking the run over opens it the same way.
        step = self.trainer.state.global_step
        resumed = step > 0 and self._writer is None
        self._purge_step = step + 1 if resumed else None
        self._held = _scalars_at(self.log_dir, step) if resumed else set()
        super().open_run()

    def _get_writer(self) -> Any:
        if self._writer is None:
            board = require("torch.utils.tensorboard", "tensorboard", "tensorboard", "tensorboard")
            self._writer = board.SummaryWriter(
                log_dir=str(self.log_dir), purge_step=self._purge_step
            )
        return self._writer

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        lines = [f"{key}: {value}" for key, value in sorted(plain_params(params).items())]
        self._get_writer().add_text("hparams", "\n".join(lines))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        writer = self._get_writer()
        for key, value in metrics.items():
            if (key, step) not in self._held:
                writer.add_scalar(key, value, step)

    def replay(self, metrics: dict[str, float], step: int) -> None:
        held = {key for key, _ in _scalars_at(self.log_dir, step)}
        self.log_metrics({k: v for k, v in metrics.items() if k not in held}, step)

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        self._get_writer().add_figure(name, figure, step, close=False)

    def release(self) -> None:
        self.finish("success")

    def finish(self, status: str) -> None:
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
            self._writer = None


def _scalars_at(log_dir: Path, step: int) -> set[tuple[str, int]]:
    """The (tag, step) scalar points at ``step`` in the event files of ``log_dir``."""
    if not log_dir.is_dir():
        return set()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    held: set[tuple[str, int]] = set()
    for folder in {path.parent for path in log_dir.rglob("events.out.tfevents.*")}:
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        for tag in events.Tags().get("scalars", []):
            held.update((tag, step) for e in events.Scalars(tag) if e.step == step)
    return held


__all__ = ["TensorBoardLogger"]
