"""Seed 003's launch workflow with a small model: launch_distributed_training calls
train_fn(rank, world_size, **kwargs) in each of world_size processes (nccl on GPUs, gloo here).

    python examples/launch_training.py [--world-size 2] [--epochs 5]

The batch size is per process: the effective batch size is batch_size x world_size.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from nn_handler import launch_distributed_training
from nn_handler.utils.dd_helpers import aggregate_metrics


def make_dataset(n: int = 512, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 2, generator=generator)
    y = (x[:, 0] * x[:, 1] > 0).long()  # XOR-like quadrants: needs a hidden layer
    return TensorDataset(x, y)


def train_worker(
    rank: int,
    world_size: int,
    *,
    model_fn: Callable[[], nn.Module],
    train_dataset: Dataset[tuple[torch.Tensor, torch.Tensor]],
    batch_size: int,
    epochs: int,
    lr: float,
) -> dict[str, float]:
    torch.manual_seed(0)  # the same initial weights on every rank
    model = nn.parallel.DistributedDataParallel(model_fn())
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    sampler = DistributedSampler(train_dataset, num_replicas=world_size, rank=rank, seed=0)
    loader = DataLoader(train_dataset, batch_size=batch_size, sampler=sampler)
    criterion = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            criterion(model(x), y).backward()
            optimizer.step()
    with torch.no_grad():
        x, y = next(iter(DataLoader(train_dataset, batch_size=len(train_dataset))))  # type: ignore[arg-type]
        accuracy = (model(x).argmax(dim=1) == y).float().mean().item()
    return aggregate_metrics({"accuracy": accuracy}, world_size, torch.device("cpu"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=30)
    args = parser.parse_args()
    results = launch_distributed_training(
        train_fn=train_worker,
        world_size=args.world_size,
        model_fn=lambda: nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2)),
        train_dataset=make_dataset(),
        batch_size=32,
        epochs=args.epochs,
        lr=0.05,
    )
    print(f"{args.world_size} processes; training accuracy per rank: {results}")


if __name__ == "__main__":
    main()
