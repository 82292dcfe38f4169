"""Failure propagation around the training loop: an error on one rank becomes a stop on every
rank (see distributed/failure.py), never a hang until the process-group timeout."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from nn_handler.distributed.communicator import Communicator
from nn_handler.distributed.failure import fail_together
from nn_handler.errors import (
    CheckpointError,
    NonFiniteError,
    RankFailedError,
    TrainingPreempted,
    UnevenDataError,
)
from nn_handler.training.state import TrainerState

#: Errors every rank raises together (after agreeing), so the group needs no abort.
AGREED_ERRORS = (RankFailedError, NonFiniteError, CheckpointError, UnevenDataError)


@contextlib.contextmanager
def failing_together(
    comm: Communicator, state: TrainerState, release: Callable[[], None]
) -> Iterator[None]:
    """Around the loop: an error on this rank alone is told to every rank (which raise
    RankFailedError) before it propagates; ``release`` drops the model's wrappers first.
    Agreed errors and an agreed preemption pass through unchanged."""
    try:
        yield
    except AGREED_ERRORS:
        raise
    except TrainingPreempted:  # every rank agreed to stop: nothing to propagate
        raise
    except (Exception, SystemExit, KeyboardInterrupt) as error:
        if comm.world_size == 1:
            raise
        if not isinstance(error, Exception):  # this rank is leaving: say so, then leave
            fail_together(error, comm.rank, comm.world_size, "training", release)
            raise
        where = f"training (epoch {state.epoch + 1}, step {state.global_step})"
        failure = fail_together(error, comm.rank, comm.world_size, where, release)
        if failure is error:
            raise
        raise failure from error


__all__ = ["AGREED_ERRORS", "failing_together"]
