"""Who is gone: the members' pulses on the verdicts' store, so that a member's death ends the
attempt it takes part in at once, not at a collective's ``timeout_s``.

Each member keeps a second connection to the verdicts' store (the Lighthouse's process) and
sends a pulse on it; the store holds it up to a quarter of the heartbeat timeout, or until a
member is gone, and answers with the members gone since the member's last pulse. A member is
gone when its connection closes without it leaving (its process died: the kernel closes its
sockets, so the store learns it at once) or when no pulse came from it for the heartbeat
timeout (stopped, its host unreachable). A member told that a member of its attempt is gone
asks the store to abort the attempt if the gone one had not voted on it (decided once, for
all: a member that voted done has finished its collectives), and then aborts its own group,
so that a collective waiting on the gone member fails now.

What a pulse costs: one request a quarter heartbeat timeout per member, on a connection of
its own (torchft's heartbeats, which decide the quorums, cost ten a second). A quorum is not
sped up by it: the Lighthouse leaves a dead member out once its heartbeats stop for the
heartbeat timeout.
"""

from __future__ import annotations

import threading
import time
from typing import Any


class Pulses:
    """The store's record of its members' pulses: its lock is the store's (``changed``), held
    by every method's caller. ``timeout_s``: a member silent that long is gone."""

    def __init__(self, changed: threading.Condition, timeout_s: float) -> None:
        self.changed = changed
        self.timeout_s = timeout_s
        self._last: dict[str, float] = {}  # member -> the monotonic time of its last pulse
        #: The members gone, in the order they went.
        self.gone: list[str] = []

    def pulse(self, member: str, seen: int) -> list[Any]:
        """``member`` is alive: waits up to a quarter of the timeout (a second at most) for a
        member gone after the first ``seen`` (-1: from now; more than there are: a count of
        another store's, all of this one's), and answers [the count gone, the members gone
        after ``seen``]."""
        self._last[member] = time.monotonic()
        seen = len(self.gone) if seen < 0 else seen if seen <= len(self.gone) else 0
        wait_s = min(self.timeout_s / 4, 1.0)
        self.changed.wait_for(lambda: len(self.gone) > seen, timeout=wait_s)
        return [len(self.gone), self.gone[seen:]]

    def members(self) -> list[str]:
        """The members alive: those that pulsed within the timeout."""
        return sorted(self._last)

    def leave(self, member: str) -> None:
        """``member`` leaves the run: its connection's end is no death."""
        self._last.pop(member, None)

    def closed(self, member: str) -> None:
        """``member``'s pulse connection closed: gone, unless it left."""
        if self._last.pop(member, None) is not None:
            self._went(member)

    def sweep(self, now: float) -> None:
        """Every member silent for the timeout at ``now`` is gone."""
        for member in [m for m, last in self._last.items() if now - last > self.timeout_s]:
            del self._last[member]
            self._went(member)

    def _went(self, member: str) -> None:
        self.gone.append(member)
        self.changed.notify_all()


__all__ = ["Pulses"]
