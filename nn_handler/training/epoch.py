"""The pieces of a training epoch that are not the loop itself (``Trainer.train_epoch``): the
agreed number of batches, where a resumed epoch starts, mid-epoch validation and the epoch's
log line. Functions of what they are given; none reads the Trainer."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from nn_handler.checkpoint.rng import restore_rng
from nn_handler.config.training import TrainerConfig
from nn_handler.data.fixed_batches import FixedBatchLoader
from nn_handler.data.reshard import rest_of_epoch
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError, ConfigError, UnevenDataError
from nn_handler.training.history import Record
from nn_handler.training.limits import val_check_every
from nn_handler.training.metrics import MetricKeys, RunningLoss
from nn_handler.training.position import ResumePoint
from nn_handler.training.state import TrainerState


def check_equal_lengths(
    comm: Communicator,
    total: int | None,
    agreed: tuple[int, list[int]] | None,
    loader: Iterable[Any],
    epoch: int,
) -> None:
    """Every rank must take the same number of steps (DDP's gradient all_reduce pairs the
    ranks' steps): the loaders' lengths as ``fit`` exchanged them with the before_epoch
    agreement (``agreed``: the loader's id and every rank's length), or here in one tiny
    all_gather when ``train_epoch`` is called alone."""
    if comm.world_size == 1:
        return
    mine = -1 if total is None else total
    # The same loader fit passed (the same decision on every rank): already exchanged.
    if agreed is not None and agreed[0] == id(loader):
        lengths = agreed[1]
    else:
        shared = comm.raise_if_any_failed(None, "comparing the loaders' lengths", [mine])
        lengths = [row[0] for row in shared]
    if len(set(lengths)) == 1:
        return
    described = ", ".join(
        f"rank {rank}: {'no len()' if n < 0 else n}" for rank, n in enumerate(lengths)
    )
    raise UnevenDataError(
        f"the training loaders have different numbers of batches per rank ({described}) in "
        f"epoch {epoch + 1}; every rank must take the same number of optimizer steps. Pass the "
        f"dataset instead of a DataLoader (the LoaderFactory gives every rank equal batches) or "
        f"use a DistributedSampler over the whole dataset."
    )


def validation_every(
    config: TrainerConfig, total: int | None, val_loader: Iterable[Any] | None
) -> int | None:
    """Validate inside the epoch after every this many batches (val_check_interval); also
    checks that accumulation has the epoch's length it needs."""
    if config.accumulate_grad_batches > 1 and total is None:
        raise ConfigError(
            "gradient accumulation needs a loader with len() (to close the last window of "
            "an epoch on every rank alike); set accumulate_grad_batches=1 or pass a sized "
            "loader."
        )
    interval = config.val_check_interval
    if interval is None or val_loader is None:
        return None
    try:
        return val_check_every(total, interval, config.accumulate_grad_batches)
    except ValueError:
        raise ConfigError(
            f"val_check_interval={interval} is a fraction of the epoch, and the training "
            f"loader has no len(); pass an int number of batches instead."
        ) from None


def epoch_batches(
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
) -> Record:
    """The epoch's train loss and extra scalars (reduced over ranks: one all_reduce),
    samples per second, time and skipped steps."""
    loss_value, samples, extras = running.compute(comm, device, keys)
    elapsed = time.perf_counter() - started
    record = {
        "train_loss": loss_value,
        "samples_per_sec": samples / elapsed if elapsed > 0 else 0.0,
        "epoch_time": elapsed,
        "skipped_steps": float(skipped_steps),
    }
    record.update({f"train_{key}": value for key, value in extras.items()})
    return record


def validate_mid_epoch(
    evaluate: Callable[[Any], dict[str, float]],
    val_loader: Any,
    state: TrainerState,
    log: Any,
    total: int | None,
) -> None:
    """Validation inside the epoch (val_check_interval), before this step's checkpoint
    (whose RNG state then includes it, so a resume continues exactly)."""
    started = time.perf_counter()
    metrics = evaluate(val_loader)
    state.validation_seconds += time.perf_counter() - started
    log.info(
        "validation at step {} (epoch {}, batch {}/{}): {}",
        state.global_step,
        state.epoch + 1,
        state.batch_index + 1,
        total if total is not None else "?",
        summary({f"val_{k}": v for k, v in metrics.items()}),
    )


def default_epochs_note(config: TrainerConfig) -> str | None:
    """What ``fit`` says when no ``epochs`` was given nor configured (one epoch, the
    default: a new user's script trains less than meant without a word otherwise)."""
    if "epochs" in config.model_fields_set or config.fast_dev_run:
        return None
    return (
        f"no epochs given: training {config.epochs} epoch (trainer.epochs' default); pass "
        f"train(..., epochs=N) or set trainer.epochs"
    )


def summary(record: Record) -> str:
    """An epoch record as ``key=value`` pairs (``*_pct`` keys as percentages)."""
    shown = {k: v for k, v in record.items() if k != "epoch" and (k != "skipped_steps" or v)}
    return ", ".join(
        f"{k[:-4]}={v:.0f}%" if k.endswith("_pct") else f"{k}={v:.4g}" for k, v in shown.items()
    )


__all__ = [
    "check_equal_lengths",
    "default_epochs_note",
    "epoch_batches",
    "epoch_record",
    "summary",
    "validate_mid_epoch",
    "validation_every",
]
