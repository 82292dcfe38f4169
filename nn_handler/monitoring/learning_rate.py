"""LearningRateMonitor: the learning rate of every optimizer step, to the experiment trackers
(Lightning's LearningRateMonitor with ``logging_interval="step"``)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from nn_handler.training.hooks import Hook


def lr_names(optimizers: list[Any]) -> list[list[str]]:
    """The key of each optimizer's parameter groups: ``lr`` for one optimizer of one group;
    else ``lr-<Optimizer>`` (``-<n>`` from the second of a class on) and ``/pg<i>`` per group
    where an optimizer has several (Lightning's names)."""
    if len(optimizers) == 1 and len(optimizers[0].param_groups) == 1:
        return [["lr"]]
    seen: Counter[str] = Counter()
    names = []
    for optimizer in optimizers:
        kind = type(optimizer).__name__
        base = f"lr-{kind}" + (f"-{seen[kind]}" if seen[kind] else "")
        seen[kind] += 1
        groups = optimizer.param_groups
        names.append([base] if len(groups) == 1 else [f"{base}/pg{i}" for i in range(len(groups))])
    return names


class LearningRateMonitor(Hook):
    """Writes each parameter group's learning rate to the trackers after every optimizer step,
    at that step (``trainer.log_metrics``: rank 0 writes, no collective). NNHandler adds one
    with ``logging: {log_lr: step}``; the epoch record's ``lr`` is there either way."""

    def __init__(self) -> None:
        super().__init__()
        self._names: list[list[str]] | None = None

    def before_train(self) -> None:
        self._names = lr_names(self.trainer.optimizers())

    def after_optimizer_step(self) -> None:
        trainer = self.trainer
        if not trainer.is_main_process:
            return
        names = self._names or lr_names(trainer.optimizers())
        rates = {
            name: float(group["lr"])
            for keys, optimizer in zip(names, trainer.optimizers(), strict=True)
            for name, group in zip(keys, optimizer.param_groups, strict=True)
        }
        trainer.log_metrics(rates)


__all__ = ["LearningRateMonitor", "lr_names"]
