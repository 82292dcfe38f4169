"""SingleDeviceStrategy: one process, one device, no wrapper."""

from __future__ import annotations

from torch import nn

from nn_handler.strategies.base import Strategy


class SingleDeviceStrategy(Strategy):
    """The model on this process's device, trained as it is (a group of one)."""

    name = "single"

    def wrap(self, module: nn.Module) -> nn.Module:
        return module


__all__ = ["SingleDeviceStrategy"]
