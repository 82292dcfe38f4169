"""Agreeing on a checkpoint operation's outcome: every rank raises the same CheckpointError.

The agreement is ``Communicator.raise_if_any_failed`` (the one mechanism for "every rank
raises the same error"); this adapter makes its error a CheckpointError (resume falls back on
one) whose message is each failed rank's one-line cause."""

from __future__ import annotations

from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError, RankFailedError

_PREFIX = f"{CheckpointError.__module__}.{CheckpointError.__qualname__}: "


def agree_on(comm: Communicator, error: str | BaseException | None, what: str) -> None:
    """Raise the same CheckpointError on every rank if ``what`` failed on any (``error`` is this
    rank's failure, or None). Every rank must call this."""
    text = None if error is None else error if isinstance(error, str) else _text(error)
    # Never raised, so only its text travels (no traceback): the cause as one line.
    cause = None if text is None else CheckpointError(text)
    try:
        comm.raise_if_any_failed(cause, what)
    except RankFailedError as failed:
        said = {r: m.strip().removeprefix(_PREFIX) for r, m in failed.rank_messages.items()}
        raised = error if isinstance(error, BaseException) else None
        if len(said) == comm.world_size and len(set(said.values())) == 1:  # one error everywhere
            raise CheckpointError(f"{what} failed: {said[0]}") from raised  # (DCP's: it names)
        details = "; ".join(f"rank {rank}: {message}" for rank, message in said.items())
        raise CheckpointError(f"{what} failed on rank(s) {failed.failed_ranks}: {details}") from (
            raised
        )
    except CheckpointError:  # one process: raise_if_any_failed gave back this rank's own
        if isinstance(error, CheckpointError):
            raise error from error.__cause__
        raised = error if isinstance(error, BaseException) else None
        own = text if str(text).startswith("rank 0: ") else f"rank 0: {text}"  # (DCP's say)
        raise CheckpointError(f"{what} failed on rank(s) [0]: {own}") from raised


def _text(error: BaseException) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


__all__ = ["agree_on"]
