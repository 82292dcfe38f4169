"""Communicators: one strategy object for all collectives (see ``Communicator``)."""

from nn_handler.distributed.communicator._common import DEBUG_ENV_VAR, debug_from_env
from nn_handler.distributed.communicator.base import Communicator, ReduceOp
from nn_handler.distributed.communicator.null import NullCommunicator
from nn_handler.distributed.communicator.threads import (
    ThreadCommunicator,
    ThreadGroup,
    run_in_threads,
)
from nn_handler.distributed.communicator.torch_backend import TorchCommunicator

__all__ = [
    "DEBUG_ENV_VAR",
    "Communicator",
    "NullCommunicator",
    "ReduceOp",
    "ThreadCommunicator",
    "ThreadGroup",
    "TorchCommunicator",
    "debug_from_env",
    "run_in_threads",
]
