"""A member's pulse on the verdicts' store, and what it does when a member of its attempt is
gone: the attempt is aborted, and the collective waiting in it ends now (pulses.py says why and
what it costs)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

from nn_handler.errors import DistributedError
from nn_handler.training.fault_tolerance.verdicts import VerdictStore

#: The pause between two tries to reach a store that is gone (a Lighthouse restarting).
RETRY_PAUSE_S = 0.1
#: The longest a member's ``close`` waits to say it leaves.
LEAVE_S = 1.0


class PulseWatch:
    """The pulse of the member ``member`` (its torchft replica id, as quorums name it) on the
    store at ``address`` (each request bounded by ``timeout_s``), in a daemon thread until
    ``close``; a store that is gone is reached again there (a Lighthouse restarted). The
    member says when each attempt starts and ends (``started``, ``ended``) and waits for its
    collectives through ``wait``: a member of the attempt gone in between (that had not voted
    on it with each of its ``ranks``) ends the attempt, in the store for every member, and
    here the collective's wait. Each rank of a member pulses under the member's name: one
    rank's death is the member's."""

    def __init__(
        self, address: tuple[str, int], member: str, timeout_s: float, ranks: int = 1
    ) -> None:
        self.member, self.ranks = member, ranks
        self._address, self._timeout_s = address, timeout_s
        self._lock = threading.Lock()
        self._attempt = ""  # the attempt in flight ("": none)
        self._members: frozenset[str] = frozenset()
        self._between: set[str] = set()  # gone between two attempts
        #: Why the attempt in flight ended (None: it goes on).
        self.gone: DistributedError | None = None
        self._woken = threading.Event()
        self._left_in_flight: Any = None
        self._closed = threading.Event()
        self._store: VerdictStore | None = None
        threading.Thread(target=self._run, name="nn_handler-pulse", daemon=True).start()

    def started(self, attempt: str, members: Iterable[str]) -> None:
        """This member's attempt ``attempt`` (``step/quorum/attempt``) of ``members`` started:
        one of them already gone ends it at once (its first collective raises)."""
        with self._lock:
            self._attempt, self._members = attempt, frozenset(members)
            gone = sorted(self._between & self._members)
            self._between.clear()
            before = "was gone before the step began"
            self.gone = DistributedError(_gone(gone[0], before)) if gone else None

    @property
    def gone_between(self) -> frozenset[str]:
        """The members told gone since the last attempt ended (the next one's start reads
        them)."""
        with self._lock:
            return frozenset(self._between)

    def ended(self) -> None:
        """This member read the verdict of its attempt: a member gone now is the next's."""
        with self._lock:
            self._attempt = ""

    def wait(self, work: Any, timeout_s: float) -> None:
        """The end of ``work``, a collective of the attempt: its own error (gloo's timeout is
        ``timeout_s``), or ``gone`` at once when a member of the attempt is gone (aborting
        gloo's group ends no collective waiting in it; ``left_in_flight`` then has it)."""
        woken = self._woken = threading.Event()  # its own: a callback may come late
        if self.gone is None:
            work.get_future().add_done_callback(lambda _: woken.set())
            woken.wait(timeout_s + 1)
        if self.gone is not None:
            self._left_in_flight = None if work.is_completed() else work
            raise self.gone
        work.wait(timedelta(seconds=timeout_s))

    def left_in_flight(self) -> Any:
        """The collective ``wait`` left in flight for a member gone (None: none), once."""
        work, self._left_in_flight = self._left_in_flight, None
        return work

    def close(self) -> None:
        """Stop, leaving the run: this member's end is not a death. Said on a connection of
        its own, bounded by LEAVE_S (the pulse's may wait in its request; a stopped Lighthouse
        answers neither): unsaid, the end is a death, which costs nothing once this member
        voted on every attempt it took part in."""
        self._closed.set()
        with contextlib.suppress(OSError):
            leaving = VerdictStore(*self._address, LEAVE_S)
            try:
                leaving.leave(self.member)
            finally:
                leaving.close()
        self._drop()

    def _run(self) -> None:
        seen = -1
        while not self._closed.is_set():
            try:
                store = self._store or self._connect()
                seen, gone = store.pulse(self.member, seen)
            except OSError:
                self._drop()
                self._closed.wait(RETRY_PAUSE_S)
                continue
            for member in gone:
                self._went(member)

    def _connect(self) -> VerdictStore:
        store = VerdictStore(*self._address, self._timeout_s)
        with self._lock:
            if self._closed.is_set():
                store.close()
                raise ConnectionError("closed")
            self._store = store
        return store

    def _drop(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def _went(self, member: str) -> None:
        """``member`` is gone: the attempt in flight, if it is one of its members that had not
        voted, is abandoned (the store decides the abort; the collective's wait ends)."""
        with self._lock:
            if member == self.member:
                return
            if not self._attempt:
                self._between.add(member)
                return
            if member not in self._members or self._store is None:
                return
            try:
                gone = member.rsplit(":", 1)[0]
                aborted = self._store.abort_missing(self._attempt, gone, self.ranks)
            except OSError:  # the store is gone: the collective's own timeout says it
                return
            if aborted:
                self.gone = DistributedError(_gone(member, "is gone"))
                self._woken.set()


def _gone(member: str, when: str) -> str:
    return (
        f"member {member.rsplit(':', 1)[0]} {when}: its process ended, or it was silent for "
        f"the heartbeat timeout"
    )


__all__ = ["LEAVE_S", "RETRY_PAUSE_S", "PulseWatch"]
