"""The fault-tolerance mode's parts that need no member process: the Lighthouse (a process of
its own, its address, a taken port, an address where none runs), the transport of a member's
state (verified, never unpickled), the configuration's errors, and a member's stops (too few
members, the verdicts gone, a step that is not the run's, a join it cannot take yet)."""

from __future__ import annotations

import io
import os
import pickle
import re
import socket
import sys
from datetime import timedelta
from typing import Any

import psutil
import pytest
import torch

pytest.importorskip("torchft")

from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.training.fault_tolerance import Lighthouse, require_torchft
from nn_handler.training.fault_tolerance.transport import VerifiedTransport
from nn_handler.training.fault_tolerance.verdicts import COMMITTED
from tests.ft_helpers import NoPartition, NoPulse, NoQuorumClient


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _Loopback:
    """A group of one link: what is sent with a tag is what the next recv of that tag gets."""

    def __init__(self) -> None:
        self.sent: dict[int, torch.Tensor] = {}

    def send(self, tensors: list[torch.Tensor], rank: int, tag: int) -> _Done:
        self.sent[tag] = tensors[0].clone()
        return _Done()

    def recv(self, tensors: list[torch.Tensor], rank: int, tag: int) -> _Done:
        tensors[0].copy_(self.sent[tag])
        return _Done()


def _transport() -> tuple[VerifiedTransport, _Loopback]:
    group = _Loopback()
    return VerifiedTransport(group, timedelta(seconds=1)), group


def test_a_members_state_arrives_whole_with_its_tensors_and_numbers() -> None:
    transport, _ = _transport()
    state = {"user": {"w": torch.arange(5.0), "step": 7}, "torchft": {"step": 7}}
    transport.send_checkpoint([1], 7, state, timedelta(seconds=1))
    received = transport.recv_checkpoint(0, transport.metadata(), 7, timedelta(seconds=1))
    assert torch.equal(received["user"]["w"], state["user"]["w"])
    assert received["user"]["step"] == 7 and received["torchft"] == {"step": 7}


def test_a_changed_byte_in_a_sent_state_is_refused_by_name() -> None:
    transport, group = _transport()
    transport.send_checkpoint([1], 3, {"w": torch.ones(64)}, timedelta(seconds=1))
    group.sent[102][-30] ^= 0xFF  # one byte, anywhere: the whole is checksummed
    corrupt = r"the state sent by member 0 at step 3 is corrupt: .* was sent; it was refused"
    with pytest.raises(CheckpointError, match=corrupt):
        transport.recv_checkpoint(0, "", 3, timedelta(seconds=1))


def test_a_state_of_another_step_is_refused() -> None:
    transport, _ = _transport()
    transport.send_checkpoint([1], 4, {"w": torch.ones(2)}, timedelta(seconds=1))
    with pytest.raises(CheckpointError, match="it is of step 4; it was refused"):
        transport.recv_checkpoint(0, "", 5, timedelta(seconds=1))


class _Runs:
    def __reduce__(self) -> Any:
        return (os.system, ("echo owned",))


def test_a_state_that_would_run_code_is_refused_not_unpickled() -> None:
    transport, group = _transport()
    buffer = io.BytesIO()
    torch.save({"w": torch.ones(1), "x": _Runs()}, buffer, pickle_module=pickle)
    # A peer's bytes, well formed and checksummed: only weights-only loading stands between.
    transport.send_checkpoint([1], 1, {"w": torch.ones(1)}, timedelta(seconds=1))
    data = buffer.getvalue()
    from nn_handler.checkpoint.verify import entry_of_bytes

    entry = entry_of_bytes(data)
    group.sent[101] = torch.tensor([entry["size"], entry["crc32"], 1], dtype=torch.int64)
    group.sent[102] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    refused = r"cannot be loaded weights-only \(it names posix.system\); it was refused"
    with pytest.raises(CheckpointError, match=refused):
        transport.recv_checkpoint(0, "", 1, timedelta(seconds=1))


def test_the_lighthouse_runs_in_a_process_of_its_own_on_the_address_it_gives() -> None:
    with Lighthouse(min_members=2) as lighthouse:
        assert lighthouse.address == f"http://127.0.0.1:{lighthouse.port}"
        bound = {
            c.laddr.ip
            for c in psutil.Process(lighthouse.pid).net_connections("inet")
            if c.status == "LISTEN" and c.laddr.port == lighthouse.port
        }
        assert bound == {"127.0.0.1"} and lighthouse.pid != os.getpid()


def test_a_lighthouse_on_a_given_port_answers_on_it_and_the_next_one() -> None:
    """docs/fault-tolerance.md: `nn-handler lighthouse --host H --port P` takes ports P (the
    quorum) and P + 1 (the verdicts' store, which members dial at the address's port + 1),
    both on H only, both of the Lighthouse's own process."""
    from nn_handler.training.fault_tolerance.lighthouse import agreed_value, verdicts_of
    from tests.harness import free_port

    port = free_port()
    while not _free(port + 1):
        port = free_port()
    with Lighthouse("127.0.0.1", port, min_members=2) as lighthouse:
        assert lighthouse.address == f"http://127.0.0.1:{port}"
        listening = {
            (c.laddr.ip, c.laddr.port)
            for c in psutil.Process(lighthouse.pid).net_connections("inet")
            if c.status == "LISTEN"
        }
        assert {("127.0.0.1", port), ("127.0.0.1", port + 1)} <= listening, listening
        assert {p for _, p in listening} == {port, port + 1}, listening
        store = verdicts_of(lighthouse.address, 10.0)
        try:  # a member's first request: the run's agreed value
            assert agreed_value(store, "check", "mine") == "mine"
            assert agreed_value(store, "check", "other") == "mine"
        finally:
            store.close()


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_without_torchft_the_mode_says_which_extra_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ConfigError, match=r"pip install 'nn_handler\[ft\]'"):
        require_torchft()


@pytest.mark.parametrize("version", ["0.3.0", "0.3.0rc1", "1.0", "0.1.9"])
def test_a_torchft_the_mode_does_not_support_is_refused_with_the_versions_it_does(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    """torchft 0.3 removes ProcessGroup.configure() (the mode's reconfiguration) and needs
    every member and the Lighthouse upgraded together: refused before any member starts."""
    from nn_handler.training.fault_tolerance import engine

    monkeypatch.setattr(engine.metadata, "version", lambda name: version)
    with pytest.raises(ConfigError, match=rf"needs torchft>=0.2,<0.3, but {version} is") as e:
        require_torchft()
    assert "pip install 'torchft>=0.2,<0.3'" in str(e.value)
    monkeypatch.setattr(engine.metadata, "version", lambda name: "0.2.7")
    require_torchft()  # a 0.2 release is taken


_FT = {"lighthouse": "http://127.0.0.1:29510"}
_REPRODUCIBLE = {"global_batch_size": 8, "micro_batch_size": 2}


def test_the_mode_needs_the_reproducible_mode_and_says_how_to_set_it() -> None:
    from nn_handler.config.training import TrainerConfig

    with pytest.raises(ConfigError, match=r"fault_tolerance: needs reproducible .* set "):
        TrainerConfig(fault_tolerance=_FT)
    assert TrainerConfig(fault_tolerance=_FT, reproducible=_REPRODUCIBLE).fault_tolerance


@pytest.mark.parametrize("address", ["127.0.0.1:29510", "http://127.0.0.1", "grpc://h:1"])
def test_a_lighthouse_address_that_is_not_http_host_port_is_named(address: str) -> None:
    from nn_handler.config.fault_tolerance import FaultToleranceConfig

    with pytest.raises(ConfigError, match=rf"'{re.escape(address)}' is not a Lighthouse address"):
        FaultToleranceConfig(lighthouse=address)


def test_beside_the_mode_each_member_writes_checkpoints_in_a_folder_of_its_own() -> None:
    """A folder has one writer: each member's periodic checkpoints go to <dir>/<member>, where
    a member restarted with the same member_id finds them after the loss of the whole run."""
    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.config.handler import HandlerConfig

    trainer = {"fault_tolerance": {**_FT, "member_id": "m1"}, "reproducible": _REPRODUCIBLE}
    config = HandlerConfig(trainer=trainer, checkpoint={"dir": "/runs/a", "every_n_steps": 5})
    ft = config.trainer.fault_tolerance
    assert ft is not None
    assert ft.member_folder(config.checkpoint.dir) == "/runs/a/m1"
    assert ft.member_folder("s3://b/runs/") == "s3://b/runs/m1"
    assert ft.member_folder(None) is None
    unnamed = FaultToleranceConfig(**_FT).member_folder("/r")
    assert unnamed == f"/r/{socket.gethostname()}-{os.getpid()}"


class _TwoRanks:
    rank, world_size = 1, 2


def test_a_member_is_one_process_not_a_rank_of_a_torchrun_group() -> None:
    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps

    config = FaultToleranceConfig(**_FT)
    with pytest.raises(ConfigError, match=r"rank 1 of 2; each member .* is one process"):
        FaultTolerantSteps(config, None, _TwoRanks())  # type: ignore[arg-type]


class _OneMemberLeft:
    """torchft's Manager as a member left alone sees it: every quorum has one member."""

    _quorum_id = 7
    _client = NoQuorumClient()

    def __init__(self) -> None:
        self.quorums = self.skipped = 0

    def start_quorum(self) -> None:
        self.quorums += 1

    def errored(self) -> None:
        return None

    def num_participants(self) -> int:
        return 1

    def current_step(self) -> int:
        return 41

    def report_error(self, error: BaseException) -> None:
        pass

    def should_commit(self) -> bool:
        self.skipped += 1
        return False

    def batches_committed(self) -> int:
        return 0

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


def test_below_min_members_a_member_waits_then_stops_saying_how_many_are_left() -> None:
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance.replica import Replica

    replica = object.__new__(Replica)
    replica._pulse = NoPulse()
    replica.manager = manager = _OneMemberLeft()
    replica.member_id, replica.lighthouse, replica.min_members = "m0", "http://h:1", 2
    replica.quorum_timeout_s, replica._verdicts = 0.05, _NoVerdicts()
    left = r"member m0: only 1 member\(s\) for step 42, fewer than 2 \(min_members=2\)"
    with pytest.raises(DistributedError, match=left + r".*restart it from its latest checkpoint"):
        replica.begin_step()
    assert manager.quorums >= 2 and manager.skipped == manager.quorums  # waited, did nothing


def test_members_behind_the_runs_committed_steps_never_start_it_again() -> None:
    """New members alone in a quorum (every member with the run's state gone, or left out)
    hold 42 steps of a run that committed 60: they do nothing and wait for the members with
    its state, then stop saying so (they never train the run again from their own step)."""
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance.replica import Replica

    replica = object.__new__(Replica)
    replica._pulse = NoPulse()
    replica.manager = manager = _TwoMembersBehind()
    replica.member_id, replica.lighthouse, replica.min_members = "j8", "http://h:1", 2
    replica.quorum_timeout_s, replica._verdicts = 0.05, _NoVerdicts()
    replica._verdicts.committed = "59"
    behind = r"member j8: members that hold 41 of the run's 60 committed steps \(every member"
    with pytest.raises(DistributedError, match=behind + r".*restart it from its latest checkpoint"):
        replica.begin_step()
    assert manager.quorums >= 2 and manager.skipped == manager.quorums  # waited, did nothing
    replica._verdicts.committed = "40"  # the run's latest step is theirs: they go on
    assert replica.begin_step() is False


class _TwoMembersBehind(_OneMemberLeft):
    def num_participants(self) -> int:
        return 2


def test_a_lighthouse_that_cannot_listen_says_so_instead_of_waiting() -> None:
    from nn_handler.errors import DistributedError

    with (
        Lighthouse(min_members=1) as first,  # its port is taken
        pytest.raises(DistributedError, match=rf"did not start on 127.0.0.1:{first.port}"),
    ):
        Lighthouse(port=first.port, start_timeout_s=20)


class _NoVerdicts:
    """The verdicts' store of a run with no step decided yet (its Lighthouse never lost)."""

    reconnects = 0

    def check(self, keys: list[str]) -> bool:
        return False

    def add(self, key: str, value: int) -> int:
        return value

    def value(self, key: str, default: str) -> str:
        return self.committed if key == COMMITTED else default

    #: The run's latest committed step.
    committed = "-1"


class _GoneStore:
    """The verdicts' store of a Lighthouse that is gone: every request fails."""

    def compare_set(self, *args: Any) -> bytes:
        raise RuntimeError("Connection refused")

    def add(self, *args: Any) -> int:
        raise RuntimeError("Connection refused")

    def check(self, *args: Any) -> bool:
        raise RuntimeError("Connection refused")

    def vote(self, *args: Any) -> tuple[bool, str, bool]:
        raise RuntimeError("Connection refused")


def test_a_verdict_that_cannot_be_read_stops_the_member_naming_the_lighthouse() -> None:
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance.replica import Replica

    replica = object.__new__(Replica)
    replica._pulse = NoPulse()
    replica.manager = _OneMemberLeft()
    replica.member_id, replica.lighthouse, replica.timeout_s = "m0", "http://h:1", 1.0
    replica.failure, replica._verdicts, replica._quorum, replica._attempt = None, _GoneStore(), 7, 0
    replica.quorum_timeout_s = 1.0
    gone = r"member m0: the verdict on step 41 cannot be read .* the Lighthouse at http://h:1"
    with pytest.raises(DistributedError, match=gone):
        replica.commit("batch 1 of its epoch")
    with pytest.raises(
        DistributedError, match=r"m0: the run's members cannot be read .* http://h:1"
    ):
        replica.begin_step()
    with pytest.raises(DistributedError, match=r"m0: the verdicts cannot be read .* http://h:1"):
        replica._first_undecided(7)
    with pytest.raises(
        DistributedError, match=r"m0: the run's run_id cannot be read .* at http://h:1"
    ):
        replica.agree("run_id", "a1")


def test_a_vote_to_a_stopped_lighthouse_stops_the_member_within_its_timeout() -> None:
    """Issue 69, item 17 (a fault campaign's break): a Lighthouse stopped by SIGSTOP while
    the members vote blocked them without a bound (torch's TCPStore client waits for an
    answer whatever its timeout: 76 s and 141 s until killed). A real Lighthouse process,
    stopped: the vote, and any other request, ends within ``timeout_s`` with the
    DistributedError naming the Lighthouse (the member's bounded path)."""
    import os
    import signal
    import time

    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance import Lighthouse
    from nn_handler.training.fault_tolerance.lighthouse import verdicts_of
    from nn_handler.training.fault_tolerance.reconnecting import ReconnectingVerdicts
    from nn_handler.training.fault_tolerance.replica import Replica

    with Lighthouse(min_members=1, join_timeout_s=1.0) as lighthouse:
        replica = object.__new__(Replica)
        replica._pulse = NoPulse()
        replica.manager = _OneMemberLeft()
        replica.member_id, replica.lighthouse, replica.timeout_s = "m0", lighthouse.address, 1.0
        replica.failure, replica._quorum, replica._attempt = None, 7, 0
        # A stopped Lighthouse is retried for quorum_timeout_s (it may be restarted), then
        # its first error stands.
        replica.quorum_timeout_s = 1.0
        store = verdicts_of(lighthouse.address, 1.0)
        replica._verdicts = ReconnectingVerdicts(lighthouse.address, store, 1.0)
        assert replica.agree("run_id", "a1") == "a1"  # it answers while it runs
        os.kill(lighthouse.pid, signal.SIGSTOP)
        try:
            _wait_stopped(lighthouse.pid)
            started = time.monotonic()
            with pytest.raises(DistributedError) as stopped:
                replica.commit("batch 1 of its epoch")
            waited = time.monotonic() - started
            # A member starting now cannot even connect (the stopped server accepts and never
            # answers): named, within the bound too (it hung before).
            from nn_handler.training.fault_tolerance.membership import join_the_run

            unread = r"cannot reach the Lighthouse's verdicts at .* within 1 s \(no answer"
            with pytest.raises(DistributedError, match=unread):
                join_the_run("m9", {"lr": 0.1}, lighthouse.address, 1.0)
        finally:
            os.kill(lighthouse.pid, signal.SIGCONT)
    assert waited < 10, waited  # one request's bound (1 s), not an endless wait
    message = str(stopped.value)
    assert "member m0: the verdict on step 41 cannot be read (TimeoutError: no answer" in message
    assert f"the Lighthouse at {lighthouse.address} is gone" in message


def _wait_stopped(pid: int) -> None:
    """Until ``pid`` is stopped: kill(SIGSTOP) returns before a process that runs on the other
    core stops (under load it once answered the vote sent right after)."""
    import time

    deadline = time.monotonic() + 10
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {pid} did not stop within 10 s"
        time.sleep(0.005)


class _TwoAbandoned:
    """The verdicts' store of a run whose step 41 was abandoned twice in quorum 7."""

    def check(self, keys: list[str]) -> bool:
        return keys[0] in ("41/7/0/verdict", "41/7/1/verdict")


def test_every_member_of_a_quorum_finds_the_same_attempt_in_the_verdicts() -> None:
    """A step's attempt is read from the verdicts, not counted by each member: one that did
    not vote in an abandoned attempt (its state transfer failed) agrees with the others."""
    from nn_handler.training.fault_tolerance.replica import Replica

    replica = object.__new__(Replica)
    replica._pulse = NoPulse()
    replica.manager, replica._verdicts = _OneMemberLeft(), _TwoAbandoned()
    assert replica._first_undecided(7) == 2
    assert replica._first_undecided(8) == 0  # a new quorum starts the step's attempts again


class _Behind:
    """A Replica whose run is at another step than this member's loop."""

    step, rank, members = 5, 0, 1

    def next_attempt(self) -> None:
        pass


def test_a_member_at_another_step_than_the_run_is_stopped_by_name() -> None:
    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps

    config = FaultToleranceConfig(**_FT, member_id="m2")
    steps = FaultTolerantSteps(config, _Exact(), _OneRank())  # type: ignore[arg-type]
    steps.replica = _Behind()
    with pytest.raises(DistributedError, match="member m2 is at step 3, the run at step 5"):
        steps.step(None, lambda batch: torch.zeros(()), 3)  # type: ignore[arg-type]
    steps._in_loop = True  # a member that missed a committed step: the run went on without it
    with pytest.raises(DistributedError, match=r"member m2 is behind the run .* Restart it"):
        steps._join({})


class _OneRank:
    rank, world_size = 0, 1


class _Exact:
    """The exact step's state as FaultTolerantSteps keeps it across attempts."""

    module = torch.nn.BatchNorm1d(2)

    def state_dict(self) -> dict[str, Any]:
        return {"exponents": None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_a_lighthouse_address_where_none_runs_is_named_with_the_fix() -> None:
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance.lighthouse import verdicts_of

    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1] - 1
    address = f"http://127.0.0.1:{port}"
    with pytest.raises(DistributedError, match=rf"is `nn-handler lighthouse --port {port}`"):
        verdicts_of(address, 0.5)


def test_a_member_given_an_address_where_no_lighthouse_answers_is_told_which() -> None:
    """Issue 73's rough edge: a Replica pointed where no Lighthouse runs failed after
    timeout_s with torchft's raw `RuntimeError: failed to connect to http://...` (no
    DistributedError, no word "Lighthouse"). Nothing there: the verdicts' port is named; only
    the verdicts' store there (the quorum port dead): the Lighthouse's address is named."""
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance import Replica
    from nn_handler.training.fault_tolerance.verdicts import VerdictServer

    def member(address: str) -> None:
        Replica(address, "m0", dict, lambda state: None, timeout_s=1.0, quorum_timeout_s=2.0)

    verdicts = VerdictServer("127.0.0.1", 0)
    address = f"http://127.0.0.1:{verdicts.port - 1}"  # the Lighthouse's port: none there
    try:
        with pytest.raises(
            DistributedError, match=rf"m0: cannot reach the Lighthouse at {address} wi"
        ):
            member(address)
    finally:
        verdicts.close()
    with pytest.raises(DistributedError, match=r"cannot reach the Lighthouse's verdicts at 127"):
        member(address)


@pytest.mark.parametrize(
    ("command", "members", "least", "message"),
    [
        ([], 1, 1, r"supervise: no command; give it after --"),
        (["python", "train.py"], 1, 1, r"does not name its member: put \{member\}"),
        (["python", "train.py", "{member}"], 3, 1, r"does not name the Lighthouse: put \{lig"),
        (["t.py", "{member}", "{lighthouse}"], 0, 1, r"members must be >= 1 and max_restarts"),
        (["t.py", "{member}", "{lighthouse}"], 2, 3, r"--min-members 3 is more than the 2 member"),
    ],
)
def test_a_supervisor_given_a_command_it_cannot_run_says_why(
    command: list[str], members: int, least: int, message: str
) -> None:
    """Each refusal names the fix: among them a command with {member} and no {lighthouse}
    (N independent runs, said nothing before) and more --min-members than members."""
    from nn_handler.training.fault_tolerance.supervisor import Supervisor

    with pytest.raises(ConfigError, match=message):
        Supervisor(command, members, min_members=least)
    with pytest.raises(ConfigError, match=r"members must be >= 1 and max_restarts >= 0"):
        Supervisor(["t.py", "{member}", "{lighthouse}"], 2, max_restarts=-1)
    with pytest.raises(ConfigError, match=r"--heartbeat-timeout-s must be > 0, got 0 \(e.g."):
        Supervisor(["t.py", "{member}", "{lighthouse}"], 2, heartbeat_timeout_s=0)


def test_a_given_lighthouse_needs_no_placeholder_and_the_first_step_is_checked() -> None:
    """With --lighthouse given, the command may hold its address itself; start_members below
    min_members (a first step that could never begin) is refused in the configuration."""
    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.training.fault_tolerance.supervisor import Supervisor

    Supervisor(["t.py", "{member}"], 2, lighthouse="http://h:1", min_members=3)
    with pytest.raises(ValueError, match=r"start_members=2 is below min_members=3"):
        FaultToleranceConfig(lighthouse="http://h:1", min_members=3, start_members=2)


def test_a_member_that_exits_is_said_in_words_and_restarted_until_its_restarts_run_out(
    tmp_path: Any,
) -> None:
    """With a Lighthouse given (none started), a member that always fails is restarted
    max_restarts times, then left; the run's status is 1. A program that is not there is a
    ConfigError naming it."""
    from nn_handler.training.fault_tolerance.supervisor import Supervisor, exit_cause

    assert exit_cause(-9) == "killed by SIGKILL" and exit_cause(3) == "exit 3"
    assert exit_cause(-200) == "killed by signal 200"
    failing = [sys.executable, "-c", "import sys; sys.exit(3)", "{member}", "{lighthouse}"]
    supervisor = Supervisor(failing, 2, max_restarts=1, lighthouse="http://h:1", poll_s=0.01)
    assert supervisor.run() == 1 and supervisor.restarts == {"m0": 1, "m1": 1}
    missing = Supervisor([str(tmp_path / "nothing"), "{member}"], 1, lighthouse="http://h:1")
    with pytest.raises(ConfigError, match=r"supervise: cannot start '.*nothing'"):
        missing.run()


def test_nn_handler_supervise_with_a_command_that_names_no_member_says_so_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from nn_handler import cli

    assert cli.main(["supervise", "--members", "2", "--", "python", "train.py"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("nn-handler supervise: the command 'python train.py' does not name")
    assert error.count("\n") == 1


def test_once_a_member_finished_the_run_a_member_that_dies_is_not_restarted() -> None:
    """The run's last step is done when one member finished: a member that dies after that
    is not restarted (it would train alone from its own checkpoint), and the run succeeded."""
    from nn_handler.training.fault_tolerance.supervisor import Supervisor

    late = "import sys, time; sys.argv[1] == 'm0' or (time.sleep(0.5), sys.exit(3))"
    supervisor = Supervisor(
        [sys.executable, "-c", late, "{member}"], 2, lighthouse="http://h:1", poll_s=0.01
    )
    assert supervisor.run() == 0 and supervisor.restarts == {"m0": 0, "m1": 0}


class _FirstWins:
    """The verdicts' store as compare_set sees it: the first value written stands."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.values.setdefault(key, desired.encode())


def test_the_members_agree_on_the_first_run_id_proposed() -> None:
    """The run's id (its trackers' run key): the first member's proposal stands."""
    from nn_handler.training.fault_tolerance.replica import Replica

    replica = object.__new__(Replica)
    replica._pulse = NoPulse()
    replica._verdicts = _FirstWins()
    assert replica.agree("run_id", "a1") == "a1"
    assert replica.agree("run_id", "b2") == "a1"  # a later member takes the run's
    assert replica.agree("other", "b2") == "b2"


def test_a_member_at_another_place_in_the_data_than_the_run_is_stopped_by_name() -> None:
    """Members vote with their step's place in the data: one at another batch of the epoch
    (which summed other samples under the same step) makes the attempt abandoned, stops,
    naming both, and writes no emergency checkpoint of its wrong position."""
    import threading

    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.data.fixed_batches import StepBatch
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance.replica import Replica
    from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps

    store, theirs = _Verdicts(), []
    member = store.other()
    other = threading.Thread(  # the other member votes first, and waits for the verdict
        target=lambda: theirs.append(member.vote("41/7/0", 2, True, "batch 3 of its epoch", 9))
    )
    other.start()
    while "41/7/0/position" not in store.values:
        threading.Event().wait(0.01)
    replica = object.__new__(Replica)
    replica._pulse = NoPulse()
    replica.manager, replica._verdicts, replica.member_id = _AtStep41(), store, "m1b"
    replica._quorum, replica._attempt, replica.failure, replica.timeout_s = 7, 0, None, 1.0
    replica._next = "same"
    config = FaultToleranceConfig(**_FT, member_id="m1b")
    steps = FaultTolerantSteps(config, _Exact(), _OneRank())  # type: ignore[arg-type]
    saved: list[int] = []
    steps.replica, steps._begun, steps._emergency = replica, True, lambda: saved.append(1)
    batch = StepBatch(step=0, micro=(), samples=16)
    with pytest.raises(
        DistributedError, match=r"m1b is at batch 1 of its epoch of step 42, the run at batch 3"
    ):
        steps.step(batch, lambda b: torch.zeros(()), 41)
    other.join(10)
    assert saved == [] and theirs == [(False, "batch 3 of its epoch", True)]  # nobody commits


class _AtStep41(_OneMemberLeft):
    """torchft's Manager of a member at step 41, rank 0 of 2."""

    def current_step(self) -> int:
        return 41

    def num_participants(self) -> int:
        return 2

    def participating_rank(self) -> int:
        return 0


class _LighthouseGone:
    """A Replica whose run cannot agree on a step any more."""

    step = 41

    def next_attempt(self) -> None:
        from nn_handler.errors import DistributedError

        raise DistributedError("member m0: no agreement on the members of step 41")


@pytest.mark.parametrize("disk_full", [False, True])
def test_a_member_that_cannot_go_on_saves_an_emergency_checkpoint_or_says_why_not(
    disk_full: bool, lines: list[str]
) -> None:
    """The run's DistributedError is raised either way, after the emergency save; a save that
    fails is said in one line naming its cause, and does not replace the run's error."""
    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.data.fixed_batches import StepBatch
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps

    saved: list[int] = []

    def save() -> str:
        if disk_full:
            raise OSError(28, "No space left on device")
        saved.append(41)
        return "/ckpt/m0/ckpt-e0001-s00000041.pt"

    config = FaultToleranceConfig(**_FT, member_id="m0")
    steps = FaultTolerantSteps(config, _Exact(), _OneRank())  # type: ignore[arg-type]
    steps.replica, steps._emergency = _LighthouseGone(), save
    with pytest.raises(DistributedError, match="no agreement on the members of step 41"):
        steps.step(StepBatch(step=0, micro=(), samples=16), lambda b: torch.zeros(()), 41)
    said = [line for line in lines if "emergency checkpoint" in line]
    assert len(said) == 1
    if disk_full:
        assert saved == [] and "could not be written (OSError: [Errno 28] No space" in said[0]
    else:
        assert saved == [41] and "its 41 committed steps: /ckpt/m0/" in said[0]


class _EveryAgreementFails(_OneMemberLeft):
    """torchft's Manager when every change of group fails (its store unreachable)."""

    class _Failed:
        original_exception = RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection refused. "
            "This is typically caused by a remote worker crashing.\nframe #0: ..."
        )

    def num_participants(self) -> int:
        return 3

    def errored(self) -> Any:
        return self._Failed()


class _Verdicts:
    """A real verdicts' store (its server in this process, a member's client of it, as a
    Replica has); its values are the server's."""

    def __init__(self) -> None:
        from nn_handler.training.fault_tolerance.reconnecting import ReconnectingVerdicts
        from nn_handler.training.fault_tolerance.verdicts import VerdictServer, VerdictStore

        self.server = VerdictServer("127.0.0.1", 0)
        self.values = self.server.verdicts.values
        lighthouse = f"http://127.0.0.1:{self.server.port - 1}"  # its store is on port + 1
        store = VerdictStore("127.0.0.1", self.server.port, 10.0)
        self.client = ReconnectingVerdicts(lighthouse, store, 10.0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def other(self) -> Any:
        """A client of another member (its own connection)."""
        from nn_handler.training.fault_tolerance.verdicts import VerdictStore

        return VerdictStore("127.0.0.1", self.server.port, 10.0)


def test_agreements_that_keep_failing_stop_the_member_instead_of_trying_forever() -> None:
    """A state transfer or a group's change that fails is voted abort and agreed again; when
    every agreement fails for quorum_timeout_s, the member stops naming the last cause in one
    line (no endless loop: nothing hangs)."""
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance.replica import Replica

    replica = object.__new__(Replica)
    replica._pulse = NoPulse()
    replica.manager = manager = _EveryAgreementFails()
    replica._verdicts, replica.member_id, replica.lighthouse = _Verdicts(), "m2", "http://h:1"
    replica.min_members, replica.quorum_timeout_s, replica.timeout_s = 1, 0.05, 1.0
    replica._reach = reach = NoPartition()
    with pytest.raises(DistributedError) as caught:
        replica.begin_step()
    message = str(caught.value)
    assert message.startswith("member m2: every agreement on the members of step 42 failed for")
    assert "(the last: Connection refused)" in message and "\n" not in message
    assert manager.quorums >= 2 and replica._verdicts.values["41/7/0/verdict"] == "abort"
    assert reach.checks == manager.quorums  # who is cut off, asked after each failure


class _Member:
    """A Replica at rank ``rank`` of ``members`` whose every attempt commits."""

    step, agreed = 0, False

    def __init__(self, rank: int, members: int) -> None:
        self.rank, self.members = rank, members

    def commit(self, position: str = "", leaving: bool = False) -> bool:
        return True


def test_members_beyond_max_members_are_spares_that_train_no_micro_batch() -> None:
    """max_members=2 of 3: ranks 0 and 1 split the step's micro-batches as a run of two
    would; rank 2 takes part in the sum with none of its own. max_members below
    min_members is refused by name."""
    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.data.fixed_batches import MicroBatch, StepBatch
    from nn_handler.errors import ConfigError
    from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps

    config = FaultToleranceConfig(**_FT, member_id="m", max_members=2)
    batch = StepBatch(step=0, micro=tuple(MicroBatch(i, 4, None) for i in range(4)), samples=16)
    trained: dict[int, list[int]] = {}
    for rank in range(3):
        steps = FaultTolerantSteps(config, _Exact(), _OneRank())  # type: ignore[arg-type]
        steps.replica, steps._begun = _Member(rank, 3), True

        def run(mine: StepBatch, rank: int = rank) -> torch.Tensor:
            trained[rank] = [m.index for m in mine.micro]
            return torch.zeros(())

        steps.step(batch, run, 0)
    assert trained == {0: [0, 2], 1: [1, 3], 2: []}
    with pytest.raises(ConfigError, match="max_members=1 is below min_members=2"):
        FaultToleranceConfig(**_FT, min_members=2, max_members=1)


def test_a_lighthouse_port_taken_is_named_and_its_store_port_let_go() -> None:
    """`nn-handler lighthouse --port P` with P taken: a DistributedError naming both ports,
    and the verdicts' store it had opened on P + 1 closed (with port 0 the start tries other
    pairs: a store left open on each would hold its port for the Lighthouse's life)."""
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance.lighthouse import serve
    from tests.harness import free_port

    port = free_port()
    while not _free(port + 1):
        port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(DistributedError, match=rf"cannot listen on 127.0.0.1:{port} and \+1"):
            serve("127.0.0.1", port, 1, 1.0, 1.0)
    assert _free(port + 1), "the store's port is still held"


class _AbandonedThenGone:
    """A Replica whose step is abandoned, after which the run cannot agree on its members."""

    step, rank, members, run_position, agreed = 41, 0, 2, "batch 1 of its epoch", False

    def next_attempt(self) -> None:
        from nn_handler.errors import DistributedError

        raise DistributedError("member m0: no agreement on the members of step 42")

    def commit(self, position: str = "", leaving: bool = False) -> bool:
        return False


def test_an_abandoned_step_is_said_before_the_run_stops(lines: list[str]) -> None:
    """The line of an abandoned attempt waits for the next agreement (to say the members
    left); when that agreement fails, the line is still said, once, before the error."""
    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.data.fixed_batches import StepBatch
    from nn_handler.errors import DistributedError
    from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps

    config = FaultToleranceConfig(**_FT, member_id="m0")
    steps = FaultTolerantSteps(config, _Exact(), _OneRank())  # type: ignore[arg-type]
    steps.replica, steps._begun, steps._members = _AbandonedThenGone(), True, 2
    with pytest.raises(DistributedError, match="no agreement on the members of step 42"):
        steps.step(StepBatch(step=0, micro=(), samples=16), lambda b: torch.zeros(()), 41)
    said = [line for line in lines if "abandoned by the run" in line]
    assert len(said) == 1 and said[0].endswith("redone by the members left"), said


class _FinishGone:
    """A Replica whose Lighthouse is gone when the run's end is said."""

    closed = False

    def finish(self) -> None:
        from nn_handler.errors import DistributedError

        raise DistributedError("member m0: the run's end cannot be read (...): gone")

    def close(self) -> None:
        self.closed = True


def test_a_completed_fit_whose_lighthouse_is_gone_still_ends_quietly() -> None:
    """The training is done: a Lighthouse that cannot keep the run's end is no error, and the
    member still leaves its run (closed); a fit that failed does not say the run ended."""
    from nn_handler.config.fault_tolerance import FaultToleranceConfig
    from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps

    steps = FaultTolerantSteps(FaultToleranceConfig(**_FT), _Exact(), _OneRank())  # type: ignore[arg-type]
    gone = _FinishGone()
    steps.replica = gone
    steps.end_fit(completed=True)
    assert gone.closed and steps.replica is None
    failed = _FinishGone()
    failed.finish = lambda: pytest.fail("a failed fit said the run ended")  # type: ignore[method-assign]
    steps.replica = failed
    steps.end_fit(completed=False)
    assert failed.closed


def test_run_finished_is_a_quiet_exit_0_that_names_the_member_and_survives_pickling() -> None:
    from nn_handler import RunFinished

    finished = RunFinished("m5", 12, "http://127.0.0.1:29510")
    assert isinstance(finished, SystemExit) and not isinstance(finished, Exception)
    assert finished.code == 0 and "member m5: the run of the Lighthouse at http" in str(finished)
    again = pickle.loads(pickle.dumps(finished))
    assert (again.member, again.step, again.lighthouse, again.code) == (
        "m5",
        12,
        finished.lighthouse,
        0,
    )


def test_a_preemption_after_the_vote_waits_for_the_next_step_that_says_it_leaves() -> None:
    """A member stops only after a step whose vote said it leaves: a SIGTERM that comes after
    its vote holds the stop (the watch's ``hold``) until the next vote says so."""
    from types import SimpleNamespace

    from nn_handler.distributed.communicator.null import NullCommunicator
    from nn_handler.distributed.faults.preemption import PreemptionWatch
    from nn_handler.training.fault_tolerance.mode import _preempted

    watch = PreemptionWatch(NullCommunicator(), torch.device("cpu"), interval_s=1.0)
    checkpoints = SimpleNamespace(hook=SimpleNamespace(watch=watch))
    assert _preempted(checkpoints) is False  # the vote: it stays
    watch.requested = True  # the SIGTERM, after the vote
    assert watch.agreed(7) is False  # held: the others expect it at the next step
    assert _preempted(checkpoints) is True  # the next vote says it leaves
    assert watch.agreed(8) is True
    assert _preempted(SimpleNamespace(hook=None)) is False  # no folder: no watch


def test_a_state_in_flight_is_held_once_as_bytes_on_each_side() -> None:
    """What the memory plan counts for a join (its item "a member's join"): the sender holds
    the state's bytes once (the payload is a view of them), the receiver reads them where they
    arrived (only torch's own tensors: the payload and the state it loads)."""
    import tracemalloc

    transport, _ = _transport()
    state = {"w": torch.arange(2**21, dtype=torch.float32)}  # 8 MiB
    size = 4 * 2**21
    tracemalloc.start()
    try:
        transport.send_checkpoint([1], 2, state, timedelta(seconds=1))
        sent = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        received = transport.recv_checkpoint(0, "", 2, timedelta(seconds=1))
        read = tracemalloc.get_traced_memory()[1] - tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert torch.equal(received["w"], state["w"])
    assert size <= sent < 1.5 * size, sent
    assert read < 0.25 * size, read


def test_a_member_of_several_ranks_without_its_stores_port_is_refused_first() -> None:
    """Its ranks meet at its store, where rank 0 listens: the port must be the same on each,
    so a free one chosen by rank 0 alone cannot do; said before any connection is made."""
    from nn_handler.training.fault_tolerance import Replica

    with pytest.raises(ConfigError, match=r"member m0: a member of 2 ranks needs its store's port"):
        Replica("http://127.0.0.1:1", "m0", dict, print, group_rank=1, group_size=2)
