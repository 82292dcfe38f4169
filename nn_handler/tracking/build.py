"""The trackers ``logging.trackers`` names, as ExperimentLogger hooks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from nn_handler.config.observability import (
    CsvTracker,
    MlflowTracker,
    TensorBoardTracker,
    TrackerConfig,
    TrackioTracker,
    WandbTracker,
)
from nn_handler.tracking.base import ExperimentLogger
from nn_handler.tracking.csv_logger import CSVLogger
from nn_handler.tracking.mlflow_logger import MLflowLogger
from nn_handler.tracking.tensorboard import TensorBoardLogger
from nn_handler.tracking.trackio_logger import TrackioLogger
from nn_handler.tracking.wandb_logger import WandbLogger


def build_tracker(config: TrackerConfig, run_dir: str | Path) -> ExperimentLogger:
    """One tracker from its config; files go under ``run_dir`` unless the config says where.
    A tracker whose package is missing is a ConfigError naming the extra to install."""
    root = Path(run_dir)
    every, curves = config.every_n_steps, config.log_curves
    if isinstance(config, CsvTracker):
        return CSVLogger(config.dir or root / "csv", every, curves)
    if isinstance(config, TensorBoardTracker):
        return TensorBoardLogger(config.dir or root / "tensorboard", every, curves)
    if isinstance(config, MlflowTracker):
        artifacts = None
        uri = config.tracking_uri
        if uri is None:  # a SQLite store in the run folder, its artifacts beside it
            root.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{(root / 'mlflow.db').resolve()}"
            artifacts = root / "mlruns"
        return MLflowLogger(
            uri, config.experiment, config.run_name, config.tags, every, curves, artifacts
        )
    if isinstance(config, WandbTracker):
        return WandbLogger(
            config.project,
            config.name,
            config.dir or root,
            config.mode,
            config.entity,
            config.tags,
            every,
            curves,
        )
    if isinstance(config, TrackioTracker):
        return TrackioLogger(config.project, config.name, every, curves)
    raise AssertionError(f"unknown tracker config {config!r}")  # pragma: no cover


def build_trackers(configs: Sequence[TrackerConfig], run_dir: str | Path) -> list[ExperimentLogger]:
    """Every tracker of ``logging.trackers``, in order."""
    return [build_tracker(config, run_dir) for config in configs]


__all__ = ["build_tracker", "build_trackers"]
