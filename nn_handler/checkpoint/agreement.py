"""Agreeing on a checkpoint operation's outcome: every rank raises the same error."""

from __future__ import annotations

from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError


def agree_on(comm: Communicator, error: str | BaseException | None, what: str) -> None:
    """Raise the same CheckpointError on every rank if ``what`` failed on any (``error`` is this
    rank's failure, or None). Every rank must call this."""
    text = None if error is None else str(error) if isinstance(error, str) else _text(error)
    texts = comm.all_gather_object(text) if comm.world_size > 1 else [text]
    failed = {rank: t for rank, t in enumerate(texts) if t is not None}
    if not failed:
        return
    if isinstance(error, CheckpointError) and comm.world_size == 1:
        raise error
    details = "; ".join(f"rank {rank}: {t}" for rank, t in failed.items())
    cause = error if isinstance(error, BaseException) else None
    raise CheckpointError(f"{what} failed on rank(s) {list(failed)}: {details}") from cause


def _text(error: BaseException) -> str:
    return str(error) if isinstance(error, CheckpointError) else f"{type(error).__name__}: {error}"


__all__ = ["agree_on"]
