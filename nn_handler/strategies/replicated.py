"""ReplicatedStrategy: every rank holds the whole model, with no wrapper of its own; used by
the reproducible mode (TrainerConfig.reproducible), which reduces gradients exactly itself
(training/reproducible/) instead of DDP's floating-point all_reduce."""

from __future__ import annotations

import torch
from torch import nn

from nn_handler.strategies.base import Strategy


class ReplicatedStrategy(Strategy):
    """The model on every rank as it is; its parameters and buffers start as rank 0's (one
    broadcast at setup, after initialisation, as DDP makes them)."""

    name = "replicated"

    def wrap(self, module: nn.Module) -> nn.Module:
        if self.comm.world_size > 1:
            tensors = [t.detach() for t in (*module.parameters(), *module.buffers())]
            received = self.comm.broadcast(tensors, src=0)
            with torch.no_grad():
                for mine, first in zip(tensors, received, strict=True):
                    mine.copy_(first)
        return module


__all__ = ["ReplicatedStrategy"]
