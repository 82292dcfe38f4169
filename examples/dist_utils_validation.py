"""Seed 000's dist_utils workflow: gather predictions from every process during validation,
compute metrics on the main process, print GPU memory, synchronize.

    python examples/dist_utils_validation.py                       # one process
    torchrun --nproc-per-node=2 examples/dist_utils_validation.py  # two processes

The seed's names come from ``nn_handler.distributed``; the model is a small classifier on the
bundled digits (its own shard of the validation set on each rank).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader

from nn_handler.config import LoaderConfig
from nn_handler.data import LoaderFactory
from nn_handler.digits import digits_datasets
from nn_handler.distributed import (
    DistributedContext,
    all_gather,
    get_rank,
    get_world_size,
    is_main_process,
    print_gpu_memory_usage,
    reduce_dict,
    shared_random_seed,
    synchronize,
)


def compute_metrics(predictions: list[int], labels: list[int]) -> dict[str, float]:
    correct = sum(int(p == t) for p, t in zip(predictions, labels, strict=True))
    return {"accuracy": correct / len(labels), "samples": float(len(labels))}


def main() -> None:
    # Initialize distributed training (from torchrun's variables; alone: one process)
    with DistributedContext() as ctx:
        torch.manual_seed(0)
        train, val = digits_datasets()
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 10))

        # Train model (a few plain steps; every rank holds the same weights here)
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        model.train()
        for x, y in DataLoader(train, batch_size=256, shuffle=False):
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()

        # Validation on this rank's shard: every sample exactly once across ranks
        loaders = LoaderFactory.from_context(LoaderConfig(batch_size=64), ctx)
        model.eval()
        predictions: list[int] = []
        labels: list[int] = []
        for x, y in loaders.eval_loader(val):
            with torch.no_grad():
                preds = model(x).argmax(dim=1)
                predictions.extend(preds.detach().cpu().tolist())
                labels.extend(y.detach().cpu().tolist())

        # Gather predictions from all processes
        all_predictions = all_gather(predictions)
        all_labels = all_gather(labels)

        # Only the main process computes and logs metrics
        if is_main_process():
            flat_predictions = [p for sublist in all_predictions for p in sublist]
            flat_labels = [t for sublist in all_labels for t in sublist]
            metrics = compute_metrics(flat_predictions, flat_labels)
            print(f"Validation metrics ({get_world_size()} process(es)): {metrics}")

        # The same numbers without moving the predictions: a NaN-aware reduce_dict of means
        local = compute_metrics(predictions, labels)
        averaged = reduce_dict({"accuracy": local["accuracy"]})
        seed = shared_random_seed()  # the same on every rank
        if is_main_process():
            print(f"mean of per-rank accuracies: {averaged['accuracy']:.4f}; shared seed {seed}")

        # Monitor GPU memory usage
        if is_main_process():
            device = torch.cuda.current_device() if torch.cuda.is_available() else None
            print_gpu_memory_usage(device)

        # Synchronize all processes before continuing
        synchronize()
        print(f"rank {get_rank()} done")


if __name__ == "__main__":
    main()
