"""Writing one checkpoint file: rank 0 writes it atomically (within a budget, when given) and
every rank learns the outcome, so no rank trains on believing a checkpoint exists."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loguru import logger

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.io import atomic_save, unsafe_entries
from nn_handler.distributed.communicator import Communicator

#: Seconds a cancelled save gets to stop and remove its temporary file.
CANCEL_GRACE_S = 10.0


def write_together(
    comm: Communicator,
    checkpoint: Mapping[str, Any] | None,
    path: str | Path,
    budget_s: float | None = None,
) -> Path:
    """Rank 0 writes ``checkpoint`` atomically to ``path``; every rank must call this and
    returns once the file is complete, or raises the same CheckpointError."""
    target = Path(path)
    error = _write_on_main(checkpoint, target, budget_s) if comm.rank == 0 else None
    with comm.patient():  # the others wait while rank 0 writes (minutes for a large model)
        agree_on(comm, error, f"writing checkpoint {target}")
    return target


def _write_on_main(
    checkpoint: Mapping[str, Any] | None, target: Path, budget_s: float | None
) -> str | None:
    if checkpoint is None:
        return "no checkpoint contents were given on rank 0"
    unsafe = unsafe_entries(checkpoint)
    if unsafe:
        logger.warning(
            "checkpoint {} holds values that weights-only loading refuses: {}; loading it will "
            "need trusted=[...] (torch.serialization.add_safe_globals)",
            target,
            ", ".join(unsafe[:5]),
        )
    if budget_s is None:
        try:
            atomic_save(dict(checkpoint), target)
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None
    outcome: list[str | None] = []
    cancel = threading.Event()

    def save() -> None:
        try:
            atomic_save(dict(checkpoint), target, cancel)
            outcome.append(None)
        except Exception as error:
            outcome.append(f"{type(error).__name__}: {error}")

    # Past the budget the writer is cancelled: it stops at its next write (at most a few MB
    # later), removes its temporary file and never commits the target. It is joined before
    # this returns, so no thread is left inside torch.save when the process exits (a thread
    # still in torch's C++ writer at exit aborts the process with SIGABRT, status 134).
    writer = threading.Thread(target=save, name="nn_handler-checkpoint", daemon=True)
    writer.start()
    writer.join(budget_s)
    if writer.is_alive():
        cancel.set()
        writer.join(CANCEL_GRACE_S)
        if outcome and outcome[0] is None:  # it committed just before the cancel landed
            return None
        if writer.is_alive():
            logger.warning(
                "the save to {} did not stop within {} s of its cancellation (a blocked write?)",
                target,
                CANCEL_GRACE_S,
            )
        return f"the save did not finish within its budget of {budget_s:g} s (abandoned)"
    return outcome[0] if outcome else "the save thread ended without a result"


__all__ = ["CANCEL_GRACE_S", "write_together"]
