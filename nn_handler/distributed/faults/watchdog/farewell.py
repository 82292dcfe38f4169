"""The watchdog's last look at teardown (``StallWatchdog.finish``).

The watchdog thread compares records every interval, so collectives issued in a process's last
second or two (a dtype mismatch that gloo passes silently, say) could end without a report, and
a rank that skipped a collective could leave while another waits in it (``handler.save()``
under ``if rank == 0``). At teardown every rank publishes its final records and a ``done`` key,
waits a bounded time (``FINISH_WAIT_S``) for the others, and compares its records with every
rank's: a difference, or a rank still waiting in a collective this one never issued, opens an
incident whose report every rank raises. Once there is a report, a rank leaves only after every
rank has read it (bounded), since rank 0 often hosts the store; without one, rank 0 waits for
the others to finish comparing.

Store keys under the watchdog's prefix: ``done/R`` (rank R reached teardown), ``read/R`` (rank R
has the report), ``checked/R`` (rank R compared and found nothing).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Protocol

from nn_handler.distributed.faults.liveness import departed
from nn_handler.distributed.faults.watchdog.ledger import CollectiveLedger
from nn_handler.distributed.faults.watchdog.records import RankState, find_mismatch


class StallWatchdog(Protocol):
    """What the last look needs of the watchdog (distributed/faults/watchdog/stall_watchdog.py)."""

    store: Any
    prefix: str
    world_size: int
    ledger: CollectiveLedger

    @property
    def timing(self) -> Any: ...

    def open_incident(self, kind: str, seq: int) -> None: ...

    def answer(self) -> RankState: ...

    def act(self, payload: dict[str, Any]) -> None: ...


#: Longest a rank waits at teardown for the others to reach theirs.
FINISH_WAIT_S = 3.0


def last_look(watchdog: StallWatchdog) -> None:
    """Compare this rank's final records with every rank's (see the module docstring); an
    incident found or reported ends up in ``watchdog.ledger.incident``. Raises whatever the
    store raises once it is gone."""
    store, prefix, rank = watchdog.store, watchdog.prefix, watchdog.ledger.rank
    timing = watchdog.timing
    if watchdog.ledger.incident is None:
        state, _ = watchdog.ledger.snapshot()
        store.set(f"{prefix}/state/{rank}", state.to_bytes())
        store.set(f"{prefix}/done/{rank}", str(state.seq))
        arrived = _Arrivals(watchdog)
        _await(watchdog, lambda: arrived() or _reported(watchdog), FINISH_WAIT_S)
        if not _reported(watchdog):
            found = _final_difference(watchdog, state)
            if found is not None:
                watchdog.open_incident("mismatch", found)
        if store.check([f"{prefix}/open"]):
            wait = timing.answer_wait + 2 * timing.interval + 1.0
            _await(watchdog, lambda: _reported(watchdog), wait)
        if _reported(watchdog) and watchdog.ledger.incident is None:
            watchdog.act(json.loads(store.get(f"{prefix}/report")))
    if watchdog.ledger.incident is not None:  # every rank has it before this one leaves
        _await(watchdog, lambda: _all(watchdog, "read"), timing.answer_wait)
        return
    store.set(f"{prefix}/checked/{rank}", "1")
    if rank == 0:  # the others may still read the store rank 0 often hosts
        _await(watchdog, lambda: _all(watchdog, "checked"), FINISH_WAIT_S)


def _final_difference(watchdog: StallWatchdog, mine: RankState) -> int | None:
    """The collective number where this rank's records and another rank's differ, or that
    another rank waits in although this rank never issued it; None when they agree."""
    store, prefix = watchdog.store, watchdog.prefix
    for rank in range(watchdog.world_size):
        key = f"{prefix}/state/{rank}"
        if rank == mine.rank or not store.check([key]):
            continue
        other = RankState.from_bytes(store.get(key))
        found = find_mismatch(mine, other)
        if found is not None:
            return found[0].seq
        done = store.check([f"{prefix}/done/{rank}"])
        if other.inside and other.seq > mine.seq and not done:
            return other.seq
    return None


class _Arrivals:
    """Whether every other rank has reached its teardown or is known to have left (killed,
    exited): a dead rank is not waited for. Who left is looked up every 0.25 s at most."""

    def __init__(self, watchdog: StallWatchdog) -> None:
        self._watchdog = watchdog
        self._gone: set[int] = set()
        self._looked = 0.0

    def __call__(self) -> bool:
        watchdog = self._watchdog
        rank, world = watchdog.ledger.rank, watchdog.world_size
        if time.monotonic() - self._looked > 0.25:
            self._looked = time.monotonic()
            self._gone = set(departed(world, rank))
        keys = [f"{watchdog.prefix}/done/{r}" for r in range(world) if r not in self._gone]
        return bool(watchdog.store.check(keys))


def _reported(watchdog: StallWatchdog) -> bool:
    return bool(watchdog.store.check([f"{watchdog.prefix}/report"]))


def _all(watchdog: StallWatchdog, key: str) -> bool:
    keys = [f"{watchdog.prefix}/{key}/{r}" for r in range(watchdog.world_size)]
    return bool(watchdog.store.check(keys))


def _await(watchdog: StallWatchdog, condition: Callable[[], bool], seconds: float) -> bool:
    """Poll ``condition`` until it holds or ``seconds`` pass, answering an incident another
    rank opens meanwhile; whether it held."""
    deadline = time.monotonic() + seconds
    while True:
        if watchdog.store.check([f"{watchdog.prefix}/open"]):
            watchdog.answer()
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


__all__ = ["FINISH_WAIT_S", "last_look"]
