"""LR schedules against the run's length: the optimizer steps a fit will take, a schedule that
would end before the run does, and stepping the per-epoch schedulers. Pure functions of the
configuration and the loop state; Optimization (optimization.py) calls them."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
from loguru import logger

from nn_handler.config.training import TrainerConfig
from nn_handler.errors import ConfigError
from nn_handler.training.batch import loader_length
from nn_handler.training.history import Record
from nn_handler.training.limits import limited, optimizer_steps_per_epoch, stepping_batches
from nn_handler.training.state import TrainerState


def train_limit(config: TrainerConfig) -> int | float | None:
    """The batches of an epoch to train (fast_dev_run or limit_train_batches; None: all)."""
    return config.fast_dev_run or config.limit_train_batches


def epoch_length(config: TrainerConfig, loader: Iterable[Any]) -> int | None:
    """The batches an epoch of ``loader`` trains (its limit applied; None: no len())."""
    return limited(loader_length(loader), train_limit(config))


def estimated_steps(
    config: TrainerConfig,
    state: TrainerState,
    loader: Iterable[Any],
    epochs: int | None,
    batches_done: int = 0,
) -> int:
    """The optimizer steps ``fit(loader, epochs=epochs)`` will have taken in total when it
    ends (steps already done included; limit_train_batches, accumulation and max_steps
    applied): the length a per-step LR schedule needs. ``batches_done``: the batches of the
    current epoch already trained (a resume or a join mid-epoch), whose steps
    ``state.global_step`` counts already. ``loader`` must have len()."""
    batches = epoch_length(config, loader)
    if batches is None:
        raise ConfigError(
            "estimated_stepping_batches needs a loader with len(); pass the number of "
            "steps to the scheduler yourself for an iterable loader."
        )
    epochs = epochs if epochs is not None else config.epochs
    if config.fast_dev_run:
        epochs = state.epoch + 1
    accumulate = config.accumulate_grad_batches
    return stepping_batches(
        batches,
        accumulate,
        epochs,
        epochs_done=state.epoch,
        steps_done=state.global_step - optimizer_steps_per_epoch(batches_done, accumulate),
        max_steps=config.max_steps,
    )


def per_step_for_a_run_length_factory(config: TrainerConfig, scheduler: Any) -> TrainerConfig:
    """``config`` for ``scheduler`` (what the Trainer was given): a factory of two arguments
    (``lambda optimizer, total_steps: ...``) builds a schedule of the run's optimizer steps,
    so scheduler_interval is 'step' where it was left unset; set to 'epoch', a ConfigError
    (the schedule would run a few of its steps and never reach its shape)."""
    factory = callable(scheduler) and not hasattr(scheduler, "step")
    if not factory or required_positional(scheduler) < 2 or config.scheduler_interval == "step":
        return config
    if "scheduler_interval" in config.model_fields_set:
        raise ConfigError(
            "the scheduler factory takes two arguments (optimizer, total_steps): a schedule "
            "of the run's optimizer steps, but trainer.scheduler_interval is 'epoch', which "
            "would step it once per epoch. Set scheduler_interval: step (or leave it unset), "
            "or give a factory of one argument (the optimizer) for a per-epoch schedule."
        )
    return config.model_copy(update={"scheduler_interval": "step"})


def check_schedulers(schedulers: list[Any], config: TrainerConfig) -> None:
    plateau = any(isinstance(s, torch.optim.lr_scheduler.ReduceLROnPlateau) for s in schedulers)
    if plateau and config.scheduler_interval == "step":
        raise ConfigError(
            "ReduceLROnPlateau steps on an epoch metric: use "
            "TrainerConfig(scheduler_interval='epoch')."
        )


def check_the_schedule_length(
    scheduler: Any,
    config: TrainerConfig,
    state: TrainerState,
    loader: Iterable[Any],
    epochs: int,
    batches_done: int = 0,
) -> None:
    """An LR schedule with a horizon (T_max, total_steps, total_iters) that this fit would
    step past (e.g. a resumed run's epochs extended): a warning where it goes on with its own
    formula (a finished cosine rises again), a ConfigError before training where torch would
    raise once past it (OneCycleLR). ``batches_done`` as for ``estimated_steps``."""
    horizon = next(
        (
            (name, int(getattr(scheduler, name)))
            for name in ("T_max", "total_steps", "total_iters")
            if isinstance(getattr(scheduler, name, None), int)
        ),
        None,
    )
    if horizon is None:
        return
    name, length = horizon
    unit = "epochs"
    total = epochs
    if config.scheduler_interval == "step":
        if epoch_length(config, loader) is None:
            return
        total = estimated_steps(config, state, loader, epochs, batches_done)
        unit = "optimizer steps"
    if total <= length:
        return
    kind = type(scheduler).__name__
    if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR):
        raise ConfigError(
            f"the LR scheduler OneCycleLR has total_steps={length} but this run goes to "
            f"{total} {unit}: torch's OneCycleLR raises one step past its end. Train to at "
            f"most {length} {unit} (epochs, or trainer.max_steps={length}), or build it for "
            f"{total} (a resumed run keeps the saved total_steps: start a new schedule for a "
            f"longer run)."
        )
    logger.warning(
        "the LR scheduler {} has {}={} but this run goes to {} {}: past its end it goes on "
        "with its own formula (a cosine schedule's learning rate rises again). Build it "
        "for {} {} to anneal over the whole run (extending epochs on resume keeps the "
        "saved {}).",
        kind,
        name,
        length,
        total,
        unit,
        total,
        unit,
        name,
    )


def step_per_epoch(
    schedulers: list[Any],
    config: TrainerConfig,
    record: Record,
    counts: Callable[[str], bool] = lambda _key: True,
) -> None:
    """Step the schedulers at an epoch's end (scheduler_interval 'epoch'); ReduceLROnPlateau
    with the record's ``scheduler_monitor`` value, unless the epoch does not count for it
    (``counts``: an epoch without validation, for a ``val_`` key)."""
    if config.scheduler_interval != "epoch":
        return
    for scheduler in schedulers:
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            monitor = config.scheduler_monitor
            if not counts(monitor):
                continue
            if monitor not in record:
                raise ConfigError(
                    f"ReduceLROnPlateau monitors {monitor!r}, but the epoch record has only "
                    f"{sorted(record)}; set TrainerConfig(scheduler_monitor=...)."
                )
            scheduler.step(record[monitor])
        else:
            scheduler.step()


def required_positional(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` requires (1 for a builtin: the one-argument form)."""
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in kinds and p.default is inspect.Parameter.empty)


__all__ = [
    "check_schedulers",
    "check_the_schedule_length",
    "epoch_length",
    "estimated_steps",
    "per_step_for_a_run_length_factory",
    "required_positional",
    "step_per_epoch",
    "train_limit",
]
