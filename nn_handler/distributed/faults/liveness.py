"""Which rank left the group, and how: for ranks started without an agent that stops the rest.

Under torchrun a dead worker makes the agent stop the others. Ranks started by hand, or by
srun without --kill-on-bad-exit, only see their next collective fail ("Connection closed by
peer"), which names no rank. So every rank records where it runs (host and pid) in the
process group's store when it joins, and a rank that leaves through Python (SystemExit,
KeyboardInterrupt) says so there. A survivor whose collective broke then looks: a departure
note names the rank and its exit; a peer process on this machine that no longer runs names
the rank that was killed (SIGKILL, the OOM killer, os._exit); a store that no longer answers
means the process that hosted it (rank 0, when ranks are started by hand) is gone.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from loguru import logger

_PREFIX = "nn_handler/liveness"


def default_store() -> Any:
    """The default group's store, or None (torch exposes it only privately)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter: Callable[[], Any] | None = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None:
        logger.debug("torch has no _get_default_store: rank failures cannot be published")
        return None
    try:
        return getter()
    except Exception as error:  # a group without a store (e.g. some MPI setups)
        logger.debug("the default group has no store ({}): failures cannot be published", error)
        return None


def register(rank: int) -> None:
    """Record this process (host and pid) as ``rank``; call once the group is initialised."""
    store = default_store()
    if store is None:
        return
    try:
        store.set(f"{_PREFIX}/where/{rank}", f"{socket.gethostname()} {os.getpid()}")
    except Exception as error:
        logger.debug("could not register rank {} in the store: {}", rank, error)


def note_departure(rank: int, how: str) -> None:
    """Say in the store that ``rank`` is leaving, and how (best effort)."""
    store = default_store()
    if store is None:
        return
    try:
        store.set(f"{_PREFIX}/left/{rank}", how)
    except Exception as error:
        logger.debug("could not note rank {}'s departure: {}", rank, error)


def describe_exit(error: BaseException) -> str:
    """How a process leaves through ``error`` (SystemExit, KeyboardInterrupt, ...)."""
    if isinstance(error, SystemExit):
        return f"it left through SystemExit (exit status {error.code!r})"
    if isinstance(error, KeyboardInterrupt):
        return "it left through KeyboardInterrupt (Ctrl-C, SIGINT)"
    return f"it left through {type(error).__name__}: {error}"


def departed(world_size: int, rank: int) -> dict[int, str]:
    """The ranks other than ``rank`` known to have left, each with how it left; empty when
    none is known to have (ranks on other machines cannot be checked without a note)."""
    store = default_store()
    if store is None:
        return {}
    found: dict[int, str] = {}
    host = socket.gethostname()
    for peer in range(world_size):
        if peer == rank:
            continue
        try:
            if store.check([f"{_PREFIX}/left/{peer}"]):
                found[peer] = store.get(f"{_PREFIX}/left/{peer}").decode(errors="replace")
                continue
            if not store.check([f"{_PREFIX}/where/{peer}"]):
                continue
            where = store.get(f"{_PREFIX}/where/{peer}").decode(errors="replace")
        except Exception:
            return {0: "the process group's store no longer answers: the process that hosted it "
                    "(rank 0, when ranks are started by hand or by srun) is gone"}  # fmt: skip
        peer_host, _, pid = where.rpartition(" ")
        if peer_host == host and pid.isdigit() and not process_running(int(pid)):
            found[peer] = (
                f"its process (pid {pid} on {host}) is gone without a word: killed by a "
                f"signal (SIGKILL, the out-of-memory killer) or ended by os._exit"
            )
    return found


#: Seconds a rank whose connection to a peer broke watches for that peer's departure (a
#: killed process closes its sockets a moment before it is gone from the process table).
LEAVE_WAIT_S = 3.0
_PEER_LOSS = ("closed by peer", "reset by peer", "broken pipe", "read error", "socket closed")


def departures_after(error: BaseException, world_size: int, rank: int) -> dict[int, str]:
    """The peers known to have left, as ``departed``; after an error that says a connection
    to a peer was lost, watched for up to LEAVE_WAIT_S seconds."""
    lost = any(phrase in str(error).lower() for phrase in _PEER_LOSS)
    deadline = time.monotonic() + (LEAVE_WAIT_S if lost else 0.0)
    while True:
        gone = departed(world_size, rank)
        if gone or time.monotonic() >= deadline:
            return gone
        time.sleep(0.05)


def process_running(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (a zombie does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie has exited; only its parent has not collected it yet
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return True


__all__ = [
    "process_running",
    "LEAVE_WAIT_S",
    "default_store",
    "departed",
    "departures_after",
    "describe_exit",
    "note_departure",
    "register",
]
