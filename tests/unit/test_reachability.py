"""Who is cut off (training/fault_tolerance/reachability.py): after a group failed to set up,
its members probe each other and report to the verdicts' store; the member a majority cannot
reach leaves, naming whom it missed, and the others go on at once (issue 69, item 19). The
rule is pure logic (property-tested); the probes and the reports go through real sockets and
a real VerdictServer in this process. The partition itself, with real processes in a network
namespace, is tests/distributed/test_step_fault_tolerance.py's."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nn_handler.errors import DistributedError
from nn_handler.training.fault_tolerance.reachability import (
    Reachability,
    majority,
    probe,
    unreachable,
    verdict_on,
)
from nn_handler.training.fault_tolerance.reconnecting import ReconnectingVerdicts
from nn_handler.training.fault_tolerance.verdicts import VerdictServer, VerdictStore

LIGHTHOUSE = "http://127.0.0.1:1"


@pytest.fixture
def listening() -> Iterator[str]:
    """An address that takes connections."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        yield f"127.0.0.1:{server.getsockname()[1]}"


def _closed_address() -> str:
    """An address nothing listens on (a port just freed)."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
    return f"127.0.0.1:{port}"


def test_a_probe_tells_a_listening_address_from_a_closed_one(listening: str) -> None:
    assert probe(listening) is True
    assert probe(_closed_address()) is False
    assert probe("no-port") is False
    closed = _closed_address()
    missed = unreachable({"a:1": listening, "b:2": closed, "c:3": ""})
    assert missed == ["b:2"]  # an unknown address ("") is not counted against its member


@st.composite
def _reports(draw: st.DrawFn) -> tuple[list[str], dict[str, list[str]]]:
    members = [f"m{i}" for i in range(draw(st.integers(1, 7)))]
    reporters = draw(st.lists(st.sampled_from(members), unique=True)) if members else []
    reports = {r: draw(st.lists(st.sampled_from(members), unique=True)) for r in reporters}
    return members, reports


@given(_reports(), st.data())
def test_a_member_is_cut_off_exactly_when_a_majority_of_the_others_say_so(
    drawn: tuple[list[str], dict[str, list[str]]], data: st.DataObject
) -> None:
    """The rule: cut off once more than half the quorum reports the member unreachable (its
    own report never counts); decided (False) once the missing reports could not make that;
    undecided while they could. More reports never turn a decision around."""
    members, reports = drawn
    member = data.draw(st.sampled_from(members))
    others = [m for m in members if m != member]
    against = sum(member in reports.get(m, []) for m in others)
    missing = sum(m not in reports for m in others)
    verdict = verdict_on(member, members, reports)
    if against > len(members) / 2:
        assert verdict is True
    elif against + missing > len(members) / 2:
        assert verdict is None
    else:
        assert verdict is False
    # Every way the missing reports could come keeps a decision.
    if verdict is not None:
        for name in others:
            reports.setdefault(name, [member])
        assert verdict_on(member, members, reports) is verdict


def test_two_members_cut_off_from_each_other_never_leave() -> None:
    """Neither side of two can be told the cut-off one: nobody leaves on a report."""
    assert majority(2) == 2
    assert verdict_on("a", ["a", "b"], {"b": ["a"], "a": ["b"]}) is False


class _Server:
    """A verdicts' server and its members' clients, all closed at the end."""

    def __init__(self) -> None:
        self.served = VerdictServer("127.0.0.1", 0)
        self.clients: list[ReconnectingVerdicts] = []

    def member(self, me: str, address: str, timeout_s: float = 3.0) -> Reachability:
        port = self.served.port
        client = ReconnectingVerdicts(
            f"http://127.0.0.1:{port - 1}", VerdictStore("127.0.0.1", port, 5.0), 5.0
        )
        self.clients.append(client)
        reach = Reachability(client, LIGHTHOUSE, me, address, timeout_s)
        reach.register()
        return reach


@pytest.fixture
def server() -> Iterator[_Server]:
    served = _Server()
    yield served
    for client in served.clients:
        client.close()
    served.served.close()


def test_the_member_the_others_cannot_reach_leaves_naming_them_and_they_go_on_at_once(
    server: _Server,
) -> None:
    """Three members of a group that failed to set up: c listens where nobody can reach it
    (a closed port) and reaches nobody (its probes see every address closed: its side of the
    partition). a and b reach each other and go on at once; c waits for their reports and
    leaves with one error naming both, its address and the fix."""
    with (
        socket.create_server(("127.0.0.1", 0)) as a_server,
        socket.create_server(("127.0.0.1", 0)) as b_server,
    ):
        a_at = f"127.0.0.1:{a_server.getsockname()[1]}"
        b_at = f"127.0.0.1:{b_server.getsockname()[1]}"
        c_at = _closed_address()
        a, b = server.member("a:1", a_at), server.member("b:2", b_at)
        c = server.member("c:3", c_at)
        c.unreachable = sorted  # its side of the partition: nobody answers
        group = ("7/life.0", ["a:1", "b:2", "c:3"])
        for reach in (a, b, c):
            reach.group = group
        failure: list[BaseException] = []

        def c_leaves() -> None:
            try:
                c.leave_if_cut_off()
            except DistributedError as error:
                failure.append(error)

        threading.Thread(target=c_leaves, daemon=True).start()
        started = time.monotonic()
        a.leave_if_cut_off()
        b.leave_if_cut_off()
        assert time.monotonic() - started < 3.0  # they reached a majority: no wait
        end = time.monotonic() + 30
        while not failure and time.monotonic() < end:
            time.sleep(0.02)
    assert failure, "the member cut off did not leave"
    message = str(failure[0])
    assert message.startswith("member c: cut off from the run's other members")
    assert "but not a, b" in message and f"cannot reach it at {c_at}" in message
    assert "Check the network" in message and "restart it" in message


def test_a_member_that_reaches_nobody_and_hears_nothing_stays_after_its_wait(
    server: _Server,
) -> None:
    """The others gone (no reports come): a member that reached none of them cannot tell a
    partition from their deaths, waits ``wait_s`` for reports, and stays (the Lighthouse
    drops the dead ones; nothing says it is the one cut off)."""
    alone = server.member("c:3", _closed_address(), timeout_s=0.1)
    alone.unreachable = sorted
    alone.group = ("9/life.1", ["a:1", "b:2", "c:3"])
    started = time.monotonic()
    alone.leave_if_cut_off()
    assert alone.wait_s <= time.monotonic() - started < alone.wait_s + 5
    alone.group = ("", [])  # no group set up yet: nothing to probe
    alone.leave_if_cut_off()


def test_an_unreadable_report_counts_as_none(server: _Server) -> None:
    """A report that is not a JSON list of names (a member of another release, a torn value)
    is no report: never a list of names read from garbage."""
    reach = server.member("a:1", _closed_address())
    store = server.clients[-1]
    store.compare_set("g/unreached/b:2", "", "{not json")
    store.compare_set("g/unreached/c:3", "", '{"b:2": 1}')
    store.compare_set("g/unreached/d:4", "", '["a:1", 5]')
    assert reach._report("g", "b:2") is None and reach._report("g", "c:3") is None
    assert reach._report("g", "d:4") == ["a:1", "5"]
    assert reach._report("g", "e:5") is None  # none yet
