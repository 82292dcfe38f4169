"""A Lighthouse that dies and is started again at its address (issue 73): the members'
ReconnectingVerdicts (training/fault_tolerance/reconnecting.py) against a real verdicts' store
killed and restarted on the same port in this process, one interleaving of "the Lighthouse
dies" with the step's agreement per test, each made to happen, not hoped for: votes written
and no verdict read, a verdict (commit, abort) read by one member only, a verdict that a
restarted run decided otherwise, a joiner's proposal before the members came back, and no
Lighthouse back in time. Then the member's own use of it (Replica): a quorum asked again
once, the divergence said, the group's label."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, cast

import pytest

from nn_handler.training.fault_tolerance.reconnecting import ReconnectingVerdicts
from nn_handler.training.fault_tolerance.verdicts import VerdictServer, VerdictStore
from tests.ft_helpers import NoPulse


class _Lighthouse:
    """A verdicts' store that can be killed (every member's connection closed, as the end of
    its process does) and started again on the same port, empty."""

    def __init__(self) -> None:
        self.server: VerdictServer | None = VerdictServer("127.0.0.1", 0)
        self.port = self.server.port
        self.address = f"http://127.0.0.1:{self.port - 1}"  # the store is on its port + 1

    @property
    def values(self) -> dict[str, str]:
        assert self.server is not None
        return self.server.verdicts.values

    def member(
        self, retry_s: float = 10.0, on_restored: Callable[[list[str]], None] | None = None
    ) -> ReconnectingVerdicts:
        store = VerdictStore("127.0.0.1", self.port, 10.0)
        return ReconnectingVerdicts(self.address, store, retry_s, on_restored or (lambda d: None))

    def kill(self) -> None:
        assert self.server is not None
        self.server.close()
        self.server = None

    def restart(self) -> None:
        self.server = VerdictServer("127.0.0.1", self.port)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


@pytest.fixture
def lighthouse() -> Iterator[_Lighthouse]:
    served = _Lighthouse()
    yield served
    served.close()


class _Asked:
    """``request`` in a thread of its own: its answer (or error) once it returns."""

    def __init__(self, request: Callable[[], Any]) -> None:
        self.answer: Any = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(request,), daemon=True)
        self._thread.start()

    def _run(self, request: Callable[[], Any]) -> None:
        try:
            self.answer = request()
        except BaseException as error:  # the test reads it
            self.error = error

    @property
    def waiting(self) -> bool:
        return self._thread.is_alive()

    def result(self, timeout_s: float = 20.0) -> Any:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the request did not return (a hang)"
        if self.error is not None:
            raise self.error
        return self.answer


def _until(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.01)


def test_votes_lost_with_the_lighthouse_are_sent_again_and_counted_once(
    lighthouse: _Lighthouse,
) -> None:
    """Two of three members voted (the verdict not decided: the third computes) when the
    Lighthouse dies: both wait for it to come back, vote again, and the third's vote commits
    the step for all three, each vote counted once."""
    a, b, c = lighthouse.member(), lighthouse.member(), lighthouse.member()
    voted = [_Asked(lambda m=m, n=n: m.vote("7/1/0", 3, True, "p", 5.0, voter=n))  # type: ignore[misc]
             for m, n in ((a, "a"), (b, "b"))]  # fmt: skip
    _until(lambda: lighthouse.values.get("7/1/0/done") == "2", "both votes counted")
    lighthouse.kill()
    time.sleep(0.3)
    assert all(vote.waiting for vote in voted)  # retrying, not failed
    lighthouse.restart()
    _until(lambda: a.reconnects == b.reconnects == 1, "both members back")
    assert c.vote("7/1/0", 3, True, "p", 5.0, voter="c") == (True, "p", False)
    assert [vote.result() for vote in voted] == [(True, "p", False)] * 2
    assert lighthouse.values["7/1/0/done"] == "3"  # three voters, whatever the tries


@pytest.mark.parametrize("verdict", ["commit", "abort"])
def test_a_verdict_one_member_read_is_the_verdict_after_the_restart(
    lighthouse: _Lighthouse, verdict: str
) -> None:
    """A read the verdict of its step (and went on: a commit steps its optimizer), B's answer
    was lost with the Lighthouse: B votes again in the new store and waits (longer than a
    first vote) until A, at its next request, tells the store what it read: B's answer is
    A's verdict, never decided twice."""
    a, b = lighthouse.member(), lighthouse.member()
    b_old = VerdictStore("127.0.0.1", lighthouse.port, 10.0)  # B's vote, its answer lost
    if verdict == "commit":
        sent = _Asked(lambda: b_old.vote("8/1/0", 2, True, "p", 5.0, voter="b"))
        assert a.vote("8/1/0", 2, True, "p", 5.0, voter="a") == (True, "p", False)
        sent.result()
    else:  # A's collective failed: its vote aborts the step at once
        assert a.vote("8/1/0", 2, False, "p", 5.0, voter="a")[0] is False
    lighthouse.kill()
    lighthouse.restart()
    b_again = _Asked(lambda: b.vote("8/1/0", 2, True, "p", 1.0, voter="b"))
    _until(lambda: "8/1/0/done/b" in lighthouse.values, "B's vote again in the new store")
    time.sleep(1.5)  # longer than B's first vote would have waited (1 s)
    assert b_again.waiting, "B's vote again waits for the members that may have read more"
    assert a.check([]) and a.reconnects == 1  # A's next request: it tells what it read
    assert b_again.result()[0] is (verdict == "commit")
    assert lighthouse.values["8/1/0/verdict"] == verdict
    b_old.close()


def test_a_member_whose_verdict_a_restarted_run_decided_otherwise_is_told(
    lighthouse: _Lighthouse,
) -> None:
    """A read commit and every other member that read it is lost; the restarted run decides
    the step again without A (B's vote waits out its retry: abort): A, back, is told which
    verdict differs, so that it leaves (it stepped an optimizer the run did not)."""
    told: list[list[str]] = []
    a = lighthouse.member(on_restored=told.append)
    b = lighthouse.member(retry_s=0.5)
    assert a.vote("9/2/0", 1, True, "p", 5.0, voter="a")[0] is True
    lighthouse.kill()
    lighthouse.restart()
    assert b.vote("9/2/0", 2, True, "p", 0.2, voter="b")[0] is False  # waited 0.5 s: abort
    assert a.check([])
    assert told == [["9/2/0/verdict"]]


def test_the_run_s_agreed_values_win_over_a_joiner_s_proposal_after_a_restart(
    lighthouse: _Lighthouse,
) -> None:
    """A joiner proposes its own run id to the new store before the run's members came back:
    the first member back restores the run's, which every later read gets; the run's end
    (FINISHED) and the verdicts it read come back too."""
    a = lighthouse.member()
    assert a.compare_set("agreed/run_id", "", "run-1") == b"run-1"
    assert a.vote("3/1/0", 1, False, "p", 5.0, voter="a")[0] is False  # step 3 abandoned
    assert a.compare_set("finished", "", "12") == b"12"
    lighthouse.kill()
    lighthouse.restart()
    joiner = lighthouse.member()
    assert joiner.compare_set("agreed/run_id", "", "run-2") == b"run-2"  # first here
    assert a.check(["3/1/0/verdict"])  # a's request: it reconnects and restores, then reads
    assert joiner.compare_set("agreed/run_id", "", "run-2") == b"run-1"
    assert lighthouse.values["finished"] == "12"


def test_a_lighthouse_not_back_within_retry_s_is_the_first_error_within_its_bound(
    lighthouse: _Lighthouse,
) -> None:
    a = lighthouse.member(retry_s=0.5)
    lighthouse.kill()
    started = time.monotonic()
    with pytest.raises(ConnectionError):  # reset, or closed: as the kernel saw it
        a.vote("4/1/0", 2, True, "p", 1.0, voter="a")
    assert time.monotonic() - started < 0.5 + 2.0  # its retry, then at most one try's bound
    assert a.reconnects == 0


def test_a_member_keeps_only_its_last_attempts_to_tell() -> None:
    """What a member tells a new store stays small: its last KEPT attempts."""
    from nn_handler.training.fault_tolerance.reconnecting import KEPT

    server = VerdictServer("127.0.0.1", 0)
    try:
        member = ReconnectingVerdicts(
            f"http://127.0.0.1:{server.port - 1}",
            VerdictStore("127.0.0.1", server.port, 5.0),
            1.0,
        )
        for step in range(10):
            member.vote(f"{step}/1/0", 1, step % 2 == 0, "p", 1.0, voter="a")
        member.vote("9/1/0", 1, True, "p", 1.0, voter="a")  # an answer read again
        steps = {key.split("/")[0] for key in member._known}
        assert steps == {str(step) for step in range(10 - KEPT, 10)}
        assert len(member._known) == 3 * KEPT  # each its verdict, place and next quorum
        member.close()
    finally:
        server.close()


class _Manager:
    """torchft's Manager for ``_quorum_once``: its first quorum fails."""

    def __init__(self, failures: int) -> None:
        self.failures, self.quorums = failures, 0
        self._quorum_id = 5
        self._quorum_future: str | None = "failed"  # torchft's future of the last quorum

    def start_quorum(self) -> None:
        self.quorums += 1
        if self.quorums <= self.failures:
            raise RuntimeError("lighthouse quorum failed: deadline has elapsed")
        self._quorum_id, self._quorum_future = 6, None

    def current_step(self) -> int:
        return 3


class _Store:
    """A member's ReconnectingVerdicts whose Lighthouse comes back at the check after a
    failed quorum when ``restarted``."""

    def __init__(self, restarted: bool) -> None:
        self.restarted, self.reconnects, self.checks = restarted, 0, 0

    def check(self, keys: list[str]) -> bool:
        self.checks += 1
        if self.restarted and self.checks == 2:
            self.reconnects += 1
        return False


def _replica(manager: _Manager, store: _Store) -> Any:
    from nn_handler.training.fault_tolerance.replica import Replica

    replica = object.__new__(Replica)
    replica._pulse = NoPulse()
    replica.manager, replica._verdicts = manager, cast(Any, store)
    replica.member_id, replica.lighthouse, replica.min_members = "m0", "http://h:1", 1
    replica.quorum_timeout_s = 5.0
    return replica


def test_a_quorum_the_lighthouse_died_in_is_asked_again_once() -> None:
    """torchft's request for a quorum waits out its timeout when its Lighthouse dies (the new
    one never heard of it): asked again once the member reached a restarted one, with
    torchft's failed quorum dropped; not asked again when the same Lighthouse answered."""
    from nn_handler.errors import DistributedError

    manager = _Manager(failures=1)
    replica = _replica(manager, _Store(restarted=True))
    replica._quorum_once()
    assert manager.quorums == 2 and replica._quorum == 6 and replica._attempt == 0
    manager = _Manager(failures=1)
    replica = _replica(manager, _Store(restarted=False))
    with pytest.raises(DistributedError, match="no agreement on the members of step 3"):
        replica._quorum_once()
    assert manager.quorums == 1 and manager._quorum_future is None  # dropped, not asked again
    manager = _Manager(failures=2)  # restarted, and the second quorum fails too: it stops
    with pytest.raises(DistributedError, match="deadline has elapsed"):
        _replica(manager, _Store(restarted=True))._quorum_once()
    assert manager.quorums == 2


def test_a_member_told_its_verdict_differs_leaves_naming_it_and_builds_a_new_group() -> None:
    from nn_handler.errors import DistributedError

    replica = _replica(_Manager(failures=0), _Store(restarted=False))
    replica._restored([])
    assert replica.manager._quorum_id == -1  # the new Lighthouse's ids start again
    assert replica._ask("the verdicts", lambda: True) is True
    replica._restored(["agreed/run_id", "9/2/0/verdict"])
    with pytest.raises(DistributedError, match=r"decided 9/2/0/verdict otherwise.*Restart it"):
        replica._ask("the verdicts", lambda: True)


class _HungQuorum(_Manager):
    """torchft's Manager whose request for a quorum hangs (its Lighthouse died under it)
    until the request is sent again: torchft's server answers both with the new quorum."""

    def __init__(self) -> None:
        super().__init__(failures=0)
        self.asked_again = threading.Event()
        self._client = self
        self._group_rank, self._step, self._init_sync, self._commit_failures = 0, 3, False, 0
        self._checkpoint_transport = self
        self.requests: list[dict[str, Any]] = []

    def metadata(self) -> str:
        return "transport"

    def _quorum(self, **request: Any) -> None:
        self.requests.append(request)
        self.asked_again.set()

    def start_quorum(self) -> None:
        assert self.asked_again.wait(10), "never asked again: the quorum waited out its timeout"
        super().start_quorum()


def test_a_quorum_whose_lighthouse_was_restarted_under_it_is_asked_again_at_once() -> None:
    """The member reconnects (its Lighthouse restarted) while its quorum is in flight: the
    request is sent again, with the Manager's own arguments, and the quorum in flight
    returns with it (torchft's server answers both), not after quorum_timeout_s."""
    manager = _HungQuorum()
    store = _Store(restarted=False)
    original = store.check

    def check(keys: list[str]) -> bool:
        if store.checks == 2:  # the first look during the quorum: a new Lighthouse
            store.reconnects += 1
        return original(keys)

    store.check = check  # type: ignore[method-assign]
    replica = _replica(manager, store)
    started = time.monotonic()
    replica._quorum_once()
    assert replica._quorum == 6 and time.monotonic() - started < 5.0
    assert manager.requests == [{
        "group_rank": 0, "step": 3, "checkpoint_metadata": "transport", "shrink_only": False,
        "timeout": timedelta(seconds=5.0), "init_sync": False, "commit_failures": 0,
    }]  # fmt: skip


def test_a_quorum_in_flight_is_not_asked_again_while_its_lighthouse_lives() -> None:
    manager = _HungQuorum()
    replica = _replica(manager, _Store(restarted=False))
    threading.Timer(0.8, manager.asked_again.set).start()  # answered by the Lighthouse
    replica._quorum_once()
    assert manager.requests == []


def test_a_running_lighthouse_is_not_restarted_and_supervise_gives_up_after_its_restarts() -> None:
    """Lighthouse.restart refuses one that still runs (two processes on one address), and
    `supervise` stops restarting its Lighthouse after --max-restarts (the members then stop
    after their quorum_timeout_s, with their emergency checkpoints)."""
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance import Lighthouse
    from nn_handler.training.fault_tolerance.supervisor import Supervisor

    with Lighthouse(min_members=1) as running:
        with pytest.raises(DistributedError, match=r"still runs: not restarted"):
            running.restart()
        running.kill()
        supervisor = Supervisor(["t.py", "{member}", "{lighthouse}"], 1, max_restarts=1)
        assert supervisor._restart_lighthouse(running) is running  # 1 of 1
        assert running.poll() is None
        running.kill()
        assert supervisor._restart_lighthouse(running) is None  # no more
        assert supervisor.lighthouse_restarts == 1
