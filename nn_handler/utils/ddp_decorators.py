"""Seed 002's DDP decorators, over nn_handler.distributed (thin re-exports, no logic)."""

from nn_handler.distributed.decorators import main_process_first, on_rank
from nn_handler.distributed.parallel import (
    ParallelExecutor,
    parallel_on_all_devices,
    parallelize_on_gpus,
)

__all__ = [
    "ParallelExecutor",
    "main_process_first",
    "on_rank",
    "parallel_on_all_devices",
    "parallelize_on_gpus",
]
