"""Tiny models and data shared by the Trainer tests (unit and distributed)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset


def regression_data(n: int = 40, features: int = 6, classes: int = 3, seed: int = 0) -> Any:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = torch.randint(0, classes, (n,), generator=generator)
    return TensorDataset(x, y)


def mlp(seed: int = 0, batchnorm: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    norm: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
    return nn.Sequential(nn.Linear(6, 16), norm, nn.Tanh(), nn.Linear(16, 3))


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def state_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers, detached copies on CPU."""
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def read_rest(folder: Path | str) -> Any:
    """The unsharded parts (``trainer.pt``) of the sharded checkpoint ``folder``, verified."""
    from nn_handler.checkpoint.opening import read

    return read(folder).contents


def save_folder(store: Any, target: Path, rest: Any, shards: dict[str, Any]) -> Path:
    """The sharded checkpoint ``target`` saved into ``store`` in one process, by the one save
    route (checkpoint/saving.py): ``rest`` as its REST file, ``shards`` through DCP."""
    from nn_handler.checkpoint.saving import SaveRoute
    from nn_handler.checkpoint.sharded import ShardedWriter
    from nn_handler.distributed.communicator import NullCommunicator

    writer = ShardedWriter(NullCommunicator(), lambda: None)
    run = rest.get("run", {}).get("id") if isinstance(rest, dict) else None
    route = SaveRoute(NullCommunicator(), store, getattr(store, "where", None))
    return route.save(target, writer, (rest, shards), run=run)
