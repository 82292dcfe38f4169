"""NullCommunicator: the single-process backend. Every collective is an identity."""

from __future__ import annotations

from datetime import timedelta

import torch
from typing_extensions import override

from nn_handler.distributed.communicator.base import BackendReduceOp, Communicator


class NullCommunicator(Communicator):
    """A group of one process: rank 0, world size 1; needs no torch.distributed at all."""

    def __init__(self, device: torch.device | str = "cpu", *, debug: bool | None = None) -> None:
        super().__init__(debug=debug)
        self._device = torch.device(device)

    @property
    @override
    def rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    @override
    def device(self) -> torch.device:
        return self._device

    @override
    def _do_barrier(self, timeout: timedelta | None) -> None:
        return None

    @override
    def _do_all_reduce(self, tensor: torch.Tensor, op: BackendReduceOp) -> torch.Tensor:
        return tensor

    @override
    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    @override
    def _do_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return [tensor]

    @override
    def _do_gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        return [tensor]
