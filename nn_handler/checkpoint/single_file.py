"""FileWriter: a checkpoint as one file, written by rank 0 into its staging path (within a
budget, when given); the save route (checkpoint/saving.py) has its store commit it. The writer
knows nothing of where the file goes after."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from loguru import logger

from nn_handler.checkpoint.io import unsafe_entries, write_file
from nn_handler.checkpoint.writing import WriteJob, Written
from nn_handler.distributed.communicator import Communicator

#: Seconds a cancelled save gets to stop and remove its temporary file.
CANCEL_GRACE_S = 10.0


class FileWriter:
    """Rank 0 writes the whole checkpoint (``contents``, used on rank 0 only) as one file;
    the other ranks write nothing."""

    folder = False

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm

    def begin(self, job: WriteJob) -> Callable[[], Written]:
        """The write, run at once by the route (rank 0's live state is written: never in
        the background); past ``job.budget_s`` it is cancelled (the file does not appear)."""

        def write() -> Written:
            if self.comm.rank != 0:
                return Written()
            error = job.refusal or _write_on_main(
                job.contents, job.where, job.staging, job.budget_s
            )
            return Written([job.staging], error=error)

        return write


def _write_on_main(
    checkpoint: Mapping[str, Any] | None, target: str, staging: Path, budget_s: float | None
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
    staging.parent.mkdir(parents=True, exist_ok=True)
    if budget_s is None:
        try:
            write_file(dict(checkpoint), staging, name=target)
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None
    outcome: list[str | None] = []
    cancel = threading.Event()

    def save() -> None:
        try:
            write_file(dict(checkpoint), staging, cancel, name=target)
            outcome.append(None)
        except Exception as error:
            outcome.append(f"{type(error).__name__}: {error}")

    # Past the budget the writer is cancelled: it stops at its next write (at most a few MB
    # later) and removes its staging file, which is never committed. It is joined before
    # this returns, so no thread is left inside torch.save when the process exits (a thread
    # still in torch's C++ writer at exit aborts the process with SIGABRT, status 134).
    writer = threading.Thread(target=save, name="nn_handler-checkpoint", daemon=True)
    writer.start()
    writer.join(budget_s)
    if writer.is_alive():
        cancel.set()
        writer.join(CANCEL_GRACE_S)
        if outcome and outcome[0] is None:  # it finished just before the cancel landed
            return None
        if writer.is_alive():
            logger.warning(
                "the save to {} did not stop within {} s of its cancellation (a blocked write?)",
                target,
                CANCEL_GRACE_S,
            )
        return f"the save did not finish within its budget of {budget_s:g} s (abandoned)"
    return outcome[0] if outcome else "the save thread ended without a result"


__all__ = ["CANCEL_GRACE_S", "FileWriter"]
