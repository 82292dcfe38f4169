"""Experiment trackers: the ExperimentLogger protocol (tracking/base.py) and its CSV,
TensorBoard, MLflow, Weights & Biases and Trackio implementations, chosen by
``logging.trackers`` or passed as hooks. Each acts on one process (rank 0, or a
fault-tolerant run's first member); the packages of MLflow, W&B and Trackio are optional
extras, imported when a tracker is built."""

from nn_handler.tracking.base import ExperimentLogger
from nn_handler.tracking.build import build_tracker, build_trackers
from nn_handler.tracking.csv_logger import CSVLogger
from nn_handler.tracking.mlflow_logger import MLflowLogger
from nn_handler.tracking.tensorboard import TensorBoardLogger
from nn_handler.tracking.trackio_logger import TrackioLogger
from nn_handler.tracking.wandb_logger import WandbLogger

__all__ = [
    "CSVLogger",
    "ExperimentLogger",
    "MLflowLogger",
    "TensorBoardLogger",
    "TrackioLogger",
    "WandbLogger",
    "build_tracker",
    "build_trackers",
]
