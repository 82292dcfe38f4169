"""Seed 003's Method 1 (TrainingEngine directly) and Method 2 (launch_distributed_training
with distributed_train_worker) on 2 real gloo processes, with digits and a small model."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler.digits import digits_datasets
from nn_handler.training_engine import (
    distributed_train_worker,
    launch_distributed_training,
)
from tests.engine_helpers import YourModel, method_1
from tests.harness import run_group

pytestmark = pytest.mark.distributed


def test_method_1_trains_with_ddp_syncbn_and_checkpoints() -> None:
    with tempfile.TemporaryDirectory(prefix="nnh-engine-") as folder:
        results = run_group(method_1, 2, args=(folder,), init="env", timeout=180)
    for result in results:
        assert result["ddp"] == "DistributedDataParallel" and result["sync_bn"]
        assert result["reduced"] == 0.5  # the mean of ranks 0 and 1
        assert "best.pt" in result["files"] and "latest.json" in result["files"]
    losses = [[r["val_loss"] for r in result["history"]] for result in results]
    assert losses[0] == losses[1]  # reduced metrics: the same on every rank
    assert losses[0][-1] < 0.3


def test_method_2_launch_distributed_training_as_the_seed_writes_it() -> None:
    train_dataset, val_dataset = digits_datasets()
    with tempfile.TemporaryDirectory(prefix="nnh-engine-") as folder:
        config: dict[str, Any] = {
            "model_fn": lambda: YourModel(),
            "train_dataset": train_dataset,
            "val_dataset": val_dataset,
            "batch_size": 32,
            "num_workers": 0,
            "optimizer_fn": lambda params: torch.optim.Adam(params, lr=0.003),
            "criterion_fn": lambda: nn.CrossEntropyLoss(),
            "scheduler_fn": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=10),
            "engine_kwargs": {
                "use_amp": True,
                "use_ema": False,
                "experiment_name": "my_experiment",
                "checkpoint_dir": folder,
                "progress_bar": False,
            },
            "train_kwargs": {"num_epochs": 8, "save_best": True, "save_last": True},
        }
        world_size = 2
        histories = launch_distributed_training(
            train_fn=distributed_train_worker, world_size=world_size, backend="gloo", **config
        )
    assert len(histories) == 2 and histories[0]["val_loss"] == histories[1]["val_loss"]
    assert histories[0]["val_loss"][-1] < 0.3
