"""Early stopping on a monitored epoch metric."""

from __future__ import annotations

import math
from typing import Any

from nn_handler.config.training import EarlyStoppingConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError
from nn_handler.training.history import Record
from nn_handler.training.hooks import HookList
from nn_handler.training.state import TrainerState


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
        #: The settings of the run whose checkpoint was restored (None: none was, or it did
        #: not record them).
        self.restored_settings: dict[str, Any] | None = None

    def settings(self) -> dict[str, Any]:
        """What decides a stop: the monitored key, its mode, patience and min_delta."""
        config = self.config
        return {"monitor": config.monitor, "mode": config.mode, "patience": config.patience,
                "min_delta": config.min_delta}  # fmt: skip

    def settings_changed(self) -> bool:
        """Whether a checkpoint was restored whose run stopped with other settings."""
        restored = self.restored_settings
        return restored is not None and restored != self.settings()

    def should_stop(self) -> bool:
        """Whether patience has run out, by this run's settings."""
        return self.wait >= self.config.patience

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
        return {"best": self.best, "best_epoch": self.best_epoch, "wait": self.wait,
                "settings": self.settings()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best = float(state["best"])
        self.best_epoch = int(state["best_epoch"])
        self.wait = int(state["wait"])
        settings = state.get("settings")
        self.restored_settings = dict(settings) if isinstance(settings, dict) else None


def reconsidered_stop(
    stopper: EarlyStopping | None, stopped: bool, stopped_early: bool
) -> tuple[bool, str] | None:
    """A resumed stop (``stopped``) that early stopping decided (``stopped_early``), when its
    settings changed since (another patience, monitor, mode or min_delta:
    ``settings_changed``; or early stopping turned off, ``stopper`` None): whether this run's
    settings stop it, from the restored counters, and the line that says so. None: the
    resumed decision stands."""
    if not (stopped and stopped_early) or (stopper is not None and not stopper.settings_changed()):
        return None
    stops = stopper is not None and stopper.should_stop()
    return stops, (
        f"early stopping's settings changed since the checkpoint's stop "
        f"({None if stopper is None else stopper.restored_settings} -> "
        f"{None if stopper is None else stopper.settings()}): "
        f"{'it still stops' if stops else 'training goes on'}"
    )


def agree_at_the_epoch_end(
    hooks: HookList,
    comm: Communicator,
    stopper: EarlyStopping | None,
    last: Record,
    state: TrainerState,
    validation_error: Exception | None,
) -> bool:
    """One agreement for the after_validation and after_epoch hooks and early stopping (fed
    the epoch's record ``last``), carrying rank 0's stop decision into ``state.should_stop``
    on every rank (no collective of their own). A rank whose after_validation hooks raised
    (``validation_error``) raises on every rank. Returns whether early stopping decided the
    stop here. Every rank must call this."""
    early = [False]

    def first() -> None:
        if validation_error is not None:  # this rank's after_validation hooks raised
            raise validation_error
        watched = stopper is not None and state.counts(stopper.config.monitor)
        if watched and stopper is not None and stopper.update(last, state.epoch):
            state.should_stop = early[0] = True

    shared = hooks.call_agreed(
        "after_epoch",
        comm,
        "after_validation hooks, early stopping and after_epoch hooks",
        first=first,
        share=lambda: [int(state.should_stop)],
    )
    state.should_stop = bool(shared[0][0])
    return state.should_stop and early[0]


__all__ = ["EarlyStopping", "agree_at_the_epoch_end", "reconsidered_stop"]
