"""The stall watchdog's parts in one process: records and their comparison (property tests),
the ledger, the report, raising on the main thread, and the store protocol between two
watchdogs sharing one in-memory store (the real-process scenarios are in
tests/distributed/test_stall_watchdog.py)."""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch._C._distributed_c10d import HashStore

from nn_handler import (
    CollectiveMismatchError,
    CollectiveStallError,
    LauncherGoneError,
    RankFailedError,
)
from nn_handler.distributed.communicator import Communicator, run_in_threads
from nn_handler.distributed.communicator._watched import collective
from nn_handler.distributed.faults.watchdog import CollectiveLedger, StallWatchdog, WatchdogTiming
from nn_handler.distributed.faults.watchdog.interrupt import MainThreadInterrupt, _class_raising
from nn_handler.distributed.faults.watchdog.ledger import HISTORY
from nn_handler.distributed.faults.watchdog.records import (
    SIGNATURE_CHARS,
    RankState,
    find_mismatch,
    make_record,
    neighbour,
    user_location,
)
from nn_handler.distributed.faults.watchdog.report import (
    diverging_lines,
    mismatch_signatures,
    no_stall,
    stall_report,
    stalled_ranks,
)

signatures = st.sampled_from(
    ["all_reduce(op=sum) float32[4]", "all_reduce(op=sum) int32[4]", "broadcast(src=0) int64[1]"]
)


def _state(rank: int, whats: list[str], *, start: int = 1, **fields: Any) -> RankState:
    records = [make_record(start + i, what, f"train.py:{10 + i}") for i, what in enumerate(whats)]
    return RankState(rank=rank, seq=records[-1].seq if records else 0, records=records,
                     **{"inside": False, "seconds": 1.0, **fields})  # fmt: skip


# ----------------------------------------------------------------- records
@given(st.lists(signatures, max_size=8), st.lists(signatures, max_size=8), st.integers(0, 3))
def test_a_mismatch_is_found_exactly_where_two_ranks_issued_different_calls(
    mine: list[str], theirs: list[str], shift: int
) -> None:
    first, second = _state(0, mine), _state(1, theirs, start=1 + shift)
    differing = [
        seq
        for seq, what in enumerate(mine, start=1)
        if 0 <= seq - 1 - shift < len(theirs) and theirs[seq - 1 - shift] != what
    ]
    found = find_mismatch(first, second)
    if not differing:
        assert found is None
    else:
        assert found is not None and found[0].seq == found[1].seq == differing[0]
        assert found[0].what != found[1].what


@given(st.lists(signatures, max_size=5), st.booleans(), st.text(max_size=50))
def test_a_state_survives_its_wire_form(whats: list[str], inside: bool, stack: str) -> None:
    state = _state(3, whats, inside=inside, stack=stack, where_now="x.py:1 in f")
    assert RankState.from_bytes(state.to_bytes()) == state


def test_a_record_keeps_a_short_text_and_the_digest_of_the_whole() -> None:
    long = "all_reduce(op=sum) {" + ", ".join(f"'k{i}': float32[4]" for i in range(60)) + "}"
    other = long.replace("k59", "k60")
    assert len(make_record(1, long, "").what) == SIGNATURE_CHARS
    assert make_record(1, long, "").digest != make_record(1, other, "").digest


def test_neighbours_form_one_ring() -> None:
    assert [neighbour(r, 4) for r in range(4)] == [1, 2, 3, 0]
    assert neighbour(0, 2) == 1 and neighbour(1, 2) == 0


def test_the_location_is_the_callers_line_outside_the_library() -> None:
    ledger = CollectiveLedger(0)
    ledger.enter("barrier()")
    line = test_the_location_is_the_callers_line_outside_the_library.__code__.co_firstlineno + 2
    assert (
        ledger.snapshot()[0]
        .records[-1]
        .where.endswith(
            f"test_watchdog.py:{line} in test_the_location_is_the_callers_line_outside_the_library"
        )
    )
    assert user_location().startswith("tests/unit/test_watchdog.py:")


def test_every_module_of_the_package_counts_as_the_library() -> None:
    """The report names the user's line, skipping frames in any nn_handler module, wherever
    the watchdog's own files sit in the package (a frame in checkpoint/ once counted as the
    user's after the watchdog moved a folder deeper)."""
    import nn_handler
    import nn_handler.checkpoint.registry
    import nn_handler.training.trainer
    from nn_handler.distributed.faults.watchdog import records

    for module in (nn_handler, nn_handler.checkpoint.registry, nn_handler.training.trainer):
        assert records.is_library(str(module.__file__)), module.__name__
    assert not records.is_library(__file__)


# ----------------------------------------------------------------- ledger
def test_the_tracker_counts_collectives_and_knows_when_it_is_inside_one() -> None:
    ledger = CollectiveLedger(1)
    assert ledger.snapshot()[0].seq == 0
    for _ in range(HISTORY + 5):
        ledger.enter("all_reduce(op=sum) float32[4]")
        ledger.leave()
    with ledger.region("training step (DDPStrategy: forward, backward)"):
        state, patient = ledger.snapshot()
        assert state.inside and not patient and state.seq == HISTORY + 6
    state, _ = ledger.snapshot()
    assert not state.inside and len(state.records) == HISTORY
    assert state.records[0].seq == 7  # the oldest ones are dropped
    with ledger.patient():
        ledger.enter("barrier()")
        assert ledger.snapshot()[1]  # inside a patient collective
        ledger.leave()
    ledger.enter("barrier()")
    assert not ledger.snapshot()[1]


def test_after_an_incident_no_collective_is_issued() -> None:
    ledger = CollectiveLedger(0)
    ledger.incident = CollectiveStallError("the report", [1])
    with pytest.raises(CollectiveStallError, match="the report"):
        ledger.enter("barrier()")
    assert ledger.incident_raised and ledger.seq == 0


def test_each_public_collective_is_recorded_once() -> None:
    def calls(comm: Communicator) -> list[str]:
        ledger = CollectiveLedger(comm.rank)
        comm._watch = ledger
        comm.barrier()
        comm.all_reduce({"a": torch.ones(2)}, op="mean")
        comm.all_reduce_(torch.ones(3))
        comm.all_reduce_async(torch.ones(1))()
        comm.broadcast(torch.ones(2), src=1)
        comm.all_gather(torch.ones(comm.rank + 1))
        comm.gather(torch.ones(1), dst=0)
        comm.gather_into_tensor(torch.ones(1))  # through all_gather: one collective
        comm.raise_if_any_failed(None, "check")
        comm.reduce_dict({"loss": 1.0})
        comm.shared_random_seed()
        comm.all_gather_object({"rank": comm.rank})
        comm.gather_object(comm.rank)
        comm.broadcast_object("x")
        state, _ = ledger.snapshot()
        assert state.seq == len(state.records) and not state.inside
        return [record.what.split("(")[0] for record in state.records]

    names = run_in_threads(calls, 2)
    assert names[0] == names[1]
    # One record per call; an object collective's receivers then agree on unpickling (their
    # own collective, numbered like the others on every rank).
    agree = "raise_if_any_failed"
    assert names[0] == [
        *("barrier", "all_reduce", "all_reduce_", "all_reduce_async", "broadcast"),
        *("all_gather", "gather", "all_gather", agree, "reduce_dict", "shared_random_seed"),
        *("all_gather_object", agree, "gather_object", agree, "broadcast_object", agree),
    ]


# ----------------------------------------------------------------- report
def test_the_stall_report_blames_the_rank_that_has_not_arrived() -> None:
    waiting = _state(0, ["step", "step"], inside=True, seconds=7.5)
    running = _state(
        1,
        ["step"],
        seconds=8.0,
        stack='  File "train.py", line 88, in after_step\n    time.sleep(60)\n',
        where_now="train.py:88 in after_step",
    )
    assert stalled_ranks({0: waiting, 1: running}) == (2, [1])
    text, blamed = stall_report({0: waiting, 1: running}, 0, 5.0, {2: "its process is gone"})
    assert blamed == [1, 2]
    first = text.splitlines()[0]
    assert "rank 0 waited 7.5 s (stall_timeout 5 s)" in first and "ranks 1,2 have not" in first
    assert "now at train.py:88 in after_step" in text and "time.sleep(60)" in text
    assert "rank 2: did not answer: its process is gone" in text


def test_the_report_points_at_a_collective_issued_from_different_lines() -> None:
    first = _state(0, ["a", "a"])
    second = RankState(
        1, 2, False, 1.0, [make_record(1, "a", "x.py:1"), make_record(2, "a", "x.py:7")]
    )
    first.records = [make_record(1, "a", "x.py:1"), make_record(2, "a", "x.py:5")]
    found = diverging_lines({0: first, 1: second})
    assert found is not None and found[0] == 2
    assert {found[1].where, found[2].where} == {"x.py:5", "x.py:7"}


def test_mismatch_signatures_list_every_rank() -> None:
    states = {0: _state(0, ["all_reduce f32"]), 1: _state(1, ["all_reduce i32"])}
    texts = mismatch_signatures(states, 1, 3)
    assert texts[0] == "all_reduce f32 at train.py:10"
    assert texts[1] == "all_reduce i32 at train.py:10" and texts[2] == "(did not answer)"


# ----------------------------------------------------------------- raising on the main thread
def _raise_soon(ledger: CollectiveLedger, interrupt: MainThreadInterrupt) -> None:
    def later() -> None:
        time.sleep(0.2)
        ledger.incident = CollectiveStallError("stalled", [1])
        interrupt.deliver()

    threading.Thread(target=later, daemon=True).start()


def test_the_main_thread_raises_even_inside_a_long_sleep() -> None:
    ledger = CollectiveLedger(0)
    interrupt = MainThreadInterrupt(ledger)
    interrupt.install()
    try:
        started = time.monotonic()
        _raise_soon(ledger, interrupt)
        with pytest.raises(CollectiveStallError, match="stalled"):
            time.sleep(30)
        assert time.monotonic() - started < 5 and ledger.incident_raised
    finally:
        interrupt.uninstall()
    import signal

    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


def test_without_the_handler_the_error_arrives_as_an_async_exception() -> None:
    ledger = CollectiveLedger(0)
    interrupt = MainThreadInterrupt(ledger)  # not installed: the fallback
    _raise_soon(ledger, interrupt)
    deadline = time.monotonic() + 10
    with pytest.raises(CollectiveStallError, match="stalled") as info:
        while time.monotonic() < deadline:  # Python code: interrupted at a bytecode
            sum(range(100))
    assert info.value.ranks == [1]
    # It pickles as the library's own class (ranks send errors to each other).
    copy = pickle.loads(pickle.dumps(info.value))
    assert type(copy) is CollectiveStallError and copy.report == "stalled"
    assert issubclass(_class_raising(CollectiveMismatchError("x", ["a"])), CollectiveMismatchError)


# ----------------------------------------------------------------- two watchdogs, one store
class RecordingInterrupt(MainThreadInterrupt):
    def __init__(self) -> None:
        self.delivered = 0

    def install(self) -> None: ...

    def uninstall(self) -> None: ...

    def deliver(self) -> None:
        self.delivered += 1


def _pair(stall_timeout: float) -> tuple[list[CollectiveLedger], list[StallWatchdog]]:
    store = HashStore()
    timing = WatchdogTiming(stall_timeout, interval=0.05, answer_wait=2.0, grace=600.0)
    ledgers = [CollectiveLedger(rank) for rank in range(2)]
    watchdogs = [
        StallWatchdog(t, store, 2, timing, interrupt=RecordingInterrupt()) for t in ledgers
    ]
    return ledgers, watchdogs


def _watch(ledgers: list[CollectiveLedger], watchdogs: list[StallWatchdog], seconds: float) -> None:
    """Run the watchdogs until every ledger has an incident, or for ``seconds``."""
    for watchdog in watchdogs:
        watchdog.start()
    try:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(t.incident is None for t in ledgers):
            time.sleep(0.02)
    finally:
        for watchdog in watchdogs:
            watchdog.stop()


def test_two_watchdogs_report_a_stall_to_both_ranks() -> None:
    ledgers, watchdogs = _pair(stall_timeout=0.3)
    for ledger in ledgers:
        ledger.enter("all_reduce(op=sum) float32[4]")
        ledger.leave()
    ledgers[0].enter("all_reduce(op=sum) float32[4]")  # rank 0 waits; rank 1 never comes
    _watch(ledgers, watchdogs, 10)
    errors = [t.incident for t in ledgers]
    assert all(isinstance(e, CollectiveStallError) for e in errors), errors
    assert str(errors[0]) == str(errors[1]) and errors[0].ranks == [1]  # type: ignore[union-attr]
    assert "rank 0 waited" in str(errors[0]) and "rank 1 has not arrived" in str(errors[0])
    # Rank 1 runs Python code: it is interrupted; rank 0 waits in a collective: it is not.
    assert watchdogs[1]._interrupt.delivered == 1  # type: ignore[attr-defined]
    assert watchdogs[0]._interrupt.delivered == 0  # type: ignore[attr-defined]


def test_two_watchdogs_find_a_mismatch_without_any_collective() -> None:
    ledgers, watchdogs = _pair(stall_timeout=60.0)
    ledgers[0].enter("all_reduce(op=sum) float32[4]")
    ledgers[1].enter("all_reduce(op=sum) int32[4]")
    for ledger in ledgers:
        ledger.leave()
    _watch(ledgers, watchdogs, 10)
    for ledger in ledgers:
        assert isinstance(ledger.incident, CollectiveMismatchError), ledger.incident
        text = str(ledger.incident)
        assert "collective #1" in text and "float32[4]" in text and "int32[4]" in text


def test_patient_collectives_and_agreeing_ranks_raise_nothing() -> None:
    ledgers, watchdogs = _pair(stall_timeout=0.2)
    for ledger in ledgers:
        ledger.enter("barrier()")
        ledger.leave()
    with ledgers[0].patient():
        ledgers[0].enter("barrier()")  # rank 0 waits for rank 1's long preparation
    _watch(ledgers, watchdogs, 1.0)
    assert ledgers[0].incident is None and ledgers[1].incident is None


def test_an_unwatched_communicator_marks_nothing() -> None:
    from nn_handler import NullCommunicator

    comm = NullCommunicator()
    assert not comm.watching
    with comm.watched("training step"), comm.patient():
        assert comm.all_reduce(2.0) == 2.0


def test_a_rank_takes_over_when_the_reporting_rank_dies_before_its_report(
    capfd: pytest.CaptureFixture[str],
) -> None:
    store = HashStore()
    timing = WatchdogTiming(60.0, interval=0.05, answer_wait=0.3, grace=600.0)
    ledger = CollectiveLedger(1)
    watchdog = StallWatchdog(ledger, store, 2, timing, interrupt=RecordingInterrupt())
    ledger.enter("all_reduce(op=sum) float32[4]")  # waiting for rank 0, which opened and died
    store.add("nn_handler/watch/open", 1)
    store.set("nn_handler/watch/opened", '{"kind": "stall", "seq": 1, "rank": 0}')
    started = time.monotonic()
    _watch([ledger], [watchdog], 10)
    assert isinstance(ledger.incident, CollectiveStallError), ledger.incident
    assert time.monotonic() - started > timing.answer_wait  # it waited for the reporter first
    text = ledger.incident.report
    assert text.startswith("Collective stall: rank 1 waited") and "rank 0: did not answer" in text
    assert ledger.incident.ranks == [0]
    # The rank that made the report printed it, once; the error points there.
    assert ledger.incident.printed_by == 1
    assert str(ledger.incident).splitlines()[0] == text.splitlines()[0]
    assert capfd.readouterr().err.count(f"[nn_handler rank 1] {text}") == 1
    # The report was written once, and a later writer would get the same one back.
    assert store.compare_set("nn_handler/watch/report", "", "{}") == store.get(
        "nn_handler/watch/report"
    )


def test_the_applications_own_sigusr2_handler_is_left_alone() -> None:
    import signal

    seen: list[int] = []
    previous = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    try:
        ledger = CollectiveLedger(0)
        interrupt = MainThreadInterrupt(ledger)
        interrupt.install()  # the application's handler stays; delivery is asynchronous
        assert signal.getsignal(signal.SIGUSR2) is not interrupt._on_signal
        _raise_soon(ledger, interrupt)
        deadline = time.monotonic() + 10
        with pytest.raises(CollectiveStallError):
            while time.monotonic() < deadline:
                sum(range(100))
        assert seen == []  # never signalled
        interrupt.uninstall()
        assert signal.getsignal(signal.SIGUSR2) is not signal.SIG_DFL
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_off_the_main_thread_nothing_is_installed() -> None:
    import signal

    interrupt = MainThreadInterrupt(CollectiveLedger(0))
    worker = threading.Thread(target=interrupt.install)
    worker.start()
    worker.join()
    assert signal.getsignal(signal.SIGUSR2) == signal.SIG_DFL


# ----------------------------------------------------------------- slow is not stalled
def _waiting(rank: int, seq: int, inside: bool, busy: bool = False) -> RankState:
    return RankState(rank=rank, seq=seq, inside=inside, seconds=9.0, busy=busy)


def test_a_wait_is_no_stall_when_every_rank_is_in_it_or_working_patiently() -> None:
    everyone = {r: _waiting(r, 7, True) for r in range(3)}
    assert no_stall(everyone, 7, 3) == "every rank is in it: a slow step, not a stall"
    patient = {**everyone, 2: _waiting(2, 6, False, busy=True)}
    assert no_stall(patient, 7, 3) == "rank 2 is working inside Communicator.patient()"
    both = {**patient, 1: _waiting(1, 6, False, busy=True)}
    assert no_stall(both, 7, 3) == "ranks 1,2 are working inside Communicator.patient()"


def test_a_missing_rank_without_patience_is_a_stall() -> None:
    everyone = {r: _waiting(r, 7, True) for r in range(3)}
    assert no_stall({**everyone, 2: _waiting(2, 6, False)}, 7, 3) is None  # running, not patient
    assert no_stall({**everyone, 2: _waiting(2, 6, True)}, 7, 3) is None  # an earlier collective
    del everyone[2]
    assert no_stall(everyone, 7, 3) is None  # a rank that published nothing


@given(
    st.lists(st.tuples(st.integers(5, 8), st.booleans(), st.booleans()), min_size=2, max_size=6),
    st.booleans(),
)
def test_no_stall_holds_exactly_when_nobody_unexplained_is_missing(
    rows: list[tuple[int, bool, bool]], drop_one: bool
) -> None:
    world = len(rows)
    states = {r: _waiting(r, seq, inside, busy) for r, (seq, inside, busy) in enumerate(rows)}
    if drop_one:
        del states[world - 1]
    seq = 7
    explained = (
        all((s.inside and s.seq == seq) or s.busy for s in states.values()) and len(states) == world
    )
    assert (no_stall(states, seq, world) is not None) == explained


def test_a_stall_report_blaming_no_rank_says_every_rank_is_in_it() -> None:
    record = make_record(3, "all_reduce(op=sum) float32[4]", "train.py:9 in step")
    states = {
        r: RankState(rank=r, seq=3, inside=True, seconds=2.0, records=[record]) for r in (0, 1)
    }
    text, blamed = stall_report(states, 0, 1.0, {})
    assert blamed == [] and "every rank is in it." in text.splitlines()[0]
    assert "have not" not in text and "no rank" not in text


class _Collectives:
    """A communicator's collectives as the ``collective`` decorator sees them."""

    def __init__(self, watch: CollectiveLedger, error: Exception) -> None:
        self._watch, self.error = watch, error

    @collective
    def all_reduce(self) -> None:
        raise self.error


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Connection closed by peer [127.0.0.1]:29500"),
        RankFailedError("all_reduce", {0: "the process group's store no longer answers"}),
    ],
    ids=["backend error", "a peer named as failed"],
)
def test_a_collective_that_fails_after_the_launcher_went_raises_launcher_gone(
    error: Exception,
) -> None:
    """torchrun's agent killed while this rank was already inside a collective: the peer that
    noticed first stopped (LauncherGoneError), so this rank's collective fails as if that
    peer had died. The error is this rank's LauncherGoneError too, not a failure blamed on the
    peer, once, as every rank's is (tests/distributed/test_orphaned_workers.py)."""
    ledger = CollectiveLedger(rank=1)
    comm = _Collectives(ledger, error)
    with pytest.raises(type(error)):  # the launcher still there: the error as it was
        comm.all_reduce()
    gone = LauncherGoneError("rank 1: the launcher that started this worker is gone")
    ledger.launcher_check = lambda: setattr(ledger, "incident", gone)
    with pytest.raises(LauncherGoneError) as raised:
        comm.all_reduce()
    assert raised.value is gone and raised.value.__cause__ is None and ledger.incident_raised
