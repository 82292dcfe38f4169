"""ExactGradients: where the reproducible mode reads each micro-batch's whole gradients, how it
sums their fixed-point integers over the ranks, and where the summed gradient goes.

The mode (training/reproducible/exact_step.py) quantises the whole gradient of each of its
micro-batches into one flat int64 vector (the trained parameters in order, each flattened)
and appends its slots (samples, losses, statistics, maxima). A strategy decides the rest:

- ``ReplicatedGradients`` (every rank holds the whole model): one all_reduce of the vector;
  every rank gets every element of the sum.
- ``ShardedGradients`` (FSDP2, HSDP; strategies/fsdp_gradients.py): one int64 reduce-scatter
  over the shard group (then an all_reduce across HSDP's copies), each rank receiving the
  sum of its own shard of every parameter and the slots.

An int64 sum is exact in any order, so both give every rank the same integers whatever the
world size or mesh: the same bits.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from nn_handler.distributed.communicator import Communicator


class ExactGradients(Protocol):
    """The gradient side of the reproducible mode's exact sum for one set of parameters."""

    #: The elements of each parameter's part of the summed vector this rank receives (its
    #: whole numel when replicated; its padded shard when sharded), in parameter order.
    local_numels: list[int]
    #: The collectives one ``sum_`` makes.
    collectives_per_sum: int
    #: Whether every rank must run as many forwards and backwards as every other (sharded
    #: parameters are gathered in each).
    balanced: bool

    def clear(self) -> None:
        """Before a micro-batch's backward: no gradient left from the last one."""

    def gradients(self) -> list[torch.Tensor]:
        """After a micro-batch's backward: each parameter's whole gradient (zeros where it
        has none), in parameter order."""

    def sum_(self, vector: torch.Tensor, slots: int, comm: Communicator) -> torch.Tensor:
        """The sum over the ranks of ``vector`` (int64: the whole gradients, then ``slots``
        slots): this rank's part of the gradients (``local_numels``) and every slot. Every
        rank must call this."""

    def held_bytes(self) -> int:
        """The bytes this side of the sum needs in a step (beyond the parameters' gradients):
        its buffers kept from step to step and what it makes in each step."""

    def assign(self, flat: torch.Tensor) -> None:
        """This rank's part of the summed gradient (``local_numels``, float) into the
        parameters' ``.grad``."""


class ReplicatedGradients:
    """Every rank holds the whole parameters and gradients: an all_reduce of the vector."""

    collectives_per_sum = 1
    balanced = False

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.local_numels = [p.numel() for p in params]

    def clear(self) -> None:
        for p in self.params:
            p.grad = None

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]

    def sum_(self, vector: torch.Tensor, slots: int, comm: Communicator) -> torch.Tensor:
        comm.all_reduce_(vector, "sum")
        return vector

    def held_bytes(self) -> int:
        return 0

    def assign(self, flat: torch.Tensor) -> None:
        pieces = torch.split(flat, self.local_numels)
        for p, piece in zip(self.params, pieces, strict=True):
            p.grad = piece.view_as(p) if p.dtype == flat.dtype else piece.view_as(p).to(p.dtype)


__all__ = ["ExactGradients", "ReplicatedGradients"]
