"""The training thread's side of the watchdog: a per-group count and short history of the
collectives this rank issued, and whether it is inside one now. A few attribute writes per
collective; the watchdog thread reads it through ``snapshot``."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from nn_handler.distributed.faults.watchdog.records import (
    RankState,
    Record,
    Site,
    format_site,
    make_record,
    user_site,
)

#: Records kept (and published) per rank: enough to line up ranks a few collectives apart.
HISTORY = 32


class CollectiveLedger:
    """Counts the collectives of one process group on this rank. Every collective the library
    issues calls ``enter`` before it and ``leave`` after it (the Communicator does; the
    Trainer marks a training step that DDP or FSDP synchronises with ``region``).

    ``incident`` is set by the watchdog once a stall or mismatch is reported: the next
    ``enter`` raises it instead of issuing a collective that would hang or mix up data.
    """

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.seq = 0
        self.incident: BaseException | None = None
        self.incident_raised = False
        #: The thread that issued the latest collective (the training thread).
        self.thread_ident: int | None = None
        #: Called before each collective: sets ``incident`` when this worker's launcher is
        #: gone (the watchdog's; a syscall, so an orphan stops at its very next collective).
        self.launcher_check: Callable[[], object] | None = None
        # (seq, what, site): made into Records (digest, formatted line) by ``snapshot``, off
        # the training thread.
        self._records: deque[tuple[int, str, Site]] = deque(maxlen=HISTORY)
        self._made: dict[tuple[int, str, Site], Record] = {}
        self._lock = threading.Lock()
        self._inside = False
        self._patient = 0
        self._entered_patient = False
        self._since = time.monotonic()

    def enter(self, what: str) -> None:
        """Record the next collective; raises the reported incident if there is one."""
        if self.launcher_check is not None:
            self.launcher_check()
        if self.incident is not None:
            self.raise_incident()
        site = user_site(sys._getframe(1))
        self.thread_ident = threading.get_ident()
        with self._lock:
            self.seq += 1
            self._records.append((self.seq, what, site))
            self._inside = True
            self._entered_patient = self._patient > 0
            self._since = time.monotonic()

    def leave(self) -> None:
        """The collective ``enter`` recorded has returned (or raised)."""
        self._inside = False
        self._since = time.monotonic()

    def region(self, what: str) -> Region:
        """Code that issues collectives the Communicator does not see (DDP's gradient
        reduction, FSDP's gathers), counted as one collective: ``with ledger.region(...)``."""
        return Region(self, what)

    @contextlib.contextmanager
    def patient(self) -> Iterator[None]:
        """Collectives entered inside may wait longer than the stall timeout, and the ranks
        waiting for this one while it works inside (rank 0 preparing data or writing a file in
        a hook) keep waiting; the process-group timeout still bounds them."""
        self._patient += 1
        try:
            yield
        finally:
            self._patient -= 1

    def raise_incident(self) -> None:
        """Raise the reported incident on the training thread (once; later calls re-raise it
        too, so no collective is issued after it)."""
        incident = self.incident
        if incident is None:
            return
        self.incident_raised = True
        raise incident

    def snapshot(self) -> tuple[RankState, bool]:
        """This rank's state as the watchdog publishes it, and whether the collective it is
        inside (if any) was entered as patient. Safe from any thread."""
        with self._lock:
            raw = list(self._records)
            inside, since, patient = self._inside, self._since, self._entered_patient
            busy = not inside and self._patient > 0
        made = {key: self._made.get(key) or _record(key) for key in raw}
        self._made = made
        records = list(made.values())
        state = RankState(
            rank=self.rank,
            seq=records[-1].seq if records else 0,
            inside=inside,
            seconds=round(time.monotonic() - since, 3),
            records=records,
            busy=busy,
        )
        return state, inside and patient


def _record(key: tuple[int, str, Site]) -> Record:
    seq, what, site = key
    return make_record(seq, what, format_site(site))


class Region:
    """``with ledger.region(what)``: one collective around the block (no generator: this runs
    every training step)."""

    __slots__ = ("_tracker", "_what")

    def __init__(self, ledger: CollectiveLedger, what: str) -> None:
        self._tracker, self._what = ledger, what

    def __enter__(self) -> None:
        self._tracker.enter(self._what)

    def __exit__(self, *exc: object) -> None:
        self._tracker.leave()


__all__ = ["HISTORY", "CollectiveLedger", "Region"]
