"""The Lighthouse killed in the middle of a run and started again at its address (issue 73):
under `nn-handler supervise` (its loaded spare listens at once), and by hand (a cluster's
restart, 2 s later, while the members that lost one of theirs wait for a quorum). No member
exits or restarts; every member ends with the bits of a run that never failed, every step
committed with all its samples; the run's pause at each kill is bounded. Real processes: the
members are tests/scripts/ft_member.py, the Lighthouse a process of its own."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from nn_handler.training.fault_tolerance import Lighthouse
from tests.distributed.test_step_fault_tolerance import ROOT, SCRIPT, _Members
from tests.ft_helpers import BATCH, batch_of, digest, unfailed
from tests.interpreters import python_path
from tests.timeouts import scaled, scaled_now

pytestmark = pytest.mark.distributed

#: The issue's bound on the run's pause at a Lighthouse's death (p95 of its campaign).
PAUSE_S = 5.0


def _reports(run: Path, members: list[str], steps: int) -> dict[str, dict[str, Any]]:
    """Each member's report, checked: the unfailed run's bits, never stopped, each step it
    committed once and whole, in order; every step committed by some member (one left out of
    a quorum receives a live member's state instead of a step)."""
    expected, reports, committed = digest(unfailed(steps)), {}, set()
    for member in members:
        report = json.loads((run / f"{member}.json").read_text())
        assert report["stopped"] == "" and report["digest"] == expected, (member, report)
        ledger = report["ledger"]
        assert [entry[0] for entry in ledger] == sorted({entry[0] for entry in ledger}), member
        for step, samples, id_sum, _members, _when in ledger:
            assert (samples, id_sum) == (BATCH, sum(batch_of(step))), (member, step)
            committed.add(step)
        reports[member] = report
    assert committed == set(range(steps))
    return reports


def _longest_pause(report: dict[str, Any]) -> float:
    times = [entry[4] for entry in report["ledger"]]
    return float(max(b - a for a, b in itertools.pairwise(times)))


def _lighthouse_of(supervisor: int) -> psutil.Process:
    """The supervisor's Lighthouse that listens (not its loaded spare, which waits to)."""
    for child in psutil.Process(supervisor).children():
        try:
            listening = any(c.status == "LISTEN" for c in child.net_connections("inet"))
            if listening and "lighthouse" in child.cmdline():
                return child
        except psutil.Error:  # one that just ended
            continue
    raise AssertionError("the supervisor has no Lighthouse listening")


def test_a_lighthouse_killed_three_times_under_supervise_stops_no_member(tmp_path: Path) -> None:
    """`nn-handler supervise --members 3`: its Lighthouse SIGKILLed before steps 12, 30 and
    45 (wherever each member is in its step: computing, voting, reading the verdict). The
    supervisor restarts it at the same address each time (one line each); no member exits or
    restarts; all end with the unfailed run's bits; the run's longest pause stays within the
    issue's 5 s."""
    steps, kills = 60, (12, 30, 45)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(ROOT),
           "RUST_LOG": "error", "FT_STEPS": str(steps), "FT_STEP_S": "0.1",
           "FT_MIN_MEMBERS": "1"}  # fmt: skip
    command = [sys.executable, "-m", "nn_handler.cli", "supervise", "--members", "3",
               "--join-timeout-s", "10", "--", sys.executable, str(SCRIPT), "{lighthouse}",
               str(tmp_path), "{member}", "3"]  # fmt: skip
    supervisor = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # everything killed at the end, whatever happened
    )  # fmt: skip
    deadline = time.monotonic() + scaled(90)
    try:
        for step in kills:
            progress = tmp_path / "m0.step"
            while not (progress.exists() and int(progress.read_text() or 0) >= step):
                assert time.monotonic() < deadline and supervisor.poll() is None, "no progress"
                time.sleep(0.01)
            _lighthouse_of(supervisor.pid).kill()
            time.sleep(0.3)  # its end seen by the supervisor, before the next kill
        output, _ = supervisor.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except (subprocess.TimeoutExpired, AssertionError):
        os.killpg(supervisor.pid, signal.SIGKILL)
        pytest.fail(f"the run did not go on (a hang):\n{supervisor.communicate()[0][-6000:]}")
    assert supervisor.returncode == 0, output
    restarted = [line for line in output.splitlines() if "the Lighthouse killed by" in line]
    assert len(restarted) == 3, output
    assert all("restarted at http://127.0.0.1:" in line for line in restarted), output
    assert "; restarted (" not in output and "Traceback" not in output, output
    reports = _reports(tmp_path, ["m0", "m1", "m2"], steps)
    for member, report in reports.items():
        # The documented bound (not a speed target), scaled by the load now.
        assert _longest_pause(report) < scaled_now(PAUSE_S), (member, report["ledger"])


def test_a_lighthouse_a_cluster_restarts_after_a_member_died_lets_the_others_go_on(
    tmp_path: Path,
) -> None:
    """Members started by hand; m1 dies before step 8's sum and the Lighthouse is killed at
    that moment, started again by hand 2 s later (no spare: a cluster's restart). m0 and m2,
    whose step 8 failed, wait for a Lighthouse to agree on their members (their quorum
    timeout is 10 s: the new Lighthouse's cold start, a new interpreter importing torch, took
    over 3 s once on a loaded 2-core machine, after the 2 s, and 5 s ran out), get it from the
    new one, redo step 8 without m1 and end with the unfailed run's bits."""
    steps = 30
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    deadline = time.monotonic() + scaled(90)
    with lighthouse, _Members(lighthouse.address, tmp_path) as members:
        for member in ("m0", "m1", "m2"):
            kill = ("8", "before") if member == "m1" else ()
            members.start(member, 3, *kill, least=1, FT_STEPS=str(steps), FT_STEP_S="0.1",
                          FT_QUORUM_TIMEOUT_S="10")  # fmt: skip
        died = tmp_path / "m1.died"
        while not died.exists():
            assert time.monotonic() < deadline, f"m1 never died:\n{members.logs()}"
            time.sleep(0.005)
        lighthouse.kill()
        time.sleep(2.0)
        lighthouse.restart()
        codes = members.wait(deadline)
    assert codes == {"m0": 0, "m1": -signal.SIGKILL, "m2": 0}, members.logs()
    reports = _reports(tmp_path, ["m0", "m2"], steps)
    assert reports["m0"]["redone"] or reports["m2"]["redone"], members.logs()  # step 8 again


def test_a_quorum_in_flight_when_its_lighthouse_dies_is_asked_again_of_the_new_one(
    tmp_path: Path,
) -> None:
    """m0 and m1 wait before step 6; m2 asks to join and its request for a quorum is at the
    Lighthouse (which waits for the others) when the Lighthouse is killed and restarted at
    once. torchft's server would wait out the request's timeout (5 s) without asking the new
    Lighthouse; the member sends its request again there: once the others are released, m2
    joins within a second or two, not after 5 s, and all end with the unfailed bits."""
    steps, hold = 40, 6
    deadline = time.monotonic() + scaled(90)
    lighthouse = Lighthouse(
        min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0, standby=True
    )
    with lighthouse, _Members(lighthouse.address, tmp_path) as members:
        for member in ("m0", "m1"):
            members.start(member, 2, hold=(hold,), least=1, FT_STEPS=str(steps), FT_STEP_S="0.1")
        members.wait_for("m0", hold, deadline)
        now = tmp_path / "now"
        now.touch()  # its quorum asked at once (and m2.asked made just before)
        members.start("m2", 0, least=1, FT_STEPS=str(steps), FT_STEP_S="0.1",
                      FT_QUORUM_AFTER=str(now))  # fmt: skip
        while not (tmp_path / "m2.asked").exists():
            assert time.monotonic() < deadline, f"m2 never asked:\n{members.logs()}"
            time.sleep(0.01)
        time.sleep(0.5)  # its request at the Lighthouse, which waits for m0 and m1
        lighthouse.kill()
        lighthouse.restart()
        released = time.time()
        members.release(hold, deadline)
        codes = members.wait(deadline)
    assert codes == {"m0": 0, "m1": 0, "m2": 0}, members.logs()
    reports = _reports(tmp_path, ["m0", "m1", "m2"], steps)
    joined = reports["m2"]["ledger"][0][4]  # its first commit
    # Asked again: well under the 5 s its first request would have waited (a bound, scaled
    # by the load now; not a speed target).
    assert joined - released < scaled_now(2.5), (joined - released, members.logs())
