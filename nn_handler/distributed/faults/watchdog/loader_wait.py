"""Which DataLoader worker a rank waits for: a rank stuck in ``next(loader)`` shows only the
loader's queue in its stack, while the code at fault runs in a worker process. When the
training thread waits inside a multi-process DataLoader iterator, the iterator knows which
batch it waits for and which worker owes it; the stall report says so."""

from __future__ import annotations

import os
from types import FrameType
from typing import Any

_DATALOADER = os.path.join("utils", "data", "dataloader.py")


def late_batch(frame: FrameType | None) -> str | None:
    """When the thread whose innermost frame is ``frame`` waits for a batch from DataLoader
    worker processes, which worker owes it (``waiting for batch 3 of its DataLoader from
    worker 0 (pid 4242), ...``); None otherwise. Reads the iterator's state from another
    thread without changing it."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_next_data" and code.co_filename.endswith(_DATALOADER):
            found = _owed(frame.f_locals.get("self"))
            if found is not None:
                return found
        frame = frame.f_back
    return None


def _owed(iterator: Any) -> str | None:
    index = getattr(iterator, "_rcvd_idx", None)
    tasks = getattr(iterator, "_task_info", None)
    workers = getattr(iterator, "_workers", None)
    if not isinstance(index, int) or not isinstance(tasks, dict) or not workers:
        return None
    task = tasks.get(index)
    if not isinstance(task, tuple) or len(task) != 1:  # (worker,) until its data arrives
        return None
    worker = int(task[0])
    process = workers[worker]
    state = "" if process.is_alive() else f", exited with status {process.exitcode}"
    return (
        f"waiting for batch {index} of its DataLoader from worker {worker} (pid "
        f"{process.pid}{state}): that worker is stuck or slow in the dataset's __getitem__ or "
        f"the collate_fn"
    )


__all__ = ["late_batch"]
