"""What went wrong in a DCP save or load, said in one line per failed rank (a full disk named
as such, with the space needed and free)."""

from __future__ import annotations

import errno
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from nn_handler.checkpoint.io import write_failure
from nn_handler.errors import CheckpointError


class SaveRefused(CheckpointError):
    """A rank's part of a save refused before it began; its text is the cause, with its type."""


def dcp_errors() -> tuple[type[BaseException], ...]:
    """What DCP raises: its CheckpointException is a BaseException, not an Exception."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def failure_text(error: BaseException) -> str:
    """One line per failed rank of a DCP error (DCP wraps every rank's exception and its
    traceback in one CheckpointException); the error's own text otherwise."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, Mapping):
        return f"{type(error).__name__}: {error}"
    lines = []
    for rank, wrapped in sorted(failures.items()):
        cause = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        said = str(cause) if isinstance(cause, SaveRefused) else f"{type(cause).__name__}: {cause}"
        lines.append(f"rank {rank}: {said}")
    return "; ".join(lines)


def save_failure(error: BaseException, target: str, staging: Path, shards: Any) -> str:
    """What went wrong in DCP's save of the checkpoint ``target`` into ``staging``: a full
    disk (torch reports it as 'unexpected pos N vs M') is named as such with the space needed
    and free."""
    text = failure_text(error)
    causes = [error, *causes_of(error)]
    full = any(isinstance(c, OSError) and c.errno == errno.ENOSPC for c in causes)
    if full or "unexpected pos" in text or "No space left" in text:
        local = _local_tensors(shards)
        described = write_failure(target, staging, OSError(errno.ENOSPC, "no space"), local)
        if "no space left" in described:
            return described.replace("the checkpoint needs", "this rank's shards need")
    return text


def causes_of(error: BaseException) -> list[BaseException]:
    failures = getattr(error, "failures", None)
    if not isinstance(failures, Mapping):
        return []
    found = []
    for wrapped in failures.values():
        cause = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
        if isinstance(cause, BaseException):
            found.append(cause)
    return found


def _local_tensors(value: Any) -> Any:
    """``value`` with every DTensor replaced by its local shard (what this rank writes)."""
    if isinstance(value, Mapping):
        return {k: _local_tensors(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_local_tensors(v) for v in value]
    if isinstance(value, torch.Tensor) and hasattr(value, "to_local"):
        return value.to_local()
    return value


__all__ = ["SaveRefused", "causes_of", "dcp_errors", "failure_text", "save_failure"]
