"""nn_handler: typed PyTorch distributed data-parallel training that never hangs.

The same code runs in one process, under ``torchrun`` on one or many machines, and under SLURM.
"""

from loguru import logger

from nn_handler.config import DistributedConfig, LoaderConfig
from nn_handler.data import LoaderFactory
from nn_handler.distributed import (
    Communicator,
    DistributedContext,
    DistributedInfo,
    NullCommunicator,
    TorchCommunicator,
    launch,
    launch_distributed_training,
    main_process_first,
    on_rank,
    record,
    resolve_device,
)
from nn_handler.errors import (
    CheckpointError,
    CollectiveMismatchError,
    ConfigError,
    DistributedError,
    NNHandlerError,
    RankFailedError,
    WorkerFailedError,
    WorkerTimeoutError,
)
from nn_handler.log import enable_logging

logger.disable("nn_handler")

__version__ = "0.1.0"

__all__ = [
    "CheckpointError",
    "CollectiveMismatchError",
    "Communicator",
    "ConfigError",
    "DistributedConfig",
    "DistributedContext",
    "DistributedError",
    "DistributedInfo",
    "LoaderConfig",
    "LoaderFactory",
    "NNHandlerError",
    "NullCommunicator",
    "RankFailedError",
    "TorchCommunicator",
    "WorkerFailedError",
    "WorkerTimeoutError",
    "__version__",
    "enable_logging",
    "launch",
    "launch_distributed_training",
    "main_process_first",
    "on_rank",
    "record",
    "resolve_device",
]
