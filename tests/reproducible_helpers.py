"""Models, data and a canonical hash for the reproducible-mode tests: a small CNN with
BatchNorm and dropout, a transformer block (LayerNorm, dropout), and the SHA-256 of a run's
weights, buffers, optimizer state and History (losses and metrics, not timings)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from nn_handler import NNHandler
from nn_handler.distributed.context import DistributedContext

#: History keys that are losses, metrics or counts (the others are timings and readings).
COMPUTED = ("epoch", "train_loss", "skipped_steps", "lr")
EPOCHS = 2


def images(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, 8, 8, generator=g)
    y = (x.mean((1, 2, 3)) > 0).long() + (x[:, 0, 2:5, 2:5].mean((1, 2)) > 0).long()
    return TensorDataset(x, y)


def sequences(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, 16, generator=g)
    return TensorDataset(x, (x[:, :, 0].mean(1) > 0).long())


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 6, 3), nn.BatchNorm2d(6), nn.ReLU(), nn.Dropout(0.2),
        nn.Conv2d(6, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 16, 3),
    )  # fmt: skip


class Block(nn.Module):
    """A transformer encoder block (attention, LayerNorm, dropout) and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.block = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.1, batch_first=True)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.block(x).mean(1))
        return out


WORKLOADS: dict[str, Any] = {
    "cnn": (cnn, images, 96, 16, 4),  # model, data, samples, global batch, micro batch
    "transformer": (Block, sequences, 96, 16, 4),
}


class StepCounter(nn.Module):
    """A layer whose forward changes its buffer (a step counter): the mode refuses it at the
    first step."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen += 1
        return x


def config(
    name: str,
    folder: Path | None = None,
    tracked: Path | None = None,
    reduction: str = "exact",
    **trainer: Any,
) -> dict[str, Any]:
    """The workload's settings: checkpoints in ``folder``, a CSV tracker writing every step's
    loss in ``tracked``, the mode's ``reduction``, ``trainer`` settings of the Trainer."""
    _, _, _, global_batch, micro = WORKLOADS[name]
    csv = {"type": "csv", "dir": str(tracked), "every_n_steps": 1, "log_curves": False}
    # No allow_world_size_change: the mode resumes at any world size exactly.
    checkpoint = {"dir": str(folder), "every_n_steps": 3, "keep_last": 10}
    return {
        "loader": {"batch_size": 8, "seed": 3},
        "trainer": {
            "progress_bar": False,
            "reproducible": {
                "global_batch_size": global_batch,
                "micro_batch_size": micro,
                "reduction": reduction,
            },
            **trainer,
        },
        **({"checkpoint": checkpoint} if folder is not None else {}),
        **({"logging": {"trackers": [csv]}} if tracked is not None else {}),
    }


#: The units FSDP2 shards in each workload: every layer of the CNN, the transformer's
#: encoder layer (attention reads its parameters outside its own forward) and the root.
BLOCKS = {"cnn": ["Conv2d", "Linear"], "transformer": ["TransformerEncoderLayer"]}


def sharded(name: str, fsdp: dict[str, Any] | None) -> dict[str, Any]:
    """TrainerConfig settings: ``name``'s blocks sharded with ``fsdp`` (None: replicated)."""
    if fsdp is None:
        return {}
    return {"strategy": "fsdp", "fsdp": {"blocks": BLOCKS[name], **fsdp}}


def handler(name: str, context: DistributedContext | None, **kw: Any) -> NNHandler:
    model, _, _, _, _ = WORKLOADS[name]
    return NNHandler(
        model(),
        lambda p: torch.optim.Adam(p, lr=3e-3),
        nn.CrossEntropyLoss(),
        config=config(name, **kw),
        context=context,
    )


def train(h: NNHandler, name: str, epochs: int = EPOCHS) -> None:
    _, data, n, _, _ = WORKLOADS[name]
    h.train(data(n, 0), data(40, 1), epochs=epochs)


def digest(h: NNHandler) -> str:
    """SHA-256 of the model's parameters and buffers, the optimizer's state and the History's
    losses and metrics (rank 0's view; every rank must call this)."""
    sha = hashlib.sha256()
    _feed(sha, dict(h.model.state_dict()))
    optimizer = h.trainer.optimizer
    if optimizer is not None:
        _feed(sha, optimizer.state_dict())
    for record in h.history:
        _feed(sha, {k: v for k, v in record.items() if k in COMPUTED or k.startswith("val_")})
    return sha.hexdigest()


def full_digest(h: NNHandler) -> str:
    """``digest`` over the whole state, whatever the strategy: the model and the optimizer
    gathered to rank 0 and keyed by parameter name (torch.distributed.checkpoint.state_dict),
    so that a sharded run and a replicated one compare. Every rank must call this; rank 0's
    is the run's (the others hash what they were given: nothing)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    whole = StateDictOptions(full_state_dict=True, cpu_offload=True)
    module = h.trainer.module
    sha = hashlib.sha256()
    _feed(sha, dict(get_model_state_dict(module, options=whole)))
    optimizer = h.trainer.optimizer
    if optimizer is not None:
        _feed(sha, dict(get_optimizer_state_dict(module, optimizer, options=whole)))
    for record in h.history:
        _feed(sha, {k: v for k, v in record.items() if k in COMPUTED or k.startswith("val_")})
    return sha.hexdigest()


def state_digest(*parts: Any) -> str:
    """The SHA-256 of ``parts`` (tensors, state dicts, lists, floats: bit for bit)."""
    sha = hashlib.sha256()
    for part in parts:
        _feed(sha, part)
    return sha.hexdigest()


def _feed(sha: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        sha.update(f"{value.dtype}{tuple(value.shape)}".encode())
        sha.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            sha.update(repr(key).encode())
            _feed(sha, value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            _feed(sha, item)
    elif isinstance(value, float):
        sha.update(value.hex().encode())
    else:
        sha.update(repr(value).encode())
