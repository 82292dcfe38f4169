"""Monitored History keys checked before the first epoch: a misspelt ``monitor`` (early
stopping, save_best, ReduceLROnPlateau) is a ConfigError with a "did you mean" at once, not
after a whole epoch of training."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from nn_handler.errors import ConfigError

if TYPE_CHECKING:
    from nn_handler.training.trainer import Trainer

#: The keys every epoch record has (train_epoch and the loop), besides validation's.
TRAINING_KEYS = ("epoch", "train_loss", "samples_per_sec", "epoch_time", "skipped_steps", "lr")


def expected_keys(trainer: Trainer, validates: bool) -> set[str] | None:
    """The keys the epoch records of ``trainer.fit`` will have, or None when a subclass
    decides them (an overridden ``train_epoch``, ``validation_step`` or ``evaluate``)."""
    from nn_handler.training.trainer import Trainer

    overridden = [
        name
        for name in ("train_epoch", "validation_step", "evaluate")
        if getattr(type(trainer), name) is not getattr(Trainer, name)
    ]
    if overridden:
        return None
    keys = set(TRAINING_KEYS)
    if validates:
        keys |= {"val_loss", *(f"val_{name}" for name in trainer.metrics)}
    return keys


def monitored(trainer: Trainer) -> Iterable[tuple[str, str, str]]:
    """(what, key, where to change it) for every key this trainer's configuration watches."""
    stopper = trainer.early_stopping
    if stopper is not None:
        yield "early stopping", stopper.config.monitor, "EarlyStoppingConfig(monitor=...)"
    manager = trainer.checkpoints
    if manager is not None and manager.config.save_best:
        yield "save_best", manager.config.monitor, "CheckpointConfig(monitor=...)"
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    if isinstance(trainer.scheduler, plateau) and trainer.config.scheduler_interval == "epoch":
        yield (
            "ReduceLROnPlateau",
            trainer.config.scheduler_monitor,
            ("TrainerConfig(scheduler_monitor=...)"),
        )


def check_monitors(trainer: Trainer, validates: bool) -> None:
    """Raise ConfigError when a monitored key is not one the run will produce (where that can
    be known). The same decision on every rank: it depends on the configuration only."""
    keys = expected_keys(trainer, validates)
    if keys is None:
        return
    from nn_handler.training.trainer import Trainer

    # An overridden training_step may return more scalars, logged as train_<name>.
    own_training_keys = type(trainer).training_step is not Trainer.training_step
    for what, key, setting in monitored(trainer):
        if key in keys or (own_training_keys and key.startswith("train_")):
            continue
        if key.startswith("val_") and not validates:
            raise ConfigError(
                f"{what} monitors {key!r}, a validation key, but train() got no validation "
                f"data: pass val_data, or set {setting} to one of {', '.join(sorted(keys))}."
            )
        close = difflib.get_close_matches(key, sorted(keys), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"{what} monitors {key!r}, which this run never records.{hint} Its epoch records "
            f"have: {', '.join(sorted(keys))}. Set {setting}."
        )


__all__ = ["TRAINING_KEYS", "check_monitors", "expected_keys", "monitored"]
