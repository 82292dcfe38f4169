"""The pieces of a training epoch that are not the loop itself (``Trainer.train_epoch``): where
a resumed epoch starts, mid-epoch validation and the epoch's record and log line (its numbers:
epoch_plan.py). Functions of what they are given; none reads the Trainer."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from nn_handler.checkpoint.rng import restore_rng
from nn_handler.config.training import TrainerConfig
from nn_handler.data.fixed_batches import FixedBatchLoader
from nn_handler.data.reshard import rest_of_epoch
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.training.epoch_plan import EpochPlan
from nn_handler.training.history import Record
from nn_handler.training.metrics import MetricKeys, RunningLoss
from nn_handler.training.position import ResumePoint
from nn_handler.training.state import TrainerState
from nn_handler.training.validation_sets import ValidationSets, named


def epoch_batches(
    loader: Iterable[Any],
    point: ResumePoint | None,
    running: RunningLoss,
    plan: EpochPlan,
    state: TrainerState,
    comm: Communicator,
    device: torch.device,
) -> tuple[Iterator[Any], int]:
    """The epoch's batch iterator and the index of its first batch (cut at the plan's batches
    when a limit cuts the loader short); see ``resumed_batches``."""
    batches, first = resumed_batches(loader, point, running, plan.batches, state, comm, device)
    if plan.batches is not None and plan.cut:
        batches = itertools.islice(batches, max(plan.batches - first, 0))
    return batches, first


def resumed_batches(
    loader: Iterable[Any],
    point: ResumePoint | None,
    running: RunningLoss,
    total: int | None,
    state: TrainerState,
    comm: Communicator,
    device: torch.device,
) -> tuple[Iterator[Any], int]:
    """The epoch's batch iterator and the index of its first batch. After a mid-epoch resume
    (``point``) the batches already trained are read and discarded (so the data order and the
    RNG streams continue exactly) and the partial loss and RNG state restored; a position
    written by another number of ranks continues with the epoch's unvisited samples
    re-sharded over this run's ranks (data/reshard.py)."""
    if isinstance(loader, FixedBatchLoader):  # fixed steps at any world size: start there
        done = point.batches_done if point is not None else 0
        loader.start_at(done)
        if point is not None and done:
            if point.running is not None:
                running.load_state_dict(point.running, device)
            state.skipped_steps = point.skipped_steps
        return iter(loader), done
    if point is not None and point.batches_done and point.saved_world is not None:
        rest = rest_of_epoch(
            loader,
            saved_world=int(point.saved_world or 1),
            saved_batch_size=int(point.data.get("batch_size") or 0),
            batches_done=point.batches_done,
            rank=comm.rank,
            world_size=comm.world_size,
        )
        state.skipped_steps = point.skipped_steps
        return iter(rest), max((total or len(rest)) - len(rest), 0)
    iterator = iter(loader)
    if point is None or not point.batches_done:
        return iterator, 0
    for done in range(point.batches_done):
        try:
            next(iterator)
        except StopIteration:
            raise CheckpointError(
                f"the checkpoint stopped after batch {point.batches_done} of epoch "
                f"{state.epoch + 1}, but the loader ended after {done} batches; resume with the "
                f"same data and batch size."
            ) from None
    if point.running is not None:
        running.load_state_dict(point.running, device)
    state.skipped_steps = point.skipped_steps
    if point.step_rng is not None:
        restore_rng(point.step_rng)
    return iterator, point.batches_done


def epoch_record(
    running: RunningLoss,
    comm: Communicator,
    device: torch.device,
    keys: MetricKeys,
    started: float,
    skipped_steps: int,
    manual: bool = False,
) -> Record:
    """The epoch's train loss and extra scalars (reduced over ranks: one all_reduce),
    samples per second, time and skipped steps. ``manual``: a manual training_step that
    returned no "loss" has none."""
    loss_value, samples, extras = running.compute(comm, device, keys)
    elapsed = time.perf_counter() - started
    record = {
        "train_loss": loss_value,
        "samples_per_sec": samples / elapsed if elapsed > 0 else 0.0,
        "epoch_time": elapsed,
        "skipped_steps": float(skipped_steps),
    }
    record.update({f"train_{key}": value for key, value in extras.items()})
    if manual and math.isnan(loss_value):
        del record["train_loss"]
    return record


def validate_mid_epoch(
    evaluate: Callable[[Any], dict[str, float]],
    val_loader: Any,
    state: TrainerState,
    log: Any,
    total: int | None,
) -> None:
    """Validation inside the epoch (val_check_interval) of every set, before this step's
    checkpoint (whose RNG state then includes it, so a resume continues exactly)."""
    started = time.perf_counter()
    sets = ValidationSets.of(val_loader)
    metrics, _ = sets.validate(lambda loader, name: (named(evaluate(loader), name), None))
    state.validation_seconds += time.perf_counter() - started
    log.info(
        "validation at step {} (epoch {}, batch {}/{}): {}",
        state.global_step,
        state.epoch + 1,
        state.batch_index + 1,
        total if total is not None else "?",
        summary(metrics),
    )


def epochs_of_fit(config: TrainerConfig, state: TrainerState, epochs: int | None, log: Any) -> int:
    """The epochs ``fit(..., epochs)`` trains to in total: ``epochs``, else config.epochs
    (said in one line when that is the default: a new user's script trains less than meant
    without a word otherwise); one more in a fast_dev_run."""
    if epochs is None and "epochs" not in config.model_fields_set and not config.fast_dev_run:
        log.info(
            "no epochs given: training {} epoch (trainer.epochs' default); pass "
            "train(..., epochs=N) or set trainer.epochs",
            config.epochs,
        )
    epochs = epochs if epochs is not None else config.epochs
    if epochs < 1:
        raise ConfigError(f"epochs must be at least 1, got {epochs}.")
    return state.epoch + 1 if config.fast_dev_run else epochs


def summary(record: Record) -> str:
    """An epoch record as ``key=value`` pairs (``*_pct`` keys as percentages)."""
    shown = {k: v for k, v in record.items() if k != "epoch" and (k != "skipped_steps" or v)}
    return ", ".join(
        f"{k[:-4]}={v:.0f}%" if k.endswith("_pct") else f"{k}={v:.4g}" for k, v in shown.items()
    )


__all__ = [
    "epochs_of_fit",
    "epoch_batches",
    "epoch_record",
    "summary",
    "validate_mid_epoch",
]
