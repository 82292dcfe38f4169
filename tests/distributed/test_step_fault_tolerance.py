"""Per-step fault tolerance (nn_handler/training/fault_tolerance/) with real processes: members
of a run SIGKILLed in a step, before and after its sum, hung, killed two at once, a member
joining mid-run, the Lighthouse killed, an NNHandler run losing two of its three members (its
shared CSV tracker written once per step across takeovers), a run with a floating-point sum
losing a member to a kill and one to a preemption, every member preempted and the run restarted,
fewer than min_members stopping the run with emergency checkpoints, and a spare taking over.
The others go on in their processes, redo what was abandoned, and end with the same bits as a
run that never failed (with a float sum: its weights to float tolerance); every step is
committed once, with all of its samples.
(tests/scripts/ft_member.py and ft_trainer_member.py are members; the Lighthouse is a process
of its own.)"""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchft")

from nn_handler.training.fault_tolerance import Lighthouse
from tests import netns
from tests.ft_helpers import BATCH, STEPS, batch_of, digest, unfailed
from tests.interpreters import python_path
from tests.timeouts import scaled, scaled_now

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ft_member.py"
ROOT = SCRIPT.parents[2]


class _Members:
    """The member processes of one run, each logging to RUN/<id>.log; all killed on exit."""

    def __init__(self, lighthouse: str, run: Path, script: Path = SCRIPT) -> None:
        self.lighthouse, self.run, self.script = lighthouse, run, script
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self,
        member: str,
        starters: int,
        *kill: str,
        hold: tuple[int, ...] = (),
        least: int = 2,
        cut_off: tuple[Path, list[int]] | None = None,
        **env: str,
    ) -> None:
        """Start ``member``; it waits before each step in ``hold`` until :meth:`release`.
        ``cut_off`` (a folder, ports): in a network namespace of its own, reaching only those
        ports of 127.0.0.1 (tests/netns.py's bridge of the folder)."""
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
               "PYTHONPATH": python_path(ROOT), "RUST_LOG": "error",
               "FT_HOLD_AT": ",".join(map(str, hold)),
               "FT_MIN_MEMBERS": str(least), **env}  # fmt: skip
        command = [sys.executable, str(self.script), self.lighthouse, str(self.run), member]
        if cut_off is not None:
            command = netns.cut_off(*cut_off, command[1:])
        with open(self.run / f"{member}.log", "wb") as log:
            self.procs[member] = subprocess.Popen(
                [*command, str(starters), *kill], env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def logs(self) -> str:
        return "\n".join(
            f"--- {m} (exit {p.poll()}):\n{(self.run / f'{m}.log').read_text()[-3000:]}"
            for m, p in self.procs.items()
        )

    def wait_for(self, member: str, step: int, deadline: float) -> None:
        progress = self.run / f"{member}.step"
        while not (progress.exists() and int(progress.read_text() or 0) >= step):
            if time.monotonic() > deadline or self.procs[member].poll() is not None:
                pytest.fail(f"{member} never reached step {step}:\n{self.logs()}")
            time.sleep(0.02)

    def release(self, step: int, deadline: float, once_ready: str = "") -> None:
        """Let the members held before ``step`` go on, once ``once_ready`` (if given) has its
        replica (it heartbeats to the Lighthouse, so the quorum at ``step`` waits for it)."""
        while once_ready and not (self.run / f"ready-{once_ready}").exists():
            if time.monotonic() > deadline or self.procs[once_ready].poll() is not None:
                pytest.fail(f"{once_ready} never had its replica:\n{self.logs()}")
            time.sleep(0.02)
        (self.run / f"release-{step}").touch()

    def wait(self, deadline: float, *only: str) -> dict[str, int]:
        for member, proc in self.procs.items():
            if only and member not in only:
                continue
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pytest.fail(f"{member} did not finish in time (a hang):\n{self.logs()}")
        return {m: p.returncode for m, p in self.procs.items() if not only or m in only}

    def __enter__(self) -> _Members:
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGKILL)
            proc.wait()


def _check_ledger(ledger: list[list[int]], first: int, end: int = STEPS) -> None:
    """Steps ``first``..``end``-1 committed once each, in order, each with all its samples."""
    assert [entry[0] for entry in ledger] == list(range(first, end))
    for step, samples, id_sum, _members, _when in ledger:
        assert (samples, id_sum) == (BATCH, sum(batch_of(step))), f"step {step}"


def test_members_killed_in_a_step_are_replaced_without_a_restart_and_the_bits_hold(
    tmp_path: Path,
) -> None:
    """m1 dies before step a's sum (the others' sum fails: they vote abort and redo the step
    without it), m3 joins after it while m2 lives (it receives the state, checked, and trains
    steps with all three: m0 and m2 wait before step b - 2 until it is up), m2 dies after step b's
    sum, before its vote (the others had the whole sum, yet wait for its vote, abandon the
    step and redo it: no member commits a step that another could not). m0 and m3 end with
    the bits of a run that never failed, every step committed once."""
    seed = int(os.environ.get("NN_HANDLER_FT_SEED", "51"))
    rng = random.Random(seed)
    a = rng.randint(2, 7)
    b = rng.randint(a + 6, STEPS - 4)
    deadline = time.monotonic() + scaled(90)
    with (
        Lighthouse(min_members=2, join_timeout_s=10.0, heartbeat_timeout_s=1.0) as lighthouse,
        _Members(lighthouse.address, tmp_path) as members,
    ):
        # m0 and m2 wait before step b - 2 until m3 is up, so that m3 joins while m2 lives
        # (on a slow machine it once started so late that it joined at step b, and the test
        # checked nothing of the join beside a live m2).
        members.start("m0", 3, hold=(b - 2,))
        members.start("m1", 3, str(a), "before")
        members.start("m2", 3, str(b), "after", hold=(b - 2,))
        members.wait_for("m0", a + 1, deadline)
        members.start("m3", 0)
        members.release(b - 2, deadline, once_ready="m3")
        codes = members.wait(deadline)
    assert codes == {"m0": 0, "m1": -signal.SIGKILL, "m2": -signal.SIGKILL, "m3": 0}, (
        f"seed {seed} (a={a}, b={b}):\n{members.logs()}"
    )
    reports = {m: json.loads((tmp_path / f"{m}.json").read_text()) for m in ("m0", "m3")}
    expected = digest(unfailed())
    assert reports["m0"]["digest"] == expected and reports["m3"]["digest"] == expected
    _check_ledger(reports["m0"]["ledger"], 0)
    joined = reports["m3"]["ledger"][0][0]
    assert joined > a, "m3 started after step a: it joined mid-run"
    _check_ledger(reports["m3"]["ledger"], joined)
    assert reports["m0"]["redone"] >= 1  # step a, abandoned when m1 died before its sum
    sizes = {entry[0]: entry[3] for entry in reports["m0"]["ledger"]}
    assert sizes[a] == 2 and sizes[STEPS - 1] == 2
    # m3 joined while m2 lived: a step between m3's join and m2's death had all three (the
    # starters' first steps, which also had three, are before ``joined``).
    assert joined < b and any(sizes[step] == 3 for step in range(joined, b)), (sizes, joined)
    for member, report in reports.items():  # every socket but torch's own store
        assert report["listening"], member  # (an empty list would pass the next line)
        assert all(a.startswith("127.0.0.1:") for a in report["listening"]), member


def test_a_joiner_whose_quorum_request_arrives_after_the_others_agreed_still_joins(
    tmp_path: Path,
) -> None:
    """A joiner asks to join, and its request for a quorum reaches the Lighthouse 1.5 s later
    (a loaded machine's delay: seen in a fresh-clone run, where a restarted member waited
    for its quorum until its timeout and exited 1). The others, told of the join, agree on
    their members before the request is there (without the joiner), then never again while
    no step fails: the joiner must ask again while it waits, and joins; every member ends
    with the unfailed bits."""
    steps, hold = 160, 3
    deadline = time.monotonic() + scaled(90)
    with (
        Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0) as lighthouse,
        _Members(lighthouse.address, tmp_path) as members,
    ):
        for member in ("m0", "m1"):
            members.start(member, 2, hold=(hold,), least=1, FT_STEPS=str(steps))
        members.wait_for("m0", hold, deadline)
        members.start("m2", 0, least=1, FT_STEPS=str(steps), FT_LATE_QUORUM_S="1.5")
        members.release(hold, deadline, once_ready="m2")
        codes = members.wait(deadline)
    assert codes == {"m0": 0, "m1": 0, "m2": 0}, members.logs()
    expected = digest(unfailed(steps))
    joined = 0
    for member in ("m0", "m1", "m2"):
        report = json.loads((tmp_path / f"{member}.json").read_text())
        assert report["digest"] == expected, (member, members.logs())
        first = report["ledger"][0][0]
        joined = first if member == "m2" else joined
        _check_ledger(report["ledger"], first, steps)
    assert hold < joined < steps - 1, joined  # m2 joined mid-run, and trained with the others


def test_a_member_cut_off_from_the_others_but_reaching_the_lighthouse_leaves_and_they_go_on(
    tmp_path: Path,
) -> None:
    """Issue 69, item 19, as a real partition: m2 runs in a network namespace of its own
    whose only way out is a bridge to the Lighthouse's two ports, and joins m0 and m1 mid-run.
    The Lighthouse puts it in their quorum (it asks, it sends heartbeats), and the group's
    set-up fails on every member (before: again at every quorum until ``quorum_timeout_s``,
    then the whole run stopped). They probe each other: m0 and m1 reach each other and go on
    at once; m2 reached neither, learns that both report it unreachable, and leaves with one
    line naming them. m0 and m1 end with the unfailed bits, every step once, all with two."""
    why = netns.why_no_namespace()
    if why:
        pytest.skip(f"no network namespace here: {why}")
    hold = 5
    deadline = time.monotonic() + scaled(90)
    sockets = Path(tempfile.mkdtemp(prefix="ns", dir="/tmp"))  # a Unix socket's path is short
    with (
        Lighthouse(min_members=2, join_timeout_s=10.0, heartbeat_timeout_s=1.0) as lighthouse,
        _Members(lighthouse.address, tmp_path) as members,
    ):
        port = int(lighthouse.address.rsplit(":", 1)[1])
        bridge = netns.UnixBridge(sockets, [port, port + 1])  # the verdicts' store: port + 1
        for member in ("m0", "m1"):
            members.start(member, 2, hold=(hold,), FT_QUORUM_TIMEOUT_S="20")
        members.wait_for("m0", hold, deadline)
        members.start("m2", 0, cut_off=(sockets, [port, port + 1]), FT_QUORUM_TIMEOUT_S="20")
        members.release(hold, deadline, once_ready="m2")
        codes = members.wait(deadline)
        bridge.close()
    shutil.rmtree(sockets, ignore_errors=True)
    assert codes == {"m0": 0, "m1": 0, "m2": 1}, members.logs()
    expected = digest(unfailed())
    for member in ("m0", "m1"):
        report = json.loads((tmp_path / f"{member}.json").read_text())
        assert report["digest"] == expected, (member, members.logs())
        _check_ledger(report["ledger"], 0)
        assert {entry[3] for entry in report["ledger"]} == {2}, member  # m2 never in a step
    left = json.loads((tmp_path / "m2.json").read_text())
    assert left["ledger"] == [], members.logs()
    assert left["stopped"].startswith("member m2: cut off from the run's other members: it "
                                      "reaches the Lighthouse"), members.logs()  # fmt: skip
    assert "but not m0, m1, and they cannot reach it at 127.0.0.1:" in left["stopped"]


def test_a_member_that_starts_after_the_run_finished_leaves_at_once_with_exit_0(
    tmp_path: Path,
) -> None:
    """Issue 73's rough edge: a member restarted just before the run's end waited
    quorum_timeout_s alone and failed ("only 1 member(s) for step 1 ... restart it"), or,
    with min_members 1, trained the whole run again alone. The members that finish the run
    say so to the Lighthouse: m3, which asked to join before the end but whose request for a
    quorum arrives after it (alone then), and m2, started after the end, each leave with one
    line and exit 0, m2 at once; neither trains a step."""
    deadline = time.monotonic() + scaled(90)
    hold = STEPS - 4
    with (
        Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0) as lighthouse,
        _Members(lighthouse.address, tmp_path) as members,
    ):
        members.start("m0", 2, hold=(hold,), least=1)
        members.start("m1", 2, hold=(hold,), least=1)
        members.wait_for("m0", hold, deadline)
        members.start("m3", 0, least=1, FT_QUORUM_AFTER=str(tmp_path / "m1.json"))
        while not (tmp_path / "m3.asked").exists():  # it asked before the run's end
            if time.monotonic() > deadline or members.procs["m3"].poll() is not None:
                pytest.fail(f"m3 never asked to join:\n{members.logs()}")
            time.sleep(0.02)
        members.release(hold, deadline)
        codes = members.wait(deadline)
        members.start("m2", 0, least=1)
        codes.update(members.wait(deadline, "m2"))
    assert codes == {"m0": 0, "m1": 0, "m2": 0, "m3": 0}, members.logs()
    for member in ("m0", "m1"):
        report = json.loads((tmp_path / f"{member}.json").read_text())
        assert report["digest"] == digest(unfailed()), member
        _check_ledger(report["ledger"], 0)
    for member in ("m2", "m3"):
        assert not (tmp_path / f"{member}.json").exists(), members.logs()  # trained nothing
        lines = (tmp_path / f"{member}.log").read_text().strip().splitlines()
        assert lines == [
            f"member {member}: the run of the Lighthouse at {lighthouse.address} finished (its "
            f"last step, {STEPS}, is committed) before this member joined it; nothing to "
            f"train: it leaves"
        ], members.logs()
    learnt = float((tmp_path / "m2.finished").read_text())
    assert learnt - (tmp_path / "ready-m2").stat().st_mtime < scaled(2)  # at once


def test_a_hung_member_two_killed_at_once_then_a_killed_lighthouse(tmp_path: Path) -> None:
    """Four members (min_members 1): m1 stops (SIGSTOP: a hang, its sockets open) before step
    a's sum, m2 and m3 are killed together before step b's; the others time out on m1, leave
    it out, lose two more at once, and m0 goes on alone with the bits of a run that never
    failed, each step once; the first commit after each failure comes within the collective
    timeout (3 s) and the Lighthouse's heartbeat timeout (1 s), with 2 s to spare, and m1's
    hang ends m0's wait in step a's collective by m1's pulse (pulses.py). Then the
    Lighthouse (which lives in no member) is killed before step c: m0 stops within its quorum
    timeout (5 s) with an error naming it and the way on, its c committed steps intact."""
    seed = int(os.environ.get("NN_HANDLER_FT_SEED", "52"))
    rng = random.Random(seed)
    a = rng.randint(2, 6)
    b = rng.randint(a + 4, 12)
    c = rng.randint(b + 3, STEPS - 3)
    deadline = time.monotonic() + scaled(90)
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    with lighthouse, _Members(lighthouse.address, tmp_path) as members:
        members.start("m0", 4, hold=(c,), least=1)
        members.start("m1", 4, str(a), "stop", least=1)
        members.start("m2", 4, str(b), "before", least=1)
        members.start("m3", 4, str(b), "before", least=1)
        members.wait_for("m0", c, deadline)
        lighthouse.kill()
        released = time.time()
        members.release(c, deadline)
        codes = members.wait(deadline, "m0", "m2", "m3")
        assert members.procs["m1"].poll() is None, "m1 is stopped, not gone"
    assert codes == {"m0": 1, "m2": -signal.SIGKILL, "m3": -signal.SIGKILL}, (
        f"seed {seed} (a={a}, b={b}, c={c}):\n{members.logs()}"
    )
    report = json.loads((tmp_path / "m0.json").read_text())
    assert report["steps"] == c and report["digest"] == digest(unfailed(c))
    _check_ledger(report["ledger"], 0, c)
    assert f"the Lighthouse at {lighthouse.address} is gone" in report["stopped"]
    assert "restart it from its latest checkpoint" in report["stopped"]
    # The documented bound: m0 gives up step c's quorum within its quorum timeout (5 s), with
    # 2 s to spare, scaled by the load now (not a speed target).
    assert 0 < report["stopped_at"] - released < scaled_now(5.0 + 2.0), report["stopped_at"]
    sizes = {entry[0]: entry[3] for entry in report["ledger"]}
    assert (sizes[a - 1], sizes[a], sizes[b - 1], sizes[b]) == (4, 3, 3, 1)
    # The hang ended m0's wait in step a's collective by m1's pulse (silent for the heartbeat
    # timeout, 1 s), not by the collective's own timeout (3 s).
    causes = [cause for step, cause, _ in report["abandoned"] if step == a]
    assert causes and causes[0].startswith("member m1 is gone: its process ended"), causes
    commits = {entry[0]: entry[4] for entry in report["ledger"]}
    for died, step in (("m1", a), ("m2", b)):
        recovery = commits[step] - float((tmp_path / f"{died}.died").read_text())
        # The documented bound on detecting a death (not a speed target), scaled by the load
        # now, after the run, not when the test started.
        assert 0 < recovery < scaled_now(3.0 + 1.0 + 2.0), (died, recovery)


def test_a_state_transfer_cut_by_the_death_of_its_receiver_then_of_its_sender(
    tmp_path: Path,
) -> None:
    """m3 joins and dies in the middle of receiving the state (after its header): its sender
    votes abort, the step is redone without m3. m4 joins later and its sender dies in the
    middle of sending: m4 refuses nothing it did not get whole, agrees again and receives the
    state from another member. Then m4, alive, takes longer than the collectives' timeout
    over step 44: the others abandon it and, m4's heartbeats going on, redo it with m4 (it
    is not left out to catch up). Every member left ends with the bits of a run that never
    failed, each step committed once; none restarted."""
    steps, slow = 50, 44
    deadline = time.monotonic() + scaled(90)
    env = {"FT_STEPS": str(steps), "FT_STEP_S": "0.1", "FT_DIE_IN_TRANSFER": "send"}
    # A member alive but late (a sender waiting on a receiver that died) is waited for: its
    # heartbeats go on, and the join timeout is longer than the collectives' timeout (3 s).
    with (
        Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0) as lighthouse,
        _Members(lighthouse.address, tmp_path) as members,
    ):
        # The members wait before steps 10 and 40 until the joiner has its replica, so that
        # m3 joins by step 10 and m4 by step 40, before its slow step, however slow a start.
        for member in ("m0", "m1", "m2"):
            members.start(member, 3, hold=(10, 40), least=1, **env)
        members.wait_for("m0", 3, deadline)
        members.start("m3", 0, least=1, **{**env, "FT_DIE_IN_TRANSFER": "receive"})
        members.release(10, deadline, once_ready="m3")
        members.wait(deadline, "m3")
        members.start("m4", 0, str(slow), "slow", least=1, **env)
        members.release(40, deadline, once_ready="m4")
        codes = members.wait(deadline)
    senders = [m for m in ("m0", "m1", "m2") if codes[m] == -signal.SIGKILL]
    assert codes["m3"] == -signal.SIGKILL and len(senders) == 1, members.logs()
    assert (tmp_path / "receiver.died").exists() and (tmp_path / "sender.died").exists()
    survivors = [m for m, code in codes.items() if code == 0]
    assert len(survivors) == 3 and "m4" in survivors, members.logs()
    expected = digest(unfailed(steps))
    for member in survivors:
        report = json.loads((tmp_path / f"{member}.json").read_text())
        assert report["digest"] == expected, member
        first = 0 if member != "m4" else report["ledger"][0][0]
        _check_ledger(report["ledger"], first, steps)
    m4 = json.loads((tmp_path / "m4.json").read_text())
    assert 3 < m4["ledger"][0][0] < slow, "m4 joined mid-run, before its slow step"
    assert (tmp_path / "m4.slow").exists() and m4["redone"] >= 1
    assert {entry[3] for entry in m4["ledger"]} == {3}  # never left out


def _supervise(members: int, script: Path, run: Path, env: dict[str, str], timeout: float) -> str:
    """`nn-handler supervise --members N -- python SCRIPT {lighthouse} RUN {member} N` to its
    end (exit 0, or the test fails with its output); its whole output. Its own session: on a
    hang, it and its members are killed together."""
    command = [sys.executable, "-m", "nn_handler.cli", "supervise", "--members", str(members),
               "--join-timeout-s", "10", "--", sys.executable, str(script), "{lighthouse}",
               str(run), "{member}", str(members)]  # fmt: skip
    supervisor = subprocess.Popen(
        command, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(ROOT),
                      "RUST_LOG": "error", **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = supervisor.communicate(timeout=scaled(timeout))
    except subprocess.TimeoutExpired:
        os.killpg(supervisor.pid, signal.SIGKILL)
        pytest.fail(f"supervise did not finish (a hang):\n{supervisor.communicate()[0]}")
    assert supervisor.returncode == 0, output
    return output


def test_nn_handler_supervise_restarts_only_the_dead_member_and_it_joins_the_run(
    tmp_path: Path,
) -> None:
    """`nn-handler supervise --members 3 -- COMMAND` starts a Lighthouse and three members of
    the same command; m1 dies before step 5's sum: the supervisor restarts it alone, with its
    name, and it joins the run where it is while the others go on. Every member ends with the
    bits of a run that never failed; the supervisor says the restart in one line, exits 0.
    The run lasts 10 s after the kill, so that the restarted member (a new interpreter that
    imports torch: 4-5 s on a loaded 2-core machine) joins before its end: with 3.5 s it once
    arrived after it and left, and the test failed on the machine's speed."""
    steps = 100
    env = {"FT_STEPS": str(steps), "FT_STEP_S": "0.1", "FT_KILL": "m1:5:before",
           "FT_MIN_MEMBERS": "1"}  # fmt: skip
    output = _supervise(3, SCRIPT, tmp_path, env, timeout=90)
    restarts = [line for line in output.splitlines() if "; restarted (" in line]
    assert (
        len(restarts) == 1 and "member m1 killed by SIGKILL; restarted (1 of 3)" in restarts[0]
    ), (
        output[-6000:]  # why a restarted member exited (seen once under load at dde4c3c)
    )
    assert (tmp_path / "m1.died").exists()
    expected = digest(unfailed(steps))
    for member in ("m0", "m1", "m2"):
        report = json.loads((tmp_path / f"{member}.json").read_text())
        assert report["digest"] == expected, (member, output)
        first = report["ledger"][0][0]
        assert first == 0 if member != "m1" else first > 5, member  # m1 joined mid-run
        _check_ledger(report["ledger"], first, steps)


def _children(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found.update(int(child) for child in (task / "children").read_text().split())
    return found


def _running(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, ended and not yet reaped, does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_supervisor_killed_with_sigkill_leaves_no_lighthouse_and_no_member_behind() -> None:
    """Issue 69's third bug: `nn-handler supervise` SIGKILLed (no cleanup of its own runs) left
    its Lighthouse, re-parented to PID 1, running on. Its four children (the Lighthouse, its
    loaded spare and two members that would sleep for two minutes) end within seconds of it."""
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)", "{member}", "{lighthouse}"]
    command = [sys.executable, "-m", "nn_handler.cli", "supervise", "--members", "2", "--",
               *sleeper]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": python_path(ROOT), "RUST_LOG": "error"}
    supervisor = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # everything killed at the end, whatever happened
    )  # fmt: skip
    try:
        deadline = time.monotonic() + scaled(60)
        while len(children := _children(supervisor.pid)) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(children) == 4, children  # the Lighthouse, its spare, its two members
        supervisor.kill()
        supervisor.wait()
        deadline = time.monotonic() + scaled(15)
        while any(map(_running, children)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in children if _running(pid)], "left running"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(supervisor.pid, signal.SIGKILL)


TRAINER_SCRIPT = SCRIPT.with_name("ft_trainer_member.py")


def _unfailed_trainer_run(tracked: Path, reduction: str = "exact") -> str:
    """The SHA-256 of the reproducible CNN's run in one process that never failed, with the
    members' one thread (another count of threads changes a CPU kernel's float sums); its CSV
    tracker writes in ``tracked``, its weights go to ``tracked/weights.pt``."""
    from tests.reproducible_helpers import digest as run_digest
    from tests.reproducible_helpers import handler, train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        h = handler("cnn", None, tracked=tracked, reduction=reduction)
        train(h, "cnn")
        found = run_digest(h)
        torch.save(h.model.state_dict(), tracked / "weights.pt")
        h.close()
    finally:
        torch.set_num_threads(threads)
    return found


def _tracked_rows(folder: Path) -> list[dict[str, str]]:
    """The CSV tracker's rows: the step, its loss, each epoch's losses and metrics (not the
    timings, which differ between runs)."""
    from tests.reproducible_helpers import COMPUTED

    kept = ("step", "train_loss_step", *COMPUTED)
    with (folder / "metrics.csv").open(newline="") as handle:
        return [
            {k: v for k, v in row.items() if v and (k in kept or k.startswith("val_"))}
            for row in csv.DictReader(handle)
        ]


def test_an_nnhandler_run_loses_members_then_its_lighthouse_and_ends_with_the_unfailed_bits(
    tmp_path: Path,
) -> None:
    """An NNHandler run (trainer.fault_tolerance over the reproducible mode's CNN: BatchNorm,
    dropout, Adam, validation each epoch), each member a process of its own writing periodic
    checkpoints (every 3 steps) in a folder of its own. m1 dies in the middle of writing its
    checkpoint of step 3; m1b, restarted, joins the run where it is; m2 dies after step b's
    sum, before its vote; then the Lighthouse is killed: m9 and m1b stop, each with an
    emergency checkpoint of its committed steps. The whole run restarts from them (a new
    Lighthouse; m9, m1b and m1, whose folder holds only the half-written file, removed): m1
    receives the others' state at the first step, and all three end with the SHA-256 of
    weights, buffers, optimizer state and History of a run that never failed.

    The members share one CSV tracker's folder, which the first member of each step (by
    name) writes: m1 until it dies, then m2, then m1b from its join, m1 again after the
    restart; the file ends with the rows of the unfailed run, each step once."""
    rng = random.Random(int(os.environ.get("NN_HANDLER_FT_SEED", "53")))
    b = rng.randint(4, 6)
    deadline = time.monotonic() + scaled(150)
    # A member gives up a quorum after 6 s: the Lighthouse's death stops the run that soon.
    checkpoints = {"FT_CHECKPOINTS": "1", "FT_QUORUM_TIMEOUT_S": "6"}
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    with lighthouse, _Members(lighthouse.address, tmp_path, TRAINER_SCRIPT) as members:
        kill = {"FT_KILL_LIGHTHOUSE": f"{lighthouse.pid}:{b + 1}:m1b"}
        members.start("m9", 3, least=1, **checkpoints, **kill)
        members.start("m1", 3, "3", "save", least=1, **checkpoints)
        members.start("m2", 3, str(b), "vote", least=1, **checkpoints)
        members.wait(deadline, "m1")
        members.start("m1b", 0, least=1, **checkpoints)  # m1 restarted: it joins the run
        codes = members.wait(deadline)
    assert codes == {"m9": 1, "m1": -signal.SIGKILL, "m2": -signal.SIGKILL, "m1b": 1}, (
        members.logs()
    )
    first = {m: json.loads((tmp_path / f"{m}.json").read_text()) for m in ("m9", "m1b")}
    for member, report in first.items():  # the memory plan counts the kept copy of a sum
        held, planned, slots = report["memory"]
        item = planned["reproducible mode"] + planned["fault tolerance"]
        assert item <= held - slots <= 1.1 * item, (member, held, slots, planned)
    stopped = first["m9"]["step"]
    assert first["m1b"]["step"] == stopped and b < stopped < 12, members.logs()
    assert "the Lighthouse at" in first["m9"]["stopped"]
    assert "member m1b joined the run at step" in (tmp_path / "m1b.log").read_text()
    log = (tmp_path / "m9.log").read_text()
    abandoned = [line for line in log.splitlines() if "abandoned by the run" in line]
    assert f"step {b + 1}: abandoned by the run (a member failed it" in log
    assert len(abandoned) == len(set(abandoned)), log  # one line per event
    assert "emergency checkpoint of its" in log, log
    folders = tmp_path / "checkpoints"
    assert not list((folders / "m1").glob("ckpt-*.pt")), "m1 completed no checkpoint"
    for member in ("m9", "m1b"):  # the emergency checkpoint: the last committed step
        assert list((folders / member).glob(f"ckpt-*-s{stopped:08d}*.pt")), member
    for member in ("m9", "m1b", "m1"):
        (tmp_path / f"{member}.json").unlink(missing_ok=True)
        (tmp_path / f"ready-{member}").unlink(missing_ok=True)
    restart = {"FT_START_MEMBERS": "3", "FT_QUORUM_TIMEOUT_S": "30"}  # all three, however slow
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    with lighthouse, _Members(lighthouse.address, tmp_path, TRAINER_SCRIPT) as members:
        for member in ("m9", "m1b", "m1"):  # the whole run restarted, its first step together
            members.start(member, 3, least=1, **{**checkpoints, **restart})
        codes = members.wait(deadline)
    assert codes == {"m9": 0, "m1b": 0, "m1": 0}, members.logs()
    expected = _unfailed_trainer_run(tmp_path / "unfailed")
    for member in ("m9", "m1b", "m1"):
        assert json.loads((tmp_path / f"{member}.json").read_text())["digest"] == expected
    # One run in the tracker: each step once, the unfailed run's rows (losses, metrics).
    assert _tracked_rows(tmp_path / "tracked") == _tracked_rows(tmp_path / "unfailed")
    log = (tmp_path / "m1.log").read_text()
    assert "left by an interrupted save" in log and "joined the run at step" in log


def test_a_member_with_other_settings_is_refused_by_name_and_the_run_goes_on(
    tmp_path: Path,
) -> None:
    """Issue 69, items 15 and 16 (fault-campaign breaks): a member started with another
    learning rate, another mode seed (another run pointed at the same Lighthouse) or another
    thread count joined silently and took every member off the run's bits. The members agree
    on a fingerprint of what makes the bits, the first member's, before any step: m0 and m1
    start the run; m2 (lr), m3 (seed) and m4 (threads) are each refused by name with the
    field and both values, take part in no step, and m0 and m1 end with the unfailed bits.
    m5, with the run's settings, starts after the run's end: it leaves at once with one line
    and exit 0 (issue 73's rough edge: it waited quorum_timeout_s alone and failed)."""
    deadline = time.monotonic() + scaled(120)
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    others = {"m2": {"FT_LR": "0.01"}, "m3": {"FT_SEED": "4"}, "m4": {"FT_THREADS": "2"}}
    with lighthouse, _Members(lighthouse.address, tmp_path, TRAINER_SCRIPT) as members:
        members.start("m0", 2, least=1, FT_START_MEMBERS="2")
        members.start("m1", 2, least=1, FT_START_MEMBERS="2")
        while "epoch 1/" not in (tmp_path / "m0.log").read_text():  # the run is under way
            if time.monotonic() > deadline or members.procs["m0"].poll() is not None:
                break
            time.sleep(0.05)
        for member, env in others.items():
            members.start(member, 0, least=1, **env)
        codes = members.wait(deadline)
        members.start("m5", 0, least=1)  # after the run's end (issue 73): it leaves, exit 0
        codes.update(members.wait(deadline, "m5"))
    assert codes == {"m0": 0, "m1": 0, "m2": 1, "m3": 1, "m4": 1, "m5": 0}, members.logs()
    lines = (tmp_path / "m5.log").read_text().strip().splitlines()
    said = [line for line in lines if "the run of the Lighthouse at" in line]
    assert len(said) == 1 and said[0] == lines[-1], members.logs()  # one line, the last
    assert "member m5: " in said[0] and "finished (its last step, " in said[0], said
    assert "Traceback" not in "\n".join(lines) and not (tmp_path / "m5.json").exists()
    said = {
        "m2": "lr: 0.01 here, 0.003 in the run",
        "m3": "trainer.reproducible.seed: 4 here, ",
        "m4": "threads: 2 here, 1 in the run",
    }
    for member, field in said.items():
        log = (tmp_path / f"{member}.log").read_text()
        assert f"member {member} is refused by the run of the Lighthouse at" in log, log
        assert field in log and "joined the run" not in log, log
    expected = _unfailed_trainer_run(tmp_path / "unfailed")
    for member in ("m0", "m1"):
        assert json.loads((tmp_path / f"{member}.json").read_text())["digest"] == expected


def test_a_member_restarted_by_supervise_resumes_its_checkpoints_and_joins(
    tmp_path: Path,
) -> None:
    """Issue 69's first bug: `nn-handler supervise` over two NNHandler members with periodic
    checkpoints (every 3 steps) and the default ``resume: on_restart``. m1 is SIGKILLed in
    the validation after step 6 (between two steps), after its checkpoint of step 6:
    restarted, it is told it is a restart (NN_HANDLER_RESTART_COUNT), resumes from its own
    folder instead of being refused as a fresh start over committed checkpoints, joins the
    run, and both members end with the bits of a run that never failed. On the way, what a
    user reads: each member's lines name it (`member m0`, not `rank 0` for every member), the
    supervisor's say `supervise`, and the survivor says in one line each that a member left
    (found by the next step's collective: that attempt is abandoned, said with the members
    left) and that one joined."""
    env = {"FT_CHECKPOINTS": "1", "FT_RESUME": "on_restart", "FT_KILL": "m1:6:validate",
           "FT_AWAIT_RESTART": "m1:7"}  # fmt: skip
    output = _supervise(2, TRAINER_SCRIPT, tmp_path, env, timeout=150)
    lines = output.splitlines()
    restarts = [line for line in lines if "; restarted (" in line]
    assert (
        len(restarts) == 1 and "member m1 killed by SIGKILL; restarted (1 of 3)" in restarts[0]
    ), (
        output[-6000:]  # why a restarted member exited (seen once under load at dde4c3c)
    )
    assert "| supervise |" in restarts[0], output
    resumed = [line for line in lines if "resume='on_restart': resumed from" in line]
    assert len(resumed) == 1 and "-s00000006.pt" in resumed[0], output
    assert "| member m1 |" in resumed[0], output
    assert "not a restart" not in output and (tmp_path / "restarted-m1").exists(), output
    assert not [line for line in lines if "| rank " in line], output  # every line is named
    survivor = [line for line in lines if "| member m0 |" in line]
    left = [line for line in survivor if "(1 member(s) now, 2 before)" in line]
    assert len(left) == 1 and "step 7: abandoned by the run (all_reduce of step 7" in left[0]
    assert "redone by the members left (1 member(s) now, 2 before)" in left[0], output
    # (The first step may say a join too: the member that came second to the Lighthouse.)
    after = survivor[survivor.index(left[0]) :]
    joined = [line for line in after if "a member joined the run" in line]
    assert len(joined) == 1 and "(2 member(s) now, 1 before)" in joined[0], output
    assert len([line for line in survivor if "abandoned by the run" in line]) == 1, output
    # Each member is rank 0 of its own: one of them is the reporting process (issue 69, 7).
    assert len(list(tmp_path.glob("reporter-*"))) == 1, list(tmp_path.iterdir())
    expected = _unfailed_trainer_run(tmp_path / "unfailed")
    for member in ("m0", "m1"):
        report = json.loads((tmp_path / f"{member}.json").read_text())
        assert report["digest"] == expected, (member, output)


def test_a_redone_step_computes_only_the_micro_batches_of_the_member_lost_in_its_sum(
    tmp_path: Path,
) -> None:
    """Issue 73, a failure cheaper than a step: three members of an NNHandler run (exact sum,
    4 micro-batches a step: m0 owns 0 and 3, m1 1, m2 2). m2 is SIGKILLed in step 3's
    forward, so the others' sum fails half-way. They keep their own sums of the abandoned
    attempt, and the redo computes only m2's micro-batch (on m0, rank 0 of the two): in that
    step m0 loads 12 samples and m1 4, each sample once (a whole redo loaded 16 and 8: all of
    it again, dealt over two), and both end with the bits of a run that never failed."""
    deadline = time.monotonic() + scaled(90)
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    with lighthouse, _Members(lighthouse.address, tmp_path, TRAINER_SCRIPT) as members:
        members.start("m0", 3, least=1, FT_START_MEMBERS="3")
        members.start("m1", 3, least=1, FT_START_MEMBERS="3")
        members.start("m2", 3, "2", "forward", least=1, FT_START_MEMBERS="3")
        codes = members.wait(deadline)
    assert codes == {"m0": 0, "m1": 0, "m2": -signal.SIGKILL}, members.logs()
    reports = {m: json.loads((tmp_path / f"{m}.json").read_text()) for m in ("m0", "m1")}
    assert reports["m0"]["redone"] == 1, members.logs()  # step 3, once
    loaded = {m: {int(k): v for k, v in r["loaded"].items()} for m, r in reports.items()}
    for step in range(12):
        zero, one = loaded["m0"][step], loaded["m1"][step]
        assert len(zero + one) == len(set(zero + one)), (step, loaded)  # each sample once
        # 3 members: 2, 1 and 1 micro-batches of 4 samples; the redo: m2's on m0; then 2 each
        sizes = (8, 4) if step < 2 else (12, 4) if step == 2 else (8, 8)
        assert (len(zero), len(one)) == sizes, (step, loaded)
    expected = _unfailed_trainer_run(tmp_path / "unfailed")
    assert all(report["digest"] == expected for report in reports.values()), members.logs()


def test_a_float_sum_run_loses_a_member_to_a_kill_and_one_to_a_preemption(tmp_path: Path) -> None:
    """``reproducible.reduction: float`` (DDP's floating-point sum, no scales), three members
    of an NNHandler run. m2 is SIGKILLed in a step's forward: the others redo the step from
    the same state (summed in another order). A SIGTERM (a node's preemption) reaches m1: it
    finishes its step, writes a checkpoint of its committed steps in its own folder and exits
    with the preemption status (75), in one line; m0 goes on without it and ends with the
    weights of a run that never failed, to float tolerance."""
    from nn_handler.errors import PREEMPTED_EXIT_CODE

    deadline = time.monotonic() + scaled(90)
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    run = {"FT_REDUCTION": "float", "FT_START_MEMBERS": "3", "FT_CHECKPOINTS": "1"}
    with lighthouse, _Members(lighthouse.address, tmp_path, TRAINER_SCRIPT) as members:
        members.start("m0", 3, least=1, **run)
        members.start("m1", 3, "6", "term", least=1, **run)
        members.start("m2", 3, "2", "forward", least=1, **run)
        codes = members.wait(deadline)
    assert codes == {"m0": 0, "m1": PREEMPTED_EXIT_CODE, "m2": -signal.SIGKILL}, members.logs()
    log = (tmp_path / "m1.log").read_text()
    said = [line for line in log.splitlines() if "preempted after optimizer step" in line]
    assert len(said) == 1, log
    assert "| member m1 | WARNING | member m1 received SIGTERM: stopping soon" in log, log
    step = int(said[0].split("preempted after optimizer step ")[1].split(":")[0])
    assert 6 < step < 12 and list((tmp_path / "checkpoints" / "m1").glob(f"*-s{step:08d}.pt"))
    survivor = json.loads((tmp_path / "m0.json").read_text())
    assert survivor["step"] == 12 and survivor["redone"] >= 1, members.logs()
    # The preemption costs the others nothing: m1 leaves between two steps, so m0's only
    # abandoned steps are m2's (killed in step 3's forward), none from m1's SIGTERM on (in
    # step 7's forward). m2's kill in the same run must not hide one.
    m0_log = (tmp_path / "m0.log").read_text()
    redone = [int(line.split("| step ")[1].split(":")[0])
              for line in m0_log.splitlines() if ": abandoned by the run (" in line]  # fmt: skip
    assert len(redone) == survivor["redone"] and all(s <= 3 for s in redone), (redone, m0_log)
    _unfailed_trainer_run(tmp_path / "unfailed", reduction="float")
    expected = torch.load(tmp_path / "unfailed" / "weights.pt")
    found = torch.load(tmp_path / "m0.pt")
    assert max(float((found[k] - expected[k]).abs().max()) for k in expected) < 1e-4


def test_every_member_preempted_then_the_run_restarts_from_the_most_advanced(
    tmp_path: Path,
) -> None:
    """docs/fault-tolerance.md, "A preempted member leaves at a step boundary", each of its
    promises in one run. m2 (no checkpoint folder) gets a SIGTERM in step 3's forward: it ends
    as a death does, and the others redo that step. m0 gets a preemption notice (a file that
    appears: `checkpoint.preemption_notice`) in step 5, m1 a SIGTERM in step 10: each finishes
    its step, writes a checkpoint of its committed steps and exits as preempted (75), m0 first;
    m1 goes on alone meanwhile (the members do not agree on a stop). The whole run restarted
    (`resume: auto`, both folders) goes on from the most advanced, m1's step: m0 receives its
    state at the first step, and both end with the bits of a run that never failed."""
    from nn_handler.errors import PREEMPTED_EXIT_CODE

    deadline = time.monotonic() + scaled(150)
    run = {"FT_START_MEMBERS": "3"}
    saved = {"FT_CHECKPOINTS": "1"}
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    with lighthouse, _Members(lighthouse.address, tmp_path, TRAINER_SCRIPT) as members:
        members.start("m0", 3, "4", "notice", least=1, **run, **saved)
        members.start("m1", 3, "9", "term", least=1, **run, **saved)
        members.start("m2", 3, "2", "term", least=1, **run)
        codes = members.wait(deadline)
    preempted = PREEMPTED_EXIT_CODE
    assert codes == {"m0": preempted, "m1": preempted, "m2": -signal.SIGTERM}, members.logs()
    stops = {}
    for member in ("m0", "m1"):
        log = (tmp_path / f"{member}.log").read_text()
        said = [line for line in log.splitlines() if "preempted after optimizer step" in line]
        assert len(said) == 1, log  # one line
        stops[member] = int(said[0].split("preempted after optimizer step ")[1].split(":")[0])
        folder = tmp_path / "checkpoints" / member
        assert list(folder.glob(f"*-s{stops[member]:08d}.pt")), (member, stops, members.logs())
    assert 4 < stops["m0"] < 9 < stops["m1"] < 12, stops
    m0_log = (tmp_path / "m0.log").read_text()
    assert "received SIGTERM" not in m0_log and "notice" in m0_log, m0_log
    # m2's SIGTERM cost the step it was in, as a death does; the preemptions cost nothing.
    redone = [int(line.split("| step ")[1].split(":")[0])
              for line in (tmp_path / "m1.log").read_text().splitlines()
              if ": abandoned by the run (" in line]  # fmt: skip
    assert redone and all(step == 3 for step in redone), (redone, members.logs())
    for member in ("m0", "m1", "m2"):
        (tmp_path / f"ready-{member}").unlink(missing_ok=True)
    restart = {"FT_START_MEMBERS": "2", "FT_QUORUM_TIMEOUT_S": "30"}  # both, however slow
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    with lighthouse, _Members(lighthouse.address, tmp_path, TRAINER_SCRIPT) as members:
        for member in ("m0", "m1"):
            members.start(member, 2, least=1, **restart, **saved)
        codes = members.wait(deadline)
    assert codes == {"m0": 0, "m1": 0}, members.logs()
    expected = _unfailed_trainer_run(tmp_path / "unfailed")
    for member in ("m0", "m1"):
        assert json.loads((tmp_path / f"{member}.json").read_text())["digest"] == expected
    assert f"joined the run at step {stops['m1']}" in (tmp_path / "m0.log").read_text()


def test_fewer_than_min_members_for_the_quorum_timeout_stop_the_run_with_emergency_checkpoints(
    tmp_path: Path,
) -> None:
    """docs/fault-tolerance.md: when the run cannot go on step by step because it has fewer
    than `min_members` for `quorum_timeout_s`, each member left writes an emergency checkpoint
    of its last committed step before it stops. min_members 2: m1 dies in step 5's forward;
    m0 redoes step 5 alone, waits 4 s for a second member, then stops (exit 1) naming both
    numbers, with a checkpoint of step 4 (its periodic one is of step 3) that resumes."""
    deadline = time.monotonic() + scaled(90)
    run = {"FT_START_MEMBERS": "2", "FT_CHECKPOINTS": "1", "FT_QUORUM_TIMEOUT_S": "4"}
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    with lighthouse, _Members(lighthouse.address, tmp_path, TRAINER_SCRIPT) as members:
        members.start("m0", 2, least=2, **run)
        members.start("m1", 2, "4", "forward", least=2, **run)
        codes = members.wait(deadline)
    assert codes == {"m0": 1, "m1": -signal.SIGKILL}, members.logs()
    report = json.loads((tmp_path / "m0.json").read_text())
    assert report["step"] == 4, members.logs()
    assert (
        "only 1 member(s) for step 5, fewer than 2 (min_members=2), for 4 s" in (report["stopped"])
    )
    assert "emergency checkpoint of its" in (tmp_path / "m0.log").read_text(), members.logs()
    folder = tmp_path / "checkpoints" / "m0"
    names = sorted(p.name for p in folder.glob("ckpt-*.pt"))
    assert [n for n in names if "-s00000004" in n] and [n for n in names if "-s00000003" in n]
    from nn_handler.checkpoint import load_file

    latest = load_file(max(folder.glob("ckpt-*-s00000004*.pt")))
    assert latest["trainer"]["global_step"] == 4


def test_a_spare_trains_from_the_step_redone_without_the_member_it_replaces(
    tmp_path: Path,
) -> None:
    """docs/fault-tolerance.md, `max_members`: members beyond it are spares that hold the state,
    take part in each sum with nothing of their own, and train as soon as a member is lost,
    from the step redone without it. Three members, max_members 2: m2 (the third by rank)
    runs no micro-batch until m0 dies before its vote in step 5; from step 5, redone, m2 runs
    micro-batches of every step, and m1 and m2 end with the bits of a run that never failed.
    The redo computes only m0's micro-batches: m1 carries its own sum of the abandoned step."""
    deadline = time.monotonic() + scaled(90)
    run = {"FT_START_MEMBERS": "3", "FT_MAX_MEMBERS": "2"}
    lighthouse = Lighthouse(min_members=1, join_timeout_s=10.0, heartbeat_timeout_s=1.0)
    with lighthouse, _Members(lighthouse.address, tmp_path, TRAINER_SCRIPT) as members:
        members.start("m0", 3, "4", "vote", least=1, **run)
        members.start("m1", 3, least=1, **run)
        members.start("m2", 3, least=1, **run)
        codes = members.wait(deadline)
    assert codes == {"m0": -signal.SIGKILL, "m1": 0, "m2": 0}, members.logs()
    reports = {m: json.loads((tmp_path / f"{m}.json").read_text()) for m in ("m1", "m2")}
    assert reports["m1"]["trained"] == list(range(12)), reports
    assert reports["m2"]["trained"] == list(range(4, 12)), reports  # 0-based: step 5 on
    # A member loads only the micro-batches it trains (its loader loads them on demand), each
    # once: the spare none before it trains, then each of the two its half of every step (8
    # of 16 samples). The redone step computes only m0's micro-batches (issue 73): m1 carries
    # its sum of the abandoned attempt (micro-batches 1 and 3), and m0's two are dealt to m1
    # (rank 0 now: micro-batch 0) and m2 (micro-batch 2), a quarter of the step each.
    loaded = {m: {int(k): v for k, v in r["loaded"].items()} for m, r in reports.items()}
    assert sorted(loaded["m1"]) == list(range(12)), loaded
    assert sorted(loaded["m2"]) == list(range(4, 12)), loaded
    for step in range(12):
        one, two = loaded["m1"][step], loaded["m2"].get(step, [])
        assert len(set(one)) == len(one) and len(set(two)) == len(two), (step, loaded)
        if step < 4:
            assert len(one) == 8 and not two, (step, loaded)
        elif step == 4:  # redone: only the lost member's micro-batches are computed again
            assert len(one) == 12 and len(two) == 4, (step, loaded)
            assert sorted(one + two) == sorted(set(one + two)) and len(one + two) == 16
        else:
            assert len(one) == len(two) == 8 and not set(one) & set(two), (step, loaded)
    expected = _unfailed_trainer_run(tmp_path / "unfailed")
    assert all(report["digest"] == expected for report in reports.values()), members.logs()
