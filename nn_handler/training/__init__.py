"""The training layer: Trainer, precision, EMA, metrics, History, hooks and the profiler
(experiment trackers are in nn_handler.tracking, the throughput monitor in
nn_handler.monitoring)."""

from nn_handler.strategies.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from nn_handler.training.early_stopping import EarlyStopping
from nn_handler.training.ema import ModelEma, unwrap_model
from nn_handler.training.history import History
from nn_handler.training.hooks import Hook
from nn_handler.training.metrics import StatefulMetric, WeightedMeans, accuracy
from nn_handler.training.precision import Precision, resolve_precision
from nn_handler.training.trainer import Trainer, TrainerState

__all__ = [
    "EarlyStopping",
    "History",
    "Hook",
    "ModelEma",
    "Precision",
    "StatefulMetric",
    "SyncBatchNorm",
    "Trainer",
    "TrainerState",
    "WeightedMeans",
    "accuracy",
    "convert_sync_batchnorm",
    "resolve_precision",
    "unwrap_model",
]
