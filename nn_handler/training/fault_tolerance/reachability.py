"""Who is cut off: a member that reaches the Lighthouse but not the other members (a
partition) is in every quorum the Lighthouse forms, and every group of those quorums fails to
set up; without this, the run stops after ``quorum_timeout_s``.

After a group's set-up failed, each member of the quorum probes the others at the addresses
they registered (a TCP connection to each one's replica-group store, which the group's
members connect to) and reports the ones it could not reach to the verdicts' store. A member
that reached a majority of the quorum (itself counted) goes on at once. One that did not is
the one cut off, or the others are gone: it waits for their reports, and leaves the run when
a majority of the quorum's members report it unreachable (they live: they reached the
Lighthouse to say it); the others then go on without it once the Lighthouse drops it. Two
members cut off from each other cannot tell which side is cut off: neither leaves (the run
stops after ``quorum_timeout_s``, as before). A member that is slow or stopped still takes a
connection (the kernel completes it): only a cut network or a process gone counts."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable

from nn_handler.errors import DistributedError
from nn_handler.training.fault_tolerance.reconnecting import ReconnectingVerdicts

#: The longest wait for a connection to another member (one probe, all run at once).
PROBE_S = 1.0
#: The pause between two reads of the others' reports.
POLL_S = 0.1


def probe(address: str, timeout_s: float = PROBE_S) -> bool:
    """Whether a TCP connection to ``address`` (host:port) is taken within ``timeout_s``."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):  # refused, silent, or no port at all
        return False


def unreachable(addresses: dict[str, str], timeout_s: float = PROBE_S) -> list[str]:
    """The names in ``addresses`` (name -> host:port) whose address takes no connection, all
    probed at once (at most ``timeout_s`` in all); an unknown address ("") is not probed."""
    reached: dict[str, bool] = {}

    def one(name: str) -> None:
        reached[name] = probe(addresses[name], timeout_s)

    known = [name for name in addresses if addresses[name]]
    threads = [threading.Thread(target=one, args=(name,), daemon=True) for name in known]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 1)
    return sorted(name for name in known if not reached.get(name, False))


def majority(members: int) -> int:
    """The fewest of ``members`` that are more than half of them."""
    return members // 2 + 1


def verdict_on(member: str, members: list[str], reports: dict[str, list[str]]) -> bool | None:
    """Whether ``member`` is cut off from the quorum ``members``, by the ``reports`` so far
    (reporter -> the members it could not reach): True once a majority of ``members`` report
    it unreachable, False once that can no longer happen (the reports still missing could not
    make it), None while it can."""
    others = [name for name in members if name != member]
    against = sum(1 for name in others if member in reports.get(name, ()))
    missing = sum(1 for name in others if name not in reports)
    if against >= majority(len(members)):
        return True
    return None if against + missing >= majority(len(members)) else False


class Reachability:
    """A member's part in telling who is cut off (see the module), through the verdicts'
    store ``verdicts`` of the Lighthouse at ``lighthouse``: ``me`` is its replica id
    (``member_id:uuid``), reached at ``address`` (host:port); ``timeout_s``: a collective's
    (the others may find a set-up failed up to that much later than this member)."""

    def __init__(
        self, verdicts: ReconnectingVerdicts, lighthouse: str, me: str, address: str,
        timeout_s: float,
    ) -> None:  # fmt: skip
        self._verdicts, self.lighthouse, self.me, self.address = verdicts, lighthouse, me, address
        #: The longest wait for the others' reports.
        self.wait_s = timeout_s + 2 * PROBE_S + 1
        #: The group being set up: its name (the same on each of its members) and members.
        self.group: tuple[str, list[str]] = ("", [])
        #: How the others are probed: their names -> addresses, to the unreachable names.
        self.unreachable: Callable[[dict[str, str]], list[str]] = unreachable

    def register(self) -> None:
        """Say where this member is reached (kept across a Lighthouse's restart)."""
        self._verdicts.compare_set(f"address/{self.me}", "", self.address)

    def leave_if_cut_off(self) -> None:
        """After the group (``group``) failed to set up: probe its other members and report
        the unreachable; raise DistributedError, saying which and why, when this member is
        cut off from them (a majority of the group reports it unreachable). Every member of
        the group should call this after such a failure; it returns at once for a member that
        reached a majority, after at most ``wait_s`` for one that is not cut off."""
        attempt, members = self.group
        if attempt and (missed := self._cut_off(attempt, members)):
            member = self.me.rsplit(":", 1)[0]
            raise cut_off_error(member, self.address, self.lighthouse, missed)

    def _cut_off(self, attempt: str, members: list[str]) -> list[str]:
        """The members this one did not reach when it is cut off from them, else []."""
        others = [name for name in members if name != self.me]
        addresses = {name: self._verdicts.value(f"address/{name}", "") for name in others}
        missed = self.unreachable(addresses)
        self._verdicts.compare_set(f"{attempt}/unreached/{self.me}", "", json.dumps(missed))
        if len(members) - len(missed) >= majority(len(members)):
            return []
        deadline = time.monotonic() + self.wait_s
        while True:
            reports = {name: self._report(attempt, name) for name in others}
            known = {name: report for name, report in reports.items() if report is not None}
            verdict = verdict_on(self.me, members, known)
            if verdict is not None or time.monotonic() > deadline:
                return missed if verdict else []
            time.sleep(POLL_S)

    def _report(self, attempt: str, member: str) -> list[str] | None:
        """``member``'s report on ``attempt`` (None: none yet; an unreadable one: none)."""
        text = self._verdicts.value(f"{attempt}/unreached/{member}", "")
        with contextlib.suppress(ValueError):
            report = json.loads(text) if text else None
            if isinstance(report, list):
                return [str(name) for name in report]
        return None


def cut_off_error(
    member: str, address: str, lighthouse: str, missed: list[str]
) -> DistributedError:
    """The error of ``member`` (reached at ``address``), which leaves the run because the
    others cannot reach it (it did not reach ``missed``, replica ids)."""
    names = ", ".join(name.split(":", 1)[0] for name in missed)
    return DistributedError(
        f"member {member}: cut off from the run's other members: it reaches the Lighthouse at "
        f"{lighthouse} but not {names}, and they cannot reach it at {address}. It leaves the "
        f"run so that they go on without it. Check the network between this machine and "
        f"theirs (a firewall, a route, the address it listens on: fault_tolerance.host), then "
        f"restart it: it joins with a live member's state."
    )


__all__ = [
    "PROBE_S",
    "Reachability",
    "cut_off_error",
    "majority",
    "probe",
    "unreachable",
    "verdict_on",
]
