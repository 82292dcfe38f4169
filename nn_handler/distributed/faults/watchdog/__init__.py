"""The stall watchdog: every collective of the default group is numbered and recorded; a rank
that waits too long, or ranks that issue different collectives under one number, make every
rank raise one report (CollectiveStallError / CollectiveMismatchError) instead of hanging.

The watchdog of this process's default group is the one other piece of per-process state
nn_handler keeps, in the explicit registry ``WATCHDOGS`` that DistributedContext sets on setup
and clears on teardown.
"""

from __future__ import annotations

import json
import weakref
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from loguru import logger

from nn_handler.distributed.faults.liveness import default_store, departures_after
from nn_handler.distributed.faults.watchdog.ledger import CollectiveLedger
from nn_handler.distributed.faults.watchdog.records import describe
from nn_handler.distributed.faults.watchdog.stall_watchdog import (
    BLOCKED_EXIT_CODE,
    PREFIX,
    StallWatchdog,
    WatchdogTiming,
    incident_from,
)
from nn_handler.errors import RankFailedError


class WatchdogRegistry:
    """The running watchdog of the default process group, if any."""

    def __init__(self) -> None:
        self._watchdog: StallWatchdog | None = None
        # A weak reference: holding the group itself would keep its connections open after
        # destroy_process_group, so peers blocked on this rank would never see it leave.
        self._group: weakref.ref[Any] | None = None

    def ledger(self) -> CollectiveLedger | None:
        watchdog = self.watchdog()
        return None if watchdog is None else watchdog.ledger

    def watchdog(self) -> StallWatchdog | None:
        """The running watchdog; None (and the stale one stopped) once the group it watched
        was destroyed, even by ``torch.distributed.destroy_process_group`` directly."""
        group = None if self._group is None else self._group()
        if self._watchdog is not None and (group is None or _default_group() is not group):
            self.stop()
        return self._watchdog

    def start(
        self,
        rank: int,
        world_size: int,
        stall_timeout: timedelta,
        launcher_pid: int | None = None,
    ) -> bool:
        """Start watching the default group (idempotent); False when it has no store.
        ``launcher_pid``: the launcher that must outlive this worker (torchrun's agent)."""
        if self.watchdog() is not None or world_size < 2:
            return self._watchdog is not None
        store = default_store()
        if store is None:
            logger.debug("the default group has no store: no stall watchdog")
            return False
        timing = WatchdogTiming.for_timeout(stall_timeout.total_seconds())
        generation = store.add(f"{PREFIX}/started/{rank}", 1)
        prefix = f"{PREFIX}/{generation}"
        self._watchdog = StallWatchdog(
            CollectiveLedger(rank), store, world_size, timing, prefix, launcher_pid=launcher_pid
        )
        group = _default_group()
        self._group = None if group is None else weakref.ref(group)
        self._watchdog.start()
        return True

    def stop(self) -> None:
        watchdog, self._watchdog, self._group = self._watchdog, None, None
        if watchdog is not None:
            watchdog.stop()

    def finish(self) -> BaseException | None:
        """Stop watching the group with one last comparison of every rank's collectives
        (``StallWatchdog.finish``); the incident this rank must raise, or None. Every rank
        must call it before the group is destroyed."""
        watchdog = self.watchdog()
        self._watchdog, self._group = None, None
        return None if watchdog is None else watchdog.finish()

    def incident(self) -> BaseException | None:
        """The stall or mismatch reported in this group, if any (or this worker's
        LauncherGoneError when its launcher is gone, looked at now): this rank's copy, or the
        store's report when this rank's watchdog has not read it yet. Marks it raised."""
        watchdog = self._watchdog  # kept after the group is destroyed: the report outlives it
        if watchdog is None:
            return None
        ledger = watchdog.ledger
        if ledger.incident is None and ledger.launcher_check is not None:
            # An orphan's own reason first: torchrun's agent killed takes the store with it,
            # and a rank that meets the dead store before its watchdog's next look would
            # otherwise blame the store's host (seen under load).
            ledger.launcher_check()
        if ledger.incident is None:
            ledger.incident = _read_report(watchdog.store, watchdog.prefix)
        if ledger.incident is not None:
            ledger.incident_raised = True
        return ledger.incident

    def vanished(self, error: BaseException) -> RankFailedError | None:
        """When ``error`` (a backend error in a collective) came from peers that left the
        group, a RankFailedError naming them, how they left and their last published
        collective; None otherwise."""
        watchdog = self._watchdog
        if watchdog is None:
            return None
        rank, world_size = watchdog.ledger.rank, watchdog.world_size
        gone = departures_after(error, world_size, rank)
        if not gone:
            return None
        texts = {peer: f"{how}; {watchdog.last_published(peer)}" for peer, how in gone.items()}
        mine, _ = watchdog.ledger.snapshot()
        return RankFailedError(
            describe(mine.latest),
            texts,
            note=f"rank {rank} stopped because of it. {VANISHED_HINT}",
        )


#: What a rank that vanished inside a collective most often means.
VANISHED_HINT = (
    "A process that dies inside a collective was often aborted by it: gloo aborts a rank "
    "whose collective receives more bytes than it expects (different shapes or dtypes on "
    "different ranks; its output says 'Received data size doesn't match'), nccl on an "
    "illegal memory access; or it was killed (the out-of-memory killer, a scheduler)."
)


def _default_group() -> Any:
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _read_report(store: Any, prefix: str) -> BaseException | None:
    try:
        if not store.check([f"{prefix}/report"]):
            return None
        payload = json.loads(store.get(f"{prefix}/report"))
    except Exception:  # the store went away with its host
        return None
    return incident_from(payload)


#: The process-wide registry of the default group's watchdog.
WATCHDOGS = WatchdogRegistry()

__all__ = [
    "BLOCKED_EXIT_CODE",
    "VANISHED_HINT",
    "WATCHDOGS",
    "CollectiveLedger",
    "StallWatchdog",
    "WatchdogRegistry",
    "WatchdogTiming",
]
