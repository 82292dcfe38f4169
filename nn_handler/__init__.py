"""nn_handler: typed PyTorch distributed data-parallel training that never hangs.

The same code runs in one process, under ``torchrun`` on one or many machines, and under SLURM.
"""

from loguru import logger

from nn_handler.config import (
    CheckpointConfig,
    DistributedConfig,
    EarlyStoppingConfig,
    EmaConfig,
    HandlerConfig,
    LoaderConfig,
    LoggingConfig,
    PrecisionConfig,
    ReproducibleConfig,
    TrainerConfig,
)
from nn_handler.data import LoaderFactory
from nn_handler.distributed import (
    Communicator,
    DistributedContext,
    DistributedInfo,
    NullCommunicator,
    TorchCommunicator,
    initialize_ddp,
    launch,
    launch_distributed_training,
    main_process_first,
    on_rank,
    record,
    resolve_device,
)
from nn_handler.errors import (
    INTERRUPTED_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    CheckpointError,
    CollectiveMismatchError,
    CollectiveStallError,
    ConfigError,
    DistributedError,
    HandlerClosedError,
    LauncherGoneError,
    NNHandlerError,
    NonFiniteError,
    RankFailedError,
    RunFinished,
    TrainingInterrupted,
    TrainingPreempted,
    UnevenDataError,
    WorkerFailedError,
    WorkerTimeoutError,
)
from nn_handler.handler import NNHandler
from nn_handler.log import disable_logging, enable_logging
from nn_handler.monitoring import LearningRateMonitor, ThroughputMonitor
from nn_handler.tracking import (
    CSVLogger,
    ExperimentLogger,
    MLflowLogger,
    TensorBoardLogger,
    TrackioLogger,
    WandbLogger,
)
from nn_handler.training import (
    History,
    Hook,
    ModelEma,
    Trainer,
    accuracy,
)
from nn_handler.training.seeding import seed_everything

logger.disable("nn_handler")

__version__ = "0.1.0"

__all__ = [
    "initialize_ddp",
    "seed_everything",
    "CSVLogger",
    "CheckpointConfig",
    "CheckpointError",
    "HandlerClosedError",
    "LauncherGoneError",
    "CollectiveMismatchError",
    "CollectiveStallError",
    "Communicator",
    "ConfigError",
    "DistributedConfig",
    "DistributedContext",
    "DistributedError",
    "DistributedInfo",
    "EarlyStoppingConfig",
    "EmaConfig",
    "ExperimentLogger",
    "HandlerConfig",
    "History",
    "Hook",
    "LoaderConfig",
    "LoaderFactory",
    "LoggingConfig",
    "MLflowLogger",
    "ModelEma",
    "NNHandler",
    "NNHandlerError",
    "NonFiniteError",
    "INTERRUPTED_EXIT_CODE",
    "PREEMPTED_EXIT_CODE",
    "PrecisionConfig",
    "NullCommunicator",
    "RankFailedError",
    "TensorBoardLogger",
    "LearningRateMonitor",
    "ThroughputMonitor",
    "TrackioLogger",
    "TrainingInterrupted",
    "RunFinished",
    "TrainingPreempted",
    "UnevenDataError",
    "TorchCommunicator",
    "Trainer",
    "ReproducibleConfig",
    "TrainerConfig",
    "WandbLogger",
    "WorkerFailedError",
    "WorkerTimeoutError",
    "__version__",
    "accuracy",
    "disable_logging",
    "enable_logging",
    "launch",
    "launch_distributed_training",
    "main_process_first",
    "on_rank",
    "record",
    "resolve_device",
]
