"""The digits CNN on a Ray cluster with Ray Train: Ray starts the workers and their process
group, restarts the group when a worker dies, and keeps the checkpoints.

    pip install "nn_handler[ray,demo]"
    python examples/ray_train.py                        # a local Ray cluster, 2 CPU workers
    python examples/ray_train.py --address auto         # a running cluster (`ray start --head`)
    python examples/ray_train.py --workers 8 --gpu --storage s3://bucket/runs

The training function is an ordinary nn_handler script: NNHandler adopts the process group
Ray made and shards the data over Ray's workers. RayTrainReport reports every committed
checkpoint to Ray (which copies it to --storage and keeps the best two by val_accuracy) and,
when Ray restarts the group after a failure, resumes from Ray's latest checkpoint. Prints
``final: val_accuracy=...`` (about 0.97 after 6 epochs).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import ray
import torch
from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from torch import nn

from nn_handler import NNHandler, accuracy
from nn_handler.digits import DigitsCNN, digits_datasets
from nn_handler.ray_train import RayTrainReport


def train_loop(config: dict[str, Any]) -> None:
    """Runs in every Ray Train worker; the same code runs under torchrun."""
    torch.manual_seed(0)
    train, val = digits_datasets()
    settings = {
        "loader": {"batch_size": 32, "shuffle": True, "seed": 0},
        "trainer": {"progress_bar": False},
        # Each worker's local staging folder; Ray keeps the reported copies.
        # Preemptions are Ray's: it restarts the group from its latest checkpoint.
        "checkpoint": {"dir": config["staging"], "every_n_epochs": 1, "handle_sigterm": False},
    }
    with NNHandler(
        DigitsCNN(),
        lambda params: torch.optim.Adam(params, lr=3e-3),
        nn.CrossEntropyLoss(),
        config=settings,
        metrics={"accuracy": accuracy},
        hooks=[RayTrainReport()],
    ) as handler:
        handler.train(train, val, epochs=config["epochs"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--address", default=None, help="a running cluster ('auto'); none: local")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="one GPU per worker (nccl)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--storage", default=os.path.abspath("runs/ray"), help="Ray's storage")
    args = parser.parse_args()

    if args.address is None:
        ray.init(num_cpus=args.workers)
    else:
        ray.init(address=args.address)
    staging = tempfile.mkdtemp(prefix="nn_handler-ray-")  # this run's local checkpoints
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"epochs": args.epochs, "staging": staging},
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=args.gpu),
        run_config=RunConfig(
            storage_path=args.storage,
            name="digits",
            failure_config=FailureConfig(max_failures=3),  # restarts resume from Ray's latest
            checkpoint_config=CheckpointConfig(
                num_to_keep=2,
                checkpoint_score_attribute="val_accuracy",
                checkpoint_score_order="max",
            ),
        ),
    )
    result = trainer.fit()
    assert result.checkpoint is not None
    print(
        f"final: val_accuracy={result.metrics['val_accuracy']:.3f} after "
        f"{result.metrics['epoch']} epochs; checkpoint {result.checkpoint.path}"
    )


if __name__ == "__main__":
    main()
