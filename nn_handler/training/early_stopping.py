"""Early stopping on a monitored epoch metric."""

from __future__ import annotations

import math
from typing import Any

from nn_handler.config.training import EarlyStoppingConfig
from nn_handler.errors import ConfigError


class EarlyStopping:
    """Tracks the best value of ``config.monitor`` and says when patience has run out.

    Fed with reduced metrics (the same on every rank), it decides the same on every rank; the
    trainer still broadcasts rank 0's decision, so replicas can never part ways.
    """

    def __init__(self, config: EarlyStoppingConfig) -> None:
        self.config = config
        self.best = math.inf if config.mode == "min" else -math.inf
        self.best_epoch = -1
        self.wait = 0

    def improved(self, value: float) -> bool:
        delta = self.config.min_delta
        if self.config.mode == "min":
            return value < self.best - delta
        return value > self.best + delta

    def update(self, record: dict[str, float], epoch: int) -> bool:
        """Record one epoch; True when training should stop after it."""
        if self.config.monitor not in record:
            raise ConfigError(
                f"early stopping monitors {self.config.monitor!r}, but the epoch record has "
                f"only {sorted(record)}; set EarlyStoppingConfig(monitor=...) to one of them "
                f"(validation metrics need val_data)."
            )
        value = record[self.config.monitor]
        if not math.isnan(value) and self.improved(value):
            self.best, self.best_epoch, self.wait = value, epoch, 0
            return False
        self.wait += 1
        return self.wait >= self.config.patience

    def describe(self) -> str:
        """Why it stopped, for the log."""
        return (
            f"early stopping: {self.config.monitor} has not improved for {self.wait} epochs "
            f"(best {self.best:.6g} at epoch {self.best_epoch})"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.wait = int(state["wait"])


__all__ = ["EarlyStopping"]
