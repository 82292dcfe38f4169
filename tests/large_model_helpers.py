"""A small stack of residual blocks for the large-model tests (meta-device initialisation,
activation checkpointing, HSDP, per-block compile), built on the meta device or not."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

WIDTH, CLASSES = 16, 3


class Block(nn.Module):
    """LayerNorm, Linear, GELU, dropout, with a residual connection."""

    def __init__(self, width: int = WIDTH, dropout: float = 0.0) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(nn.functional.gelu(self.linear(self.norm(x))))


def blocks_model(depth: int = 3, dropout: float = 0.0, meta: bool = True) -> nn.Module:
    """``depth`` blocks between an input and an output Linear (on the meta device)."""
    device = torch.device("meta") if meta else torch.device("cpu")
    with device:
        return nn.Sequential(
            nn.Linear(6, WIDTH),
            *[Block(WIDTH, dropout) for _ in range(depth)],
            nn.Linear(WIDTH, CLASSES),
        )


def blocks_data(n: int = 48, seed: int = 0) -> Any:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 6, generator=generator), torch.randint(0, CLASSES, (n,), generator=generator)
    )


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def whole_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """The full state of a plain or FSDP2 module on every rank (a collective when sharded)."""
    from torch.distributed.tensor import DTensor

    return {
        k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
        for k, v in module.state_dict().items()
    }
