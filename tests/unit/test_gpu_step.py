"""On CUDA a steady-state step synchronises nothing with the host: torch's sync debug mode,
set to raise, holds over every step between log steps (the CPU counterpart, counting reads
per batch, is tests/unit/test_host_reads.py). Skipped cleanly without CUDA."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import Hook, NNHandler
from tests.conftest import cuda_only
from tests.training_helpers import mlp, regression_data

pytestmark = [pytest.mark.gpu, cuda_only]

LOG_EVERY = 20


class NoSyncBetweenLogSteps(Hook):
    """Raise on any host synchronisation in the steps between log steps (after the first 5,
    which build the optimizer's state and count the FLOPs; not in the epoch's last)."""

    def __init__(self) -> None:
        self.checked = 0

    def before_step(self) -> None:
        index = self.trainer.state.batch_index
        if index >= 5 and (index + 1) % LOG_EVERY and index + 1 < 120:
            torch.cuda.set_sync_debug_mode("error")
            self.checked += 1

    def after_step(self) -> None:
        torch.cuda.set_sync_debug_mode("default")

    def after_train(self) -> None:
        torch.cuda.set_sync_debug_mode("default")


def fused_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def fused_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)


CONFIGURATIONS: dict[str, tuple[Any, dict[str, Any]]] = {
    "fused AdamW": (fused_adamw, {}),
    # Windows of 3 end off the log steps: the losses are folded there (batch 21).
    "fused AdamW, bf16, EMA, clipping, accumulation, BatchNorm": (
        fused_adamw,
        {
            "precision": "bf16",
            "ema": {"enabled": True},
            "trainer": {"gradient_clip_val": 1.0, "accumulate_grad_batches": 3},
        },
    ),
    "fused SGD, fp16 (GradScaler)": (fused_sgd, {"precision": "fp16"}),
    "fused SGD, a per-step schedule": (fused_sgd, {"trainer": {"scheduler_interval": "step"}}),
}


@pytest.mark.parametrize("name", list(CONFIGURATIONS))
def test_a_steady_state_step_does_not_synchronise_on_cuda(name: str) -> None:
    optimizer, config = CONFIGURATIONS[name]
    hook = NoSyncBetweenLogSteps()
    trainer = {"progress_bar": False, "log_every_n_steps": LOG_EVERY, **config.pop("trainer", {})}
    handler = NNHandler(
        mlp(batchnorm="BatchNorm" in name),
        optimizer,
        nn.CrossEntropyLoss(),
        (lambda opt: torch.optim.lr_scheduler.StepLR(opt, 10)) if "schedule" in name else None,
        hooks=[hook],
        config={
            "loader": {"batch_size": 2},
            "trainer": trainer,
            "distributed": {"device": "cuda"},
            **config,
        },
    )
    try:
        handler.train(regression_data(n=240))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert handler.trainer.device.type == "cuda"
    assert hook.checked == 114 - 5  # batches 5..118 but the 5 that end a log step


def test_a_nan_step_is_skipped_on_the_device_and_counted_at_the_log_step() -> None:
    class NaNAtBatch3(torch.utils.data.Dataset[Any]):
        data = regression_data(n=80)

        def __len__(self) -> int:
            return 80

        def __getitem__(self, index: int) -> Any:
            features, label = self.data[index]
            return (features * float("nan") if index // 4 == 3 else features), label

    weights: list[torch.Tensor] = []

    class Weights(Hook):
        def after_optimizer_step(self) -> None:
            weights.append(self.trainer.module[0].weight.detach().clone())

    handler = NNHandler(
        mlp(batchnorm=True),
        fused_adamw,
        nn.CrossEntropyLoss(),
        hooks=[Weights()],
        config={
            "loader": {"batch_size": 4, "shuffle": False},
            "trainer": {"progress_bar": False, "log_every_n_steps": LOG_EVERY},
            "distributed": {"device": "cuda"},
        },
    )
    handler.train(NaNAtBatch3())
    assert handler.trainer.optimization.guard.on_device
    assert handler.history.last["skipped_steps"] == 1.0
    assert torch.equal(weights[2], weights[3]) and not torch.equal(weights[3], weights[4])
    state = handler.model.state_dict()
    assert all(torch.isfinite(v.double()).all() for v in state.values())
