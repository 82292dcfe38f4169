"""EpochPlan: one epoch's numbers, built once at its start (``Trainer._begin_epoch``, from the
before_epoch agreement that carries every rank's length) and handed to ``train_epoch``: the
batches it trains, the optimizer steps they make, when to validate inside it. Every rank gets
the same plan, or an error naming the ranks whose loaders differ."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from nn_handler.config.training import TrainerConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError, UnevenDataError
from nn_handler.training.limits import optimizer_steps_per_epoch, val_check_every, window
from nn_handler.training.schedules import epoch_length, train_limit


@dataclass(frozen=True)
class EpochPlan:
    """What epoch ``epoch`` (0-based) trains, the same on every rank."""

    epoch: int
    #: The batches the epoch trains (limit_train_batches or fast_dev_run applied; None: the
    #: loader has no len(), and the epoch ends with it).
    batches: int | None
    #: Whether a limit cuts the loader short (the loop stops reading it at ``batches``).
    cut: bool
    #: Validate after every this many batches inside the epoch (val_check_interval; None:
    #: at its end only).
    validate_every: int | None
    #: Micro-batches per optimizer step (accumulate_grad_batches).
    accumulate: int = 1

    def window(self, index: int) -> tuple[int, int]:
        """The accumulation window [start, end) of batch ``index`` (the optimizer steps after
        batch end - 1; the epoch's last window may be shorter)."""
        return window(index, self.accumulate, self.batches)

    def validates_after(self, index: int) -> bool:
        """Whether validation runs after batch ``index`` (not after the last: the epoch's
        own validation follows)."""
        every = self.validate_every
        return every is not None and (index + 1) % every == 0 and index + 1 != self.batches

    @property
    def steps(self) -> int | None:
        """The optimizer steps of the whole epoch (the last window may be shorter, and still
        steps); None when its length is unknown."""
        if self.batches is None:
            return None
        return optimizer_steps_per_epoch(self.batches, self.accumulate)


def plan_epoch(
    config: TrainerConfig,
    comm: Communicator,
    loader: Iterable[Any],
    val_loader: Iterable[Any] | None,
    epoch: int,
    lengths: list[int] | None = None,
) -> EpochPlan:
    """The plan of epoch ``epoch`` over ``loader``. ``lengths``: every rank's number of
    batches as an agreement already exchanged them (-1: no len()); None: exchanged here, in
    one tiny all_gather. Every rank must call this."""
    batches = epoch_length(config, loader)
    check_equal_lengths(comm, batches, lengths, epoch)
    if (epoch + 1) % config.check_val_every_n_epoch:  # an epoch that does not validate
        val_loader = None
    return EpochPlan(
        epoch=epoch,
        batches=batches,
        cut=batches is not None and train_limit(config) is not None,
        validate_every=validation_every(config, batches, val_loader),
        accumulate=config.accumulate_grad_batches,
    )


def check_equal_lengths(
    comm: Communicator, total: int | None, lengths: list[int] | None, epoch: int
) -> None:
    """Every rank must take the same number of steps (DDP's gradient all_reduce pairs the
    ranks' steps): ``lengths`` as an agreement exchanged them, or exchanged here."""
    if comm.world_size == 1:
        return
    if lengths is None:
        mine = -1 if total is None else total
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


__all__ = ["EpochPlan", "check_equal_lengths", "plan_epoch", "validation_every"]
