"""A small run whose exact resume the checkpoint tests compare against an uninterrupted one."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nn_handler import HandlerConfig, Hook, NNHandler, TrainingPreempted
from nn_handler.monitoring import RECORD_KEYS
from tests.training_helpers import regression_data

#: The measured (not reproducible) keys of an epoch record: the loop's timing and the
#: ThroughputMonitor's.
TIMING_KEYS = ("samples_per_sec", "epoch_time", *RECORD_KEYS)
EPOCHS = 3


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.3), nn.Linear(16, 3))


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def step_lr(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)


def config(folder: Path, world_size: int, features: bool, **checkpoint: Any) -> HandlerConfig:
    """Per-rank batch 8 // world_size: 40 samples make 5 optimizer steps per epoch."""
    data: dict[str, Any] = {
        "loader": {"batch_size": 8 // world_size, "shuffle": True, "seed": 5},
        "trainer": {"progress_bar": False},
        "checkpoint": {"dir": str(folder), "every_n_steps": 2, **checkpoint},
    }
    if features:
        data["precision"] = "bf16"
        data["ema"] = {"enabled": True, "decay": 0.9}
        data["trainer"]["accumulate_grad_batches"] = 2
    return HandlerConfig.from_dict(data)


class SigtermAt(Hook):
    """Sends this process a real SIGTERM (or ``signum``, ``times`` times) after optimizer step
    ``step`` (on ``rank`` only)."""

    def __init__(
        self, step: int, rank: int = 0, signum: int = signal.SIGTERM, times: int = 1
    ) -> None:
        super().__init__()
        self.step = step
        self.rank = rank
        self.signum = signum
        self.times = times

    def after_step(self) -> None:
        trainer = self.trainer
        at_step = trainer.state.global_step == self.step and trainer.state.step_synced
        if trainer.comm.rank == self.rank and at_step:
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)


def handler(folder: Path, world_size: int, features: bool, context: Any, **kw: Any) -> NNHandler:
    hooks = kw.pop("hooks", ())
    return NNHandler(
        model(),
        adam,
        nn.CrossEntropyLoss(),
        step_lr,
        config=config(folder, world_size, features, **kw),
        context=context,
        hooks=hooks,
    )


def outcome(h: NNHandler) -> dict[str, Any]:
    """Everything that must match bit for bit: weights, optimizer, EMA, History (no timings)."""
    trainer = h.trainer
    return {
        "model": {k: v.clone() for k, v in h.model.state_dict().items()},
        "optimizer": trainer.optimizer.state_dict() if trainer.optimizer else None,
        "ema": trainer.ema.module.state_dict() if trainer.ema else None,
        "history": [
            {k: v for k, v in r.items() if k not in TIMING_KEYS} for r in h.history.records
        ],
        "global_step": trainer.state.global_step,
    }


def same(a: Any, b: Any) -> bool:
    """Bit-identical nested structures (NaN equals NaN)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return bool(a == b)


def scenario(
    base: Path,
    world_size: int,
    features: bool,
    context: Any = None,
    signum: int = signal.SIGTERM,
) -> dict[str, Any]:
    """Uninterrupted, stopped after epoch 1 then resumed, and SIGTERM'd (or ``signum``) after
    step 7 (mid epoch 2) then resumed: the three outcomes, plus what the preemption
    reported."""
    data, val = regression_data(), regression_data(n=16, seed=1)
    results: dict[str, Any] = {}
    with handler(base / "full", world_size, features, context) as h:
        h.train(data, val, epochs=EPOCHS)
        results["full"] = outcome(h)
    with handler(base / "epoch", world_size, features, context) as h:
        h.train(data, val, epochs=1)
    with handler(base / "epoch", world_size, features, context) as h:
        results["epoch_resumed_from"] = str(h.resume("latest"))
        h.train(data, val, epochs=EPOCHS)
        results["epoch"] = outcome(h)
    stop_at = SigtermAt(7, signum=signum)
    with handler(base / "step", world_size, features, context, hooks=[stop_at]) as h:
        try:
            h.train(data, val, epochs=EPOCHS)
        except TrainingPreempted as stop:
            results["preempted"] = (stop.code, stop.global_step, stop.checkpoint)
    with handler(base / "step", world_size, features, context, resume="auto") as h:
        h.train(data, val, epochs=EPOCHS)
        results["step"] = outcome(h)
    return results
