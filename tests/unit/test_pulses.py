"""Who is gone (training/fault_tolerance/pulses.py, pulse_watch.py): the verdicts' store learns
a member's death from its pulse's connection closing (at once) or from its silence (the
heartbeat timeout), tells the others, and an attempt of the gone member that it had not voted
on is abandoned, once for all; a member that leaves is no death (issue 73: a death's recovery
within a second, a hang's without waiting out the collectives' timeout)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from nn_handler.errors import DistributedError
from nn_handler.training.fault_tolerance.pulse_watch import LEAVE_S, PulseWatch
from nn_handler.training.fault_tolerance.pulses import Pulses
from nn_handler.training.fault_tolerance.verdicts import Verdicts, VerdictServer, VerdictStore

#: Long enough that a notice within a test can only come from a connection's end.
NEVER_S = 600.0


@pytest.fixture
def server() -> Iterator[VerdictServer]:
    served = VerdictServer("127.0.0.1", 0, heartbeat_timeout_s=NEVER_S)
    yield served
    served.close()


def _pulse_once(server: VerdictServer, member: str) -> socket.socket:
    """A member's pulse connection that sent one pulse, counted, and stays open."""
    raw = socket.create_connection(("127.0.0.1", server.port), timeout=NEVER_S)
    raw.sendall(f'["pulse", "{member}", -1]\n'.encode())
    _until(lambda: member in _members(server))
    return raw


def _members(server: VerdictServer) -> list[str]:
    with server.verdicts.changed:
        return server.verdicts.pulses.members()


def _until(condition: Callable[[], bool], deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < end, "not within 30 s"
        time.sleep(0.01)


def _gone_within(store: VerdictStore, seen: int, deadline_s: float = 30.0) -> list[str]:
    """The members gone after the first ``seen``, once there is one (pulsing as "w:0")."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        _, gone = store.pulse("w:0", seen)
        if gone:
            return gone
    pytest.fail("no member gone")


def test_a_member_whose_pulse_connection_closes_is_gone_and_one_that_leaves_is_not(
    server: VerdictServer,
) -> None:
    """With a heartbeat timeout of ten minutes, the only way a member is gone within the
    test is the end of its connection (a process's death: the kernel closes its sockets);
    one that says it leaves first is never counted, nor is a connection that never pulsed."""
    watcher = VerdictStore("127.0.0.1", server.port, NEVER_S)
    leaving = _pulse_once(server, "l:1")
    leaving.sendall(b'["leave", "l:1"]\n')
    _until(lambda: "l:1" not in _members(server))
    leaving.close()
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as quiet:
        quiet.sendall(b'["add", "n", 1]\n')
        quiet.makefile("rb").readline()  # a member's other connection: no pulse, no death
    _pulse_once(server, "d:2").close()
    assert _gone_within(watcher, 0) == ["d:2"]
    assert watcher.pulse("w:0", -1) == (1, [])  # from now: nothing (after a second's wait)
    assert watcher.pulse("w:0", 5) == (1, ["d:2"])  # a count from another store: all of this
    watcher.close()


def test_a_member_silent_for_the_heartbeat_timeout_is_gone_once() -> None:
    """The sweep, at chosen times: a member whose last pulse is older than the timeout is
    gone (once: it is forgotten then); one that pulses again is alive again."""
    changed = threading.Condition()
    pulses = Pulses(changed, timeout_s=0.5)
    before = time.monotonic()
    with changed:
        pulses.pulse("a:1", -1)
        pulses.pulse("b:2", -1)
    after = time.monotonic()
    with changed:
        pulses.sweep(before + 0.5)  # no pulse older than the timeout yet
        assert pulses.gone == []
        pulses.sweep(after + 0.6)
        assert sorted(pulses.gone) == ["a:1", "b:2"]
        pulses.sweep(after + 10.0)
        assert len(pulses.gone) == 2  # once
        pulses.closed("a:1")
        assert len(pulses.gone) == 2  # its connection's end after it: no second notice


def test_a_silent_member_is_told_over_real_connections() -> None:
    """A member that pulsed once and stays connected, silent (a SIGSTOP keeps its sockets
    open), is gone for the others after the heartbeat timeout."""
    server = VerdictServer("127.0.0.1", 0, heartbeat_timeout_s=0.4)
    watcher = VerdictStore("127.0.0.1", server.port, 30.0)
    try:
        stopped = _pulse_once(server, "s:3")
        assert _gone_within(watcher, 0) == ["s:3"]
        stopped.close()
    finally:
        watcher.close()
        server.close()


def _voted_done_by_a(verdicts: Verdicts, attempt: str, answers: list[object]) -> threading.Thread:
    """Member "a" votes done on ``attempt`` of two members in a thread of its own and waits for
    the verdict (appended to ``answers``); returns once its vote is counted."""
    thread = threading.Thread(
        target=lambda: answers.append(
            verdicts.answer("vote", [attempt, 2, True, "p", 30.0, False, "a"])
        )
    )
    thread.start()
    _until(lambda: f"{attempt}/done/a" in verdicts.values)
    return thread


def test_an_attempt_of_a_gone_member_is_aborted_only_if_it_had_not_voted() -> None:
    """The store's rule: a gone member's attempt is aborted once for all (its voters waiting
    are answered) unless the gone one voted done on it (its collectives finished: the others'
    done votes still commit it) or it is decided."""
    verdicts = Verdicts()
    answers: list[object] = []
    waiting = _voted_done_by_a(verdicts, "3/1/0", answers)
    assert verdicts.answer("abort_missing", ["3/1/0", "b"]) is True
    waiting.join(10)
    assert answers == [["abort", "p", True]]
    assert verdicts.answer("abort_missing", ["3/1/0", "b"]) is True  # decided: still abort
    verdicts.answer("vote", ["4/1/0", 2, True, "p", 0.01, False, "a"])  # a missing vote: abort
    assert verdicts.answer("abort_missing", ["5/1/0", "x"]) is True  # no vote yet: its first
    # voter's place is the run's (a Trainer member stops when told another place than its own)
    assert verdicts.answer("vote", ["5/1/0", 2, True, "p", 1.0, False, "a"]) == ["abort", "p", True]
    assert verdicts.answer("vote", ["5/1/0", 2, True, "p", 1.0, False, "b"]) == ["abort", "p", True]
    commit = _voted_done_by_a(verdicts, "6/1/0", answers)
    assert verdicts.answer("abort_missing", ["6/1/0", "a"]) is False  # a voted: not aborted
    assert verdicts.answer("vote", ["6/1/0", 2, True, "p", 30.0, False, "b"])[0] == "commit"
    commit.join(10)
    assert verdicts.answer("abort_missing", ["6/1/0", "b"]) is False  # committed


def test_a_member_of_two_ranks_gone_aborts_unless_both_of_its_ranks_voted_done() -> None:
    """Members of 2 ranks vote per rank (``member/rank``), 4 votes commit a step of two; a
    member gone is missing from the attempt unless every one of its ranks voted done."""
    verdicts = Verdicts()

    def vote(attempt: str, voter: str, wait_s: float = 30.0) -> threading.Thread:
        thread = threading.Thread(target=lambda: verdicts.answer(
            "vote", [attempt, 4, True, "p", wait_s, False, voter]), daemon=True)  # fmt: skip
        thread.start()
        _until(lambda: f"{attempt}/done/{voter}" in verdicts.values)
        return thread

    waiting = [vote("7/1/0", voter) for voter in ("a/0", "a/1", "b/0")]
    assert "7/1/0/verdict" not in verdicts.values  # three of four: no verdict yet
    assert verdicts.answer("abort_missing", ["7/1/0", "b", 2]) is True  # b/1 never voted
    assert verdicts.answer("abort_missing", ["7/1/0", "a", 2]) is True  # decided: abort
    waiting = [vote("8/1/0", voter) for voter in ("a/0", "b/0", "b/1")]
    assert verdicts.answer("abort_missing", ["8/1/0", "b", 2]) is False  # b's ranks both voted
    assert verdicts.answer("vote", ["8/1/0", 4, True, "p", 30.0, False, "a/1"])[0] == "commit"
    for thread in waiting:
        thread.join(10)


class _Collective:
    """A collective in flight that never ends (a member stopped: gloo waits its timeout)."""

    def __init__(self) -> None:
        self.future: torch.futures.Future[None] = torch.futures.Future()

    def get_future(self) -> torch.futures.Future[None]:
        return self.future

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self, timeout: object = None) -> None:
        raise AssertionError("waited for a collective whose member is gone")


def _waiting(watch: PulseWatch, collective: _Collective) -> tuple[threading.Thread, list[str]]:
    """A member's main thread waiting for ``collective`` (up to NEVER_S): what it raised."""
    raised: list[str] = []

    def wait() -> None:
        try:
            watch.wait(collective, NEVER_S)
        except DistributedError as error:
            raised.append(str(error))

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    return thread, raised


def test_a_member_of_the_attempt_gone_ends_its_collective_at_once_and_others_do_not(
    server: VerdictServer,
) -> None:
    """A member's watch, in flight on attempt 7/2/0 of a:1 and b:2, waiting in a collective
    that would wait ten minutes: b's death (its connection's end) aborts the attempt in the
    store and ends the wait, naming b, the collective left in flight (to be aborted once it
    ends); a death of a member not in the attempt does nothing; a death between two attempts
    ends the next one that has the gone member, at its first collective; a member's own close
    is no death for the others."""
    watch = PulseWatch(("127.0.0.1", server.port), "a:1", NEVER_S)
    other = VerdictStore("127.0.0.1", server.port, NEVER_S)
    try:
        _until(lambda: "a:1" in _members(server))  # its first pulse arrived
        watch.started("7/2/0", ["a:1", "b:2"])
        collective = _Collective()
        thread, raised = _waiting(watch, collective)
        _pulse_once(server, "c:3").close()  # not a member of 7/2/0
        _until(lambda: len(server.verdicts.pulses.gone) == 1)
        _pulse_once(server, "b:2").close()
        thread.join(30)
        assert raised == [
            "member b is gone: its process ended, or it was silent for the heartbeat timeout"
        ]
        assert watch.left_in_flight() is collective and watch.left_in_flight() is None
        assert other.vote("7/2/0", 2, True, "p", 1.0, voter="a") == (False, "p", True)
        watch.ended()
        _pulse_once(server, "e:5").close()  # between two attempts
        _until(lambda: "e:5" in watch.gone_between)  # the watch has read it
        watch.started("8/3/0", ["a:1", "e:5"])
        thread, raised = _waiting(watch, _Collective())
        thread.join(30)
        assert len(raised) == 1
        assert raised[0].startswith("member e was gone before the step began: "), raised
        watch.ended()
        watch.started("9/3/0", ["a:1", "f:6"])  # a new attempt: nothing gone
        done = _Collective()
        done.future.set_result(None)
        done.wait = lambda timeout=None: None  # type: ignore[method-assign]
        watch.wait(done, NEVER_S)
    finally:
        watch.close()
        other.close()
    assert "a:1" not in server.verdicts.pulses.gone  # it left


def test_a_member_s_close_is_bounded_when_its_lighthouse_is_stopped() -> None:
    """A Lighthouse stopped (its host accepts connections and never answers): the pulse waits
    in its request (a minute here), but closing the member says it leaves on a connection of
    its own bounded by LEAVE_S, and returns (a member's exit never waits on a dead store)."""
    with socket.socket() as stopped:
        stopped.bind(("127.0.0.1", 0))
        stopped.listen(8)
        watch = PulseWatch(("127.0.0.1", stopped.getsockname()[1]), "a:1", 60.0)
        time.sleep(0.2)  # its first pulse is sent, and never answered
        closing = threading.Thread(target=watch.close, daemon=True)
        closing.start()
        closing.join(LEAVE_S + 10)
        assert not closing.is_alive(), "close waited on a stopped Lighthouse"


def test_the_pulse_reaches_a_restarted_lighthouse_and_its_deaths_still_end_the_attempt() -> None:
    """The Lighthouse's store dies and a new one listens at the same address (``supervise``'s
    restart): the watch pulses there again (a new store counts from 0: its first notices are
    read whole), and a death it learns of there ends the attempt in flight as before."""
    first = VerdictServer("127.0.0.1", 0, heartbeat_timeout_s=NEVER_S)
    port = first.port
    watch = PulseWatch(("127.0.0.1", port), "a:1", NEVER_S)
    try:
        _until(lambda: "a:1" in _members(first))
        for member in ("x:7", "y:8"):  # the first store counts two deaths
            _pulse_once(first, member).close()
        _until(lambda: len(first.verdicts.pulses.gone) == 2)
        first.close()
        second = VerdictServer("127.0.0.1", port, heartbeat_timeout_s=NEVER_S)
        try:
            _until(lambda: "a:1" in _members(second))  # it pulses at the new store
            watch.started("3/1/0", ["a:1", "b:2"])
            thread, raised = _waiting(watch, _Collective())
            _pulse_once(second, "b:2").close()  # the new store's first death
            thread.join(30)
            assert len(raised) == 1 and raised[0].startswith("member b is gone: "), raised
            assert second.verdicts.values["3/1/0/verdict"] == "abort"
        finally:
            watch.close()
            second.close()
    finally:
        first.close()
