"""The stall watchdog: a daemon thread per rank that publishes this rank's latest collectives
in the process group's key-value store (never a collective on the training group), compares
them with its neighbour's, and, when this rank has waited in one collective longer than the
stall timeout or two ranks issued different collectives under the same number, gathers every
rank's state and stack through the store and makes every rank raise one report.

Store keys (under ``nn_handler/watch/G/``, G counting the watchdogs each rank started in this
group, so a group reused by several runs never reads an earlier run's report): ``state/R``
(rank R's latest records, refreshed each interval), ``open`` (a counter: the rank that raises
it to 1 writes the report), ``opened`` (what it reports, so another rank can take over if it
dies first), ``answer/R`` (rank R's state and stack once an incident is open), ``report``
(the outcome, written once: compare-and-set).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

from loguru import logger

from nn_handler.distributed.faults.liveness import departed
from nn_handler.distributed.faults.watchdog import report as reports
from nn_handler.distributed.faults.watchdog.farewell import last_look
from nn_handler.distributed.faults.watchdog.interrupt import MainThreadInterrupt
from nn_handler.distributed.faults.watchdog.ledger import CollectiveLedger
from nn_handler.distributed.faults.watchdog.loader_wait import late_batch
from nn_handler.distributed.faults.watchdog.records import (
    RankState,
    describe,
    find_mismatch,
    neighbour,
    user_location,
)
from nn_handler.errors import CollectiveMismatchError, CollectiveStallError, LauncherGoneError

PREFIX = "nn_handler/watch"
#: Exit status of a rank that is still blocked inside a collective after the report (no
#: Python exception can be raised inside a blocked gloo or nccl call).
BLOCKED_EXIT_CODE = 1
_STACK_FRAMES = 12
MISMATCH_HINT = (
    "Every rank must issue the same collectives, in the same order, with the same structure, "
    "dtypes and shapes. Found by the stall watchdog (gloo mixes such data silently)."
)


@dataclass(frozen=True)
class WatchdogTiming:
    """How often the watchdog looks (``interval``), how long the reporting rank waits for the
    others' answers, and how long a rank may stay blocked after the report before it exits."""

    stall_timeout: float
    interval: float
    answer_wait: float
    grace: float

    @classmethod
    def for_timeout(cls, stall_timeout: float) -> WatchdogTiming:
        interval = min(2.0, max(0.05, stall_timeout / 20))
        return cls(stall_timeout, interval, min(10.0, max(1.0, 10 * interval)), 5.0)


class StallWatchdog:
    """Watches one rank's ``ledger``; every rank of the group runs one (``start`` after the
    group is up, ``stop`` before it is destroyed). ``store``: the group's key-value store (any
    torch Store); ``interrupt``: how the main thread is made to raise (tests pass their own)."""

    def __init__(
        self,
        ledger: CollectiveLedger,
        store: Any,
        world_size: int,
        timing: WatchdogTiming,
        prefix: str = PREFIX,
        interrupt: MainThreadInterrupt | None = None,
        launcher_pid: int | None = None,
    ) -> None:
        self.ledger = ledger
        self.timing = timing
        self.store = self._store = store
        self.prefix = self._prefix = prefix
        self._rank = ledger.rank
        self.world_size = self._world_size = world_size
        self._interrupt = interrupt or MainThreadInterrupt(ledger)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nn_handler-watchdog", daemon=True)
        self._answered = False
        self._open_seen: float | None = None
        self._acted_at: float | None = None
        self._reporter = False
        self._delivered = False
        self._text = ""
        self._cleared: tuple[int, float] | None = None  # (collective, seconds) seen fine
        self._said_slow = False
        #: The launcher that started this worker (torchrun's agent, its parent process): when
        #: it is gone, the worker is an orphan and stops (``LauncherGoneError``).
        self.launcher_pid = launcher_pid
        self._orphan_lock = threading.Lock()
        if launcher_pid is not None:
            ledger.launcher_check = self._check_launcher

    def start(self) -> None:
        self._interrupt.install()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.timing.interval + 1.0)
        self._interrupt.uninstall()

    def finish(self) -> BaseException | None:
        """Stop watching with one last comparison of every rank's collectives (see
        watchdog/farewell.py); the incident this rank must still raise, or None. Every rank
        calls it at teardown, on the thread that issued the collectives."""
        self.stop()
        self._delivered = True  # raised by the caller, never as an interrupt in teardown
        orphaned = isinstance(self.ledger.incident, LauncherGoneError)
        try:
            if not orphaned:  # an orphan's store went with its launcher: nothing to compare
                last_look(self)
        except Exception as error:  # the store went away: nothing more can be compared
            logger.debug("stall watchdog on rank {} at teardown: {}", self._rank, error)
        ledger = self.ledger
        if ledger.incident is None or ledger.incident_raised:
            return None
        ledger.incident_raised = True
        return ledger.incident

    def last_published(self, rank: int) -> str:
        """Rank ``rank``'s last collective as it published it (best effort)."""
        try:
            key = f"{self._prefix}/state/{rank}"
            if not self._store.check([key]):
                return "none of its collectives was published yet"
            latest = RankState.from_bytes(self._store.get(key)).latest
        except Exception:  # its store went away with it
            return "its records could not be read"
        return f"its last published collective: {describe(latest)}"

    # ----------------------------------------------------------------- the loop
    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.timing.interval):
            if self._check_launcher():
                return
            try:
                if self._acted_at is not None:
                    if self._after_report():
                        return
                    continue
                self._tick()
                failures = 0
            except Exception as error:  # the store went away (rank 0 gone, group destroyed)
                failures += 1
                logger.debug("stall watchdog on rank {}: {}", self._rank, error)
                if failures >= 5:
                    return

    def _check_launcher(self) -> bool:
        """Whether the launcher is gone (this worker was re-parented); then the next
        collective or training step raises LauncherGoneError, so nothing more is trained or
        written. From the watchdog's thread and before every collective of the training
        thread (a store that went with the agent can hold the watchdog's thread for seconds)."""
        if self.launcher_pid is None or os.getppid() == self.launcher_pid:
            return False
        with self._orphan_lock:
            self._orphaned()
        return True

    def _orphaned(self) -> None:
        if self.ledger.incident is not None:
            return
        self.ledger.incident = LauncherGoneError(
            f"rank {self._rank}: the launcher that started this worker (torchrun's agent, pid "
            f"{self.launcher_pid}) is gone, killed with its job; this worker stops here "
            f"without training or writing more, so a relaunched job has its folder to itself."
        )
        logger.bind(rank=self._rank).error(
            "the launcher (pid {}) is gone: stopping at the next step", self.launcher_pid
        )

    def _tick(self) -> None:
        state, patient = self.ledger.snapshot()
        store = self._store
        store.set(f"{self._prefix}/state/{self._rank}", state.to_bytes())
        if store.check([f"{self._prefix}/open"]):
            self.answer()
            if store.check([f"{self._prefix}/report"]):
                self.act(json.loads(store.get(f"{self._prefix}/report")))
            elif self._report_overdue():  # the reporting rank died before it reported
                opened = json.loads(store.get(f"{self._prefix}/opened"))
                self._report(opened["kind"], opened["seq"], opened["rank"])
            return
        other = self._neighbour_state()
        if other is not None:
            found = find_mismatch(state, other)
            if found is not None:
                self.open_incident("mismatch", found[0].seq)
                return
        if state.inside and not patient and state.seconds > self.timing.stall_timeout:
            if self._waiting_is_fine(state):
                return
            self.open_incident("stall", state.seq)

    def _waiting_is_fine(self, state: RankState) -> bool:
        """Whether every rank's published state says this wait is no stall (see
        ``reports.no_stall``); looked at again once per stall timeout while it lasts, and
        said once in the log, by the lowest rank waiting."""
        cleared = self._cleared
        recent = cleared is not None and state.seconds - cleared[1] < self.timing.stall_timeout
        if recent and cleared is not None and cleared[0] == state.seq:
            return True
        states = {self._rank: state}
        for rank in range(self._world_size):
            key = f"{self._prefix}/state/{rank}"
            if rank != self._rank and self._store.check([key]):
                states[rank] = RankState.from_bytes(self._store.get(key))
        why = reports.no_stall(states, state.seq, self._world_size)
        if why is None:
            return False
        self._cleared = (state.seq, state.seconds)
        waiting = min(r for r, s in states.items() if s.inside and s.seq == state.seq)
        if not self._said_slow and waiting == self._rank:
            self._said_slow = True
            logger.bind(rank=self._rank).warning(
                "{} has lasted {:.1f} s, longer than stall_timeout ({:g} s), but {}; waiting "
                "on (the process-group timeout still applies). Raise "
                "distributed.stall_timeout if waits this long are expected (said once).",
                describe(state.latest),
                state.seconds,
                self.timing.stall_timeout,
                why,
            )
        return True

    def _neighbour_state(self) -> RankState | None:
        key = f"{self._prefix}/state/{neighbour(self._rank, self._world_size)}"
        if not self._store.check([key]):
            return None
        return RankState.from_bytes(self._store.get(key))

    # ----------------------------------------------------------------- an incident
    def answer(self) -> RankState:
        state, _ = self.ledger.snapshot()
        thread = self.ledger.thread_ident or threading.main_thread().ident or -1
        frame = sys._current_frames().get(thread)
        if frame is not None:
            state.stack = "".join(traceback.format_stack(frame)[-_STACK_FRAMES:])  # training
            state.where_now = user_location(frame)
            late = late_batch(frame)
            if late is not None:
                state.where_now = f"{state.where_now}, {late}"
        if not self._answered:
            self._store.set(f"{self._prefix}/answer/{self._rank}", state.to_bytes())
            self._answered = True
        return state

    def open_incident(self, kind: str, seq: int) -> None:
        if self._store.add(f"{self._prefix}/open", 1) != 1:
            return  # another rank reports; this one answers at its next look
        opened = {"kind": kind, "seq": seq, "rank": self._rank}
        self._store.set(f"{self._prefix}/opened", json.dumps(opened))
        self._report(kind, seq, self._rank)

    def _report_overdue(self) -> bool:
        """Whether the incident was opened long enough ago that its reporter should have
        reported (it gathers answers for ``answer_wait`` seconds at most)."""
        now = time.monotonic()
        if self._open_seen is None:
            self._open_seen = now
        limit = self.timing.answer_wait + 5 * self.timing.interval + 2.0
        return now - self._open_seen > limit and self._store.check([f"{self._prefix}/opened"])

    def _report(self, kind: str, seq: int, opener: int) -> None:
        """Gather every rank's answer, write the report (the first one written wins: a rank
        taking over from a dead reporter never makes a second) and act on it."""
        self._reporter = True
        mine = self.answer()
        states = {self._rank: mine, **self._collect_answers()}
        silent = self._silent(states)
        if kind == "stall":
            subject = opener if opener in states else self._rank
            text, ranks = reports.stall_report(states, subject, self.timing.stall_timeout, silent)
            payload: dict[str, Any] = {
                "kind": kind,
                "text": text,
                "ranks": ranks,
                "reporter": self._rank,
            }
        else:
            signatures = reports.mismatch_signatures(states, seq, self._world_size)
            error = CollectiveMismatchError(f"collective #{seq}", signatures, MISMATCH_HINT)
            payload = {"kind": kind, "text": str(error), "seq": seq, "signatures": signatures}
        written = self._store.compare_set(f"{self._prefix}/report", "", json.dumps(payload))
        self.act(json.loads(written))

    def _collect_answers(self) -> dict[int, RankState]:
        states: dict[int, RankState] = {}
        deadline = time.monotonic() + self.timing.answer_wait
        while True:
            for rank in range(self._world_size):
                key = f"{self._prefix}/answer/{rank}"
                if rank != self._rank and rank not in states and self._store.check([key]):
                    states[rank] = RankState.from_bytes(self._store.get(key))
            if len(states) == self._world_size - 1 or time.monotonic() > deadline:
                return states
            time.sleep(min(0.05, self.timing.interval))

    def _silent(self, states: dict[int, RankState]) -> dict[int, str]:
        missing = [r for r in range(self._world_size) if r not in states]
        if not missing:
            return {}
        gone = departed(self._world_size, self._rank)
        return {
            rank: gone.get(
                rank,
                f"no answer in {self.timing.answer_wait:g} s (blocked outside Python, or its "
                f"machine stopped answering)",
            )
            for rank in missing
        }

    def act(self, payload: dict[str, Any]) -> None:
        incident = incident_from(payload)
        self._text = str(payload["text"])
        self.ledger.incident = incident
        self._acted_at = time.monotonic()
        self._store.set(f"{self._prefix}/read/{self._rank}", "1")  # see farewell.py
        if self._reporter and payload["kind"] == "stall":
            # Printed, not logged: the log shows rank 0's records only (the report may be made
            # on another rank) and may be off. Once, by the rank that made it, before any rank
            # raises (torchrun stops the others when the first exits): every rank's
            # CollectiveStallError then carries its first line and points here.
            print(f"[nn_handler rank {self._rank}] {self._text}", file=sys.stderr, flush=True)
        elif self._reporter:  # a mismatch: short, the error raised on every rank says it all
            logger.bind(rank=self._rank).error(
                "{} (every rank raises {})", self._text.splitlines()[0], type(incident).__name__
            )
        self._deliver_if_running()

    def _deliver_if_running(self) -> None:
        state, _ = self.ledger.snapshot()
        if not state.inside and not self._delivered and not self.ledger.incident_raised:
            self._delivered = True
            self._interrupt.deliver()

    def _after_report(self) -> bool:
        """After the report: make sure this rank raises; True once it has."""
        if self.ledger.incident_raised:
            return True
        self._deliver_if_running()
        acted_at = self._acted_at if self._acted_at is not None else time.monotonic()
        limit = self.timing.grace * (1 if self._reporter else 2)
        if time.monotonic() - acted_at < limit:
            return False
        state, _ = self.ledger.snapshot()
        where = describe(state.latest) if state.inside else "code that ignores the interrupt"
        # Printed, not logged: the library's log may be off, and this process ends here.
        print(
            f"[nn_handler rank {self._rank}] still blocked in {where} {limit:.0f} s after the "
            f"stall watchdog's report, where no exception can be raised: exiting with status "
            f"{BLOCKED_EXIT_CODE} so the other ranks can raise.\n{self.ledger.incident}",
            file=sys.stderr,
        )
        sys.stderr.flush()
        os._exit(BLOCKED_EXIT_CODE)


def incident_from(payload: dict[str, Any]) -> BaseException:
    """The error a published stall or mismatch report makes every rank raise. The rank that made
    a stall's report printed it whole; the error's message is its first line and that rank
    (its ``report`` the whole), so a job's output holds the report once."""
    if payload["kind"] == "stall":
        reporter = payload.get("reporter")
        printed_by = None if reporter is None else int(reporter)
        return CollectiveStallError(payload["text"], payload["ranks"], printed_by=printed_by)
    return CollectiveMismatchError(
        f"collective #{payload['seq']}", payload["signatures"], MISMATCH_HINT
    )


__all__ = [
    "BLOCKED_EXIT_CODE",
    "MISMATCH_HINT",
    "PREFIX",
    "StallWatchdog",
    "WatchdogTiming",
    "incident_from",
]
