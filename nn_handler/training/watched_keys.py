"""Monitored History keys checked before the first epoch: a misspelt ``monitor`` (early
stopping, save_best, ReduceLROnPlateau) is a ConfigError with a "did you mean" at once, not
after a whole epoch of training."""

from __future__ import annotations

import difflib
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch

from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.config.training import TrainerConfig
from nn_handler.errors import ConfigError
from nn_handler.training.early_stopping import EarlyStopping

#: The keys every epoch record has (train_epoch and the loop), besides validation's.
TRAINING_KEYS = ("epoch", "train_loss", "samples_per_sec", "epoch_time", "skipped_steps", "lr")
#: Trainer methods whose override decides the record's keys.
RECORD_METHODS = ("train_epoch", "validation_step", "evaluate")


def expected_keys(
    overridden: Collection[str],
    metric_names: Iterable[str],
    validates: bool,
    sets: Sequence[str] = (),
) -> set[str] | None:
    """The keys the epoch records of a fit will have, or None when a subclass decides them
    (``overridden`` names one of RECORD_METHODS); ``sets``: the names of several validation
    sets (``val_<metric>/<name>``)."""
    if any(name in overridden for name in RECORD_METHODS):
        return None
    keys = set(TRAINING_KEYS)
    if validates:
        names = ["loss", *metric_names]
        keys |= (
            {f"val_{m}/{s}" for m in names for s in sets} if sets else {f"val_{m}" for m in names}
        )
    return keys


def monitored(
    early_stopping: EarlyStopping | None,
    checkpoint: CheckpointConfig | None,
    scheduler: Any,
    config: TrainerConfig,
) -> Iterable[tuple[str, str, str]]:
    """(what, key, where to change it) for every key the configuration watches
    (``checkpoint``: the config of a run that writes checkpoints, else None)."""
    if early_stopping is not None:
        yield "early stopping", early_stopping.config.monitor, "EarlyStoppingConfig(monitor=...)"
    if checkpoint is not None and checkpoint.save_best:
        yield "save_best", checkpoint.monitor, "CheckpointConfig(monitor=...)"
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau
    if isinstance(scheduler, plateau) and config.scheduler_interval == "epoch":
        yield "ReduceLROnPlateau", config.scheduler_monitor, "TrainerConfig(scheduler_monitor=...)"


def check_monitors(
    keys: set[str] | None,
    watched: Iterable[tuple[str, str, str]],
    validates: bool,
    own_training_keys: bool,
) -> None:
    """Raise ConfigError when a watched key is not one the run will produce (where that can be
    known: ``keys`` from expected_keys). ``own_training_keys``: an overridden training_step may
    return more scalars, logged as train_<name>. The same decision on every rank: it depends on
    the configuration only."""
    if keys is None:
        return
    for what, key, setting in watched:
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


def check_trainer_monitors(
    trainer_class: type,
    base: type,
    metric_names: Iterable[str],
    validates: bool,
    watched: Iterable[tuple[str, str, str]],
    sets: Sequence[str] = (),
) -> None:
    """``check_monitors`` for a Trainer subclass: which of RECORD_METHODS and
    ``training_step`` it overrides decides which keys are known (``sets``: the names of
    several validation sets)."""
    overridden = {m for m in RECORD_METHODS if getattr(trainer_class, m) is not getattr(base, m)}
    step = "training_step"
    own_training_keys = getattr(trainer_class, step) is not getattr(base, step)
    keys = expected_keys(overridden, metric_names, validates, sets)
    check_monitors(keys, watched, validates, own_training_keys)


__all__ = [
    "RECORD_METHODS",
    "TRAINING_KEYS",
    "check_monitors",
    "check_trainer_monitors",
    "expected_keys",
    "monitored",
]
