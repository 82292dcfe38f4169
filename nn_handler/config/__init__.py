"""Validated configuration (pydantic v2, frozen, extra fields forbidden).

Config objects are validated once, at the edge; code below receives these objects, never dicts.
"""

from nn_handler.config.checkpoint import CheckpointConfig, ResumePolicy
from nn_handler.config.data import LoaderConfig, LoaderMode
from nn_handler.config.distributed import Backend, DistributedConfig
from nn_handler.config.handler import HandlerConfig, LoggingConfig
from nn_handler.config.training import (
    EarlyStoppingConfig,
    EmaConfig,
    FsdpConfig,
    PrecisionConfig,
    PrecisionName,
    ReproducibleConfig,
    TrainerConfig,
)

__all__ = [
    "Backend",
    "CheckpointConfig",
    "DistributedConfig",
    "EarlyStoppingConfig",
    "EmaConfig",
    "FsdpConfig",
    "HandlerConfig",
    "LoaderConfig",
    "LoaderMode",
    "LoggingConfig",
    "PrecisionConfig",
    "PrecisionName",
    "ReproducibleConfig",
    "ResumePolicy",
    "TrainerConfig",
]
