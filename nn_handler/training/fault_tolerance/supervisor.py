"""Supervisor: the launcher of a fault-tolerant run on one machine (``nn-handler supervise``).
It starts a Lighthouse (unless given one) and N members, each a process of its own running
the user's command, and restarts only the member that died (the others go on: torchrun would
stop them all), or its Lighthouse at the same address (the members carry on through the new
one: no member stops). A restarted member keeps its ``member_id``, so it finds its checkpoint
folder, is told it is a restart (NN_HANDLER_RESTART_COUNT, as torchrun's TORCHELASTIC_RESTART_COUNT:
``resume: on_restart`` resumes from that folder), and joins the run where it is.

The command names its member and the Lighthouse with ``{member}`` and ``{lighthouse}``, which
each member's command line gets in its place:

    nn-handler supervise --members 3 -- python train.py --lighthouse {lighthouse} --member {member}
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence

from loguru import logger

from nn_handler.checkpoint.naming import SUPERVISE_RESTART_COUNT
from nn_handler.errors import ConfigError, DistributedError
from nn_handler.training.fault_tolerance.lighthouse import Lighthouse
from nn_handler.training.fault_tolerance.orphans import ending_with_this_process


def exit_cause(code: int) -> str:
    """A process's exit status in words (``-9``: killed by SIGKILL)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


class Supervisor:
    """Runs ``members`` processes of ``command`` (``{member}``: ``m0``, ``m1``...;
    ``{lighthouse}``: the Lighthouse's address) and restarts each one that fails, up to
    ``max_restarts`` times per member (and its own Lighthouse as many times).

    Args:
        lighthouse: the address of a Lighthouse already running (None: start one here, with
            ``min_members``, ``join_timeout_s``, ``heartbeat_timeout_s`` and ``host``).
        heartbeat_timeout_s: a member silent that long is left out of the next step: a
            dead member's step is agreed again about this long after its death.
        poll_s: how often the members are looked at.
    """

    def __init__(
        self,
        command: Sequence[str],
        members: int,
        *,
        max_restarts: int = 3,
        lighthouse: str | None = None,
        min_members: int = 1,
        join_timeout_s: float = 60.0,
        host: str = "127.0.0.1",
        poll_s: float = 0.2,
        heartbeat_timeout_s: float = 1.0,
    ) -> None:
        if not command:
            raise ConfigError(
                "supervise: no command; give it after --, e.g. "
                "`nn-handler supervise --members 3 -- python train.py --member {member}`."
            )
        if "{member}" not in " ".join(command):
            raise ConfigError(
                f"supervise: the command {' '.join(command)!r} does not name its member: put "
                f"{{member}} where its member_id goes (each member needs its own, and a "
                f"restarted one the same)."
            )
        if lighthouse is None and "{lighthouse}" not in " ".join(command):
            raise ConfigError(
                f"supervise: the command {' '.join(command)!r} does not name the Lighthouse: "
                f"put {{lighthouse}} where its address goes (e.g. a --lighthouse {{lighthouse}} "
                f"of your script's), or every member would train a run of its own."
            )
        if members < 1 or max_restarts < 0:
            raise ConfigError(
                f"supervise: members must be >= 1 and max_restarts >= 0, got {members} and "
                f"{max_restarts}."
            )
        if heartbeat_timeout_s <= 0:
            raise ConfigError(
                f"supervise: --heartbeat-timeout-s must be > 0, got {heartbeat_timeout_s:g} "
                f"(e.g. 1.0; 0.5 for a faster recovery on a machine that is not overloaded)."
            )
        if lighthouse is None and min_members > members:
            raise ConfigError(
                f"supervise: --min-members {min_members} is more than the {members} member(s) "
                f"it starts: no step could ever be committed; lower --min-members or raise "
                f"--members."
            )
        self.command = list(command)
        self.members = members
        self.max_restarts = max_restarts
        self.lighthouse = lighthouse
        self.min_members = min_members
        self.join_timeout_s = join_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.host = host
        self.poll_s = poll_s
        #: How many times each member was restarted, and the Lighthouse.
        self.restarts: dict[str, int] = {}
        self.lighthouse_restarts = 0
        self.log = logger.bind(rank=0)

    def run(self) -> int:
        """Until every member has ended: 0 when the run finished (a member ended it: the
        others end with it, and one that dies then is not restarted), 1 otherwise.
        Interrupted (Ctrl-C, SIGTERM), it stops every member and its Lighthouse."""
        if self.lighthouse is not None:
            return self._run(self.lighthouse)
        with Lighthouse(
            self.host,
            min_members=self.min_members,
            join_timeout_s=self.join_timeout_s,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            standby=True,  # a loaded spare: a restart in 0.1 s, not 1.5 s
        ) as lighthouse:
            self.log.info("supervise: Lighthouse at {}", lighthouse.address)
            return self._run(lighthouse.address, lighthouse)

    def _run(self, address: str, lighthouse: Lighthouse | None = None) -> int:
        names = [f"m{i}" for i in range(self.members)]
        self.restarts = dict.fromkeys(names, 0)
        self.lighthouse_restarts = 0
        procs = {name: self._start(name, address) for name in names}
        ended: dict[str, int] = {}
        try:
            while len(ended) < len(procs):
                time.sleep(self.poll_s)
                if lighthouse is not None and lighthouse.poll() is not None:
                    lighthouse = self._restart_lighthouse(lighthouse)
                for name, proc in procs.items():
                    code = proc.poll()
                    if name in ended or code is None:
                        continue
                    over = any(c == 0 for c in ended.values())  # the run's last step is done
                    if code == 0 or over or self.restarts[name] >= self.max_restarts:
                        ended[name] = code
                        self._ended(name, code, over)
                        continue
                    self.restarts[name] += 1
                    self.log.warning(
                        "supervise: member {} {}; restarted ({} of {}): it joins the run",
                        name, exit_cause(code), self.restarts[name], self.max_restarts,
                    )  # fmt: skip
                    procs[name] = self._start(name, address)
        finally:
            for proc in procs.values():  # interrupted: no member outlives its supervisor
                if proc.poll() is None:
                    proc.terminate()
            for proc in procs.values():
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
        return 0 if any(code == 0 for code in ended.values()) else 1

    def _restart_lighthouse(self, lighthouse: Lighthouse) -> Lighthouse | None:
        """Start ``lighthouse`` again at its address (None: no more, after ``max_restarts``
        or a start that failed: the members then stop after their quorum_timeout_s)."""
        code = lighthouse.poll() or 0
        if self.lighthouse_restarts >= self.max_restarts:
            self.log.error(
                "supervise: the Lighthouse {} after {} restart(s): not restarted again (the "
                "members stop once their quorum_timeout_s passes)",
                exit_cause(code), self.lighthouse_restarts,
            )  # fmt: skip
            return None
        self.lighthouse_restarts += 1
        try:
            lighthouse.restart()
        except DistributedError as error:
            self.log.error("supervise: {}", error)
            return None
        self.log.warning(
            "supervise: the Lighthouse {}; restarted at {} ({} of {}): the members carry on "
            "through it",
            exit_cause(code), lighthouse.address, self.lighthouse_restarts, self.max_restarts,
        )  # fmt: skip
        return lighthouse

    def _start(self, name: str, address: str) -> subprocess.Popen[bytes]:
        line = [p.replace("{member}", name).replace("{lighthouse}", address) for p in self.command]
        # torchft's Rust side logs every step at INFO unless told otherwise (the Lighthouse's
        # own does the same): the members' logs keep to nn_handler's lines.
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        # A restart is marked as torchrun marks its own: `resume: on_restart` resumes from
        # the member's checkpoints then (a first start over them is refused).
        env[SUPERVISE_RESTART_COUNT] = str(self.restarts.get(name, 0))
        try:
            # A member gets SIGTERM (a preemption: its checkpoint, then exit) if the
            # supervisor is killed, instead of running on re-parented to PID 1.
            return subprocess.Popen(line, env=env, preexec_fn=ending_with_this_process())
        except OSError as error:
            raise ConfigError(f"supervise: cannot start {line[0]!r} ({error}).") from None

    def _ended(self, name: str, code: int, over: bool = False) -> None:
        if code == 0:
            self.log.info("supervise: member {} finished", name)
        elif over:
            self.log.warning(
                "supervise: member {} {} after the run's end: not restarted", name,
                exit_cause(code),
            )  # fmt: skip
        else:
            self.log.error(
                "supervise: member {} {}, after {} restart(s): not restarted again (the "
                "others go on)",
                name, exit_cause(code), self.max_restarts,
            )  # fmt: skip


__all__ = ["Supervisor", "exit_cause"]
