"""One live job per checkpoint folder: ``<dir>/.nn_handler.lock``.

Rank 0 takes the lock when its CheckpointManager starts and releases it when the handler
closes. The lock names its holder (host, pid, the launcher's job id). A lock is stale, and
taken over with a warning, when its process is gone from this host, or when it was taken on
another host by an earlier incarnation of this same job (a torchrun restart or a SLURM
requeue, which carry the job's id); a live process on this host always holds it (two srun
steps of one allocation share SLURM_JOB_ID); any other holder makes the start fail, naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loguru import logger

from nn_handler.distributed.faults.liveness import process_running
from nn_handler.errors import CheckpointError

LOCK = ".nn_handler.lock"
#: The launchers' ids of a job, which its restarts keep.
_JOB_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")


def job_of(env: Mapping[str, str]) -> str | None:
    """The launcher's id of this job (which its restarts keep), as ``NAME=value``."""
    for name in _JOB_VARIABLES:
        value = env.get(name, "").strip()
        if value and value != "none":
            return f"{name}={value}"
    return None


def _me(env: Mapping[str, str]) -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "job": job_of(env),
        "time": time.time(),
    }


def acquire(folder: Path, env: Mapping[str, str]) -> None:
    """Take ``folder``'s lock for this process (rank 0), taking over a stale one; raises
    CheckpointError naming the holder when another live job holds it."""
    path = folder / LOCK
    mine = _me(env)
    for _ in range(3):  # another starter may take or drop it between our looks
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _read(path)
            if holder is None or _stale(holder, mine):
                if holder is not None and holder.get("pid") != mine["pid"]:
                    logger.bind(rank=0).warning(
                        "{}: taking over the lock of {} (pid {} on {}): {}",
                        folder, holder.get("job") or "a job", holder.get("pid"),
                        holder.get("host"), why_stale(holder, mine),
                    )  # fmt: skip
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                continue
            raise CheckpointError(
                f"checkpoint folder {folder} is in use by another live job: "
                f"{holder.get('job') or 'a job'} (pid {holder.get('pid')} on "
                f"{holder.get('host')}, since {time.ctime(float(holder.get('time', 0)))}). Two "
                f"runs in one folder would rotate and resume each other's checkpoints: use "
                f"another checkpoint.dir, or stop that job (delete {path} if it is gone)."
            ) from None
        with os.fdopen(fd, "w") as handle:
            json.dump(mine, handle)
        return
    raise CheckpointError(f"could not take the lock {path}: it keeps changing hands.")


def release(folder: Path) -> None:
    """Drop ``folder``'s lock if this process holds it (best effort)."""
    path = folder / LOCK
    holder = _read(path)
    if (
        holder is not None
        and holder.get("pid") == os.getpid()
        and holder.get("host") == socket.gethostname()
    ):
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _read(path: Path) -> dict[str, Any] | None:
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}  # torn or foreign: treated as stale (see _stale)
    return found if isinstance(found, dict) else {}


def _stale(holder: Mapping[str, Any], mine: Mapping[str, Any]) -> bool:
    return why_stale(holder, mine) != ""


def why_stale(holder: Mapping[str, Any], mine: Mapping[str, Any]) -> str:
    """Why the holder no longer holds the folder ('' when it does)."""
    pid = holder.get("pid")
    if not isinstance(pid, int):
        return "the lock file is unreadable"
    if holder.get("host") == mine["host"]:
        if pid == mine["pid"]:
            return "it is this process"
        if not process_running(pid):
            return "its process is gone"
        # A live process on this host is a live job, whatever ids it shares with this one
        # (two srun steps of one allocation, a reused --rdzv-id): never a restart.
        return ""
    if holder.get("job") and holder.get("job") == mine["job"]:
        return "it is an earlier start of this same job (a restart)"
    return ""


__all__ = ["LOCK", "acquire", "job_of", "release", "why_stale"]
