"""ReconnectingVerdicts: a member's client of the verdicts' store (verdicts.py) that outlives
the Lighthouse's process. A request that finds the store gone (its connection reset, refused
or silent: the Lighthouse killed, its machine drained) is sent again to the same address as
soon as a Lighthouse answers there again (``nn-handler supervise`` restarts it on the same
address; a cluster may too), for up to ``retry_s`` after the first failure; then the request's
error stands (the run stops, as it did before the Lighthouse could come back).

A restarted Lighthouse's store is empty: the verdict of the step in flight is re-derived from
the members, who hold every input of it. On reconnecting, a member first tells the new store
what it knows (``restore``): the run's agreed values, its address (reachability.py), whether
the run finished and the verdicts it read last (with their attempts' place in the data). Then
it sends its request again (a vote sent again is counted once: votes are by member). So:

- a verdict some member read (commit or abort) is the verdict (that member restores it, and
  the members still waiting for it are answered with it);
- a verdict none of the living read is decided again from the votes, which every member of
  the attempt sends again (a member that read none waits longer for them than a first vote:
  ``retry_s``, so that a member that read the old verdict and went on restores it first, at
  its next request, at the latest after its next collective fails for want of the others);
- a member whose verdict differs from the one a new store decided (possible only if every
  other member that read it died) left the run's bits: ``on_restored`` gets the keys, and the
  member leaves (restarted, it joins with a live member's state).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from nn_handler.training.fault_tolerance.verdicts import FINISHED, VerdictStore

#: How many of the attempts a member voted on last it tells a restarted store (a member is at
#: most one attempt ahead of another).
KEPT = 4
#: The pause between two tries to reach a Lighthouse that is gone.
RETRY_PAUSE_S = 0.1


class ReconnectingVerdicts:
    """The verdicts' store of the Lighthouse at ``lighthouse`` through ``store`` (connected),
    every request bounded by ``timeout_s``, sent again to a Lighthouse restarted at the same
    address for up to ``retry_s``. ``on_restored(differing)``: called after each reconnection
    with the keys whose value in the new store differs from this member's."""

    def __init__(
        self,
        lighthouse: str,
        store: VerdictStore,
        retry_s: float,
        on_restored: Callable[[list[str]], None] = lambda differing: None,
    ) -> None:
        host, port = lighthouse.removeprefix("http://").rsplit(":", 1)
        #: The store's address: the Lighthouse's port + 1.
        self.address = (host, int(port) + 1)
        self._store = store
        self._reconnecting = threading.Lock()
        self.retry_s = retry_s
        self._on_restored = on_restored
        #: How many times this member reached a Lighthouse again after losing it.
        self.reconnects = 0
        #: What this member tells a new store: key -> value.
        self._known: dict[str, str] = {}
        self._attempts: list[str] = []  # the attempts it voted on last, oldest first

    def add(self, key: str, value: int) -> int:
        return int(self._call(lambda store: store.add(key, value)))

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value: bytes = self._call(lambda store: store.compare_set(key, expected, desired))
        if key.startswith(("agreed/", "address/")) or key == FINISHED:
            self._known[key] = value.decode()
        return value

    def check(self, keys: list[str]) -> bool:
        return self._call(lambda store: store.check(keys)) is True

    def get(self, key: str) -> bytes:
        value: bytes = self._call(lambda store: store.get(key))
        if key == FINISHED:
            self._known[key] = value.decode()
        return value

    def value(self, key: str, default: str) -> str:
        return str(self._call(lambda store: store.value(key, default)))

    def vote(
        self, attempt: str, members: int, done: bool, position: str, wait_s: float,
        leaving: bool = False, voter: str = "",
    ) -> tuple[bool, str, bool]:  # fmt: skip
        """VerdictStore.vote; sent again after a reconnection with a wait of ``retry_s`` at
        least (see the module's docstring)."""
        wait = [wait_s]

        def again() -> None:  # after a reconnection
            wait[0] = max(wait_s, self.retry_s)

        commit, run_position, again_quorum = self._call(
            lambda store: store.vote(attempt, members, done, position, wait[0], leaving, voter),
            again,
        )
        if attempt in self._attempts:
            self._attempts.remove(attempt)
        self._attempts.append(attempt)
        self._known.update({
            f"{attempt}/verdict": "commit" if commit else "abort",
            f"{attempt}/position": run_position,
            f"{attempt}/quorum_next": str(again_quorum),
        })  # fmt: skip
        while len(self._attempts) > KEPT:
            old = f"{self._attempts.pop(0)}/"
            for key in [key for key in self._known if key.startswith(old)]:
                del self._known[key]
        return commit, run_position, again_quorum

    def close(self) -> None:
        self._store.close()

    def _call(
        self, request: Callable[[VerdictStore], Any], retrying: Callable[[], None] = lambda: None
    ) -> Any:
        """``request`` to the store, sent again after each reconnection (``retrying`` first)
        until ``retry_s`` after its first failure."""
        deadline: float | None = None
        while True:
            store = self._store
            try:
                return request(store)
            except OSError as error:
                deadline = deadline or time.monotonic() + self.retry_s
                with self._reconnecting:  # one thread reconnects; another's request waits
                    if self._store is store:
                        self._reconnect(deadline, error)
                retrying()

    def _reconnect(self, deadline: float, error: OSError) -> None:
        """A store at the same address, told what this member knows; ``error`` once
        ``deadline`` passed without one."""
        self._store.close()
        while time.monotonic() < deadline:
            try:
                store = VerdictStore(*self.address, self._store.timeout_s)
            except OSError:
                time.sleep(RETRY_PAUSE_S)
                continue
            try:
                differing = store.restore(dict(self._known))
            except OSError:
                store.close()
                time.sleep(RETRY_PAUSE_S)
                continue
            self._store = store
            self.reconnects += 1
            self._on_restored(differing)
            return
        raise error


__all__ = ["KEPT", "ReconnectingVerdicts"]
