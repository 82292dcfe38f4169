"""Seed 003's Method 1 and Method 2, written as the seed writes them (digits, a small model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from nn_handler.digits import digits_datasets
from nn_handler.training_engine import TrainingEngine


class YourModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


def method_1(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """The seed's Method 1, line for line (plus a checkpoint folder and no progress bar)."""
    batch_size, num_epochs = 32, 8
    device = torch.device("cpu")
    train_dataset, val_dataset = digits_datasets()

    # Initialize distributed training (call this in each process)
    TrainingEngine.setup_distributed(rank, world_size)

    # Create model and move to GPU
    torch.manual_seed(0)
    model = YourModel().to(device)

    # Create distributed samplers
    train_sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank)
    val_sampler = DistributedSampler(val_dataset, num_replicas=world_size, rank=rank)

    # Create data loaders with samplers
    train_loader = DataLoader(train_dataset, batch_size=batch_size, sampler=train_sampler)
    val_loader = DataLoader(val_dataset, batch_size=batch_size, sampler=val_sampler)

    # Create training engine with distributed=True
    engine = TrainingEngine(
        model=model,
        device=device,
        distributed=True,
        local_rank=rank,
        world_size=world_size,
        checkpoint_dir=folder,
        progress_bar=False,
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    criterion = nn.CrossEntropyLoss()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)

    # Train as usual
    history = engine.train(
        train_loader=train_loader,
        val_loader=val_loader,
        optimizer=optimizer,
        criterion=criterion,
        scheduler=scheduler,
        num_epochs=num_epochs,
        save_best=True,
        save_last=True,
    )
    reduced = engine._reduce_tensor(torch.tensor([float(rank)]))
    ddp = type(engine.trainer.model).__name__ if engine.trainer else None
    modules = engine.trainer.module.modules() if engine.trainer else []
    sync_bn = any("SyncBatchNorm" in type(m).__name__ for m in modules)
    if engine.trainer is not None:
        engine.trainer.release_wrappers()

    # Cleanup
    TrainingEngine.cleanup_distributed()
    return {
        "history": history.records,
        "reduced": float(reduced),
        "ddp": ddp,
        "sync_bn": sync_bn,
        "files": sorted(p.name for p in (Path(folder) / "experiment").iterdir()),
    }
