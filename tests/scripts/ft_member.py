"""Run by tests/distributed/test_step_fault_tolerance.py (not by pytest): one member of a
fault-tolerant run of tests/ft_helpers.py's problem, which may SIGKILL itself in a step.

Usage: python ft_member.py LIGHTHOUSE RUN_DIR MEMBER_ID STARTERS [KILL_STEP WHEN]
STARTERS: how many members start together (each waits for the others' ready-* files in RUN_DIR
before its first step; 0: join a run already going). WHEN: 'before' (dies before the step's
sum), 'after' (after it, before the commit), 'stop' (SIGSTOPs itself before the sum: a hang; the
test kills it at the end) or 'slow' (sleeps 4.5 s before the sum, once: alive, but slower than
the collectives' timeout; RUN_DIR/<id>.slow gets the time); RUN_DIR/<id>.died gets the time just
before a death. RUN_DIR/<id>.step has the step it is at, RUN_DIR/<id>.in the latest step it
was told it is a member of (the latest it can have given a sum to), RUN_DIR/<id>.commits each
commit's step, time, samples and sum of sample ids as it comes (kept by a member killed later);
RUN_DIR/<id>.json gets the report: the final weights' SHA-256, the ledger of committed steps
(step, samples, sum of sample ids, members, time), the steps abandoned and redone (and each
abandoned attempt's step, this member's cause of it and time), the
addresses this process listens on besides its replica group's store, and why and when it
stopped early (exit 1) if it did. With FT_HOLD_AT=N[,M...] in its environment it waits before
step N until RUN_DIR/release-N exists; FT_STEPS and FT_STEP_S set the run's steps and a step's
sleep, FT_MIN_MEMBERS its min_members (default 2), FT_QUORUM_TIMEOUT_S its quorum_timeout_s
(default 5); FT_DIE_IN_TRANSFER=receive|send makes it die
in the middle of a state transfer (see die_in_transfers); FT_KILL=MEMBER:KILL_STEP:WHEN gives
member MEMBER those arguments (for a command that is the same for every member);
FT_LATE_QUORUM_S=S makes its first request for a quorum reach the Lighthouse S seconds after it
asked to join (a loaded machine's delay between the two), FT_QUORUM_AFTER=PATH only once PATH
exists (RUN_DIR/<id>.asked is made when it asked to join). A member that finishes the run says
so (Replica.finish); one that starts after that writes RUN_DIR/<id>.finished (the time it learnt
it) and exits 0 (RunFinished).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parents[2]))

from nn_handler.errors import DistributedError, PeerLostError, RunFinished
from nn_handler.training.fault_tolerance import Replica
from nn_handler.training.fault_tolerance.transport import VerifiedTransport
from tests.ft_helpers import FEATURES, STEPS, apply, batch_of, data, digest, slots

#: A step's compute, so that kills and joins land mid-run; the steps of the run.
STEP_S = float(os.environ.get("FT_STEP_S", "0.05"))
RUN_STEPS = int(os.environ.get("FT_STEPS", str(STEPS)))
#: How long a 'slow' member takes over its step: longer than the collective timeout (3 s).
SLOW_S = 4.5


def die_in_transfers(run: Path, side: str) -> None:
    """This member dies in the middle of a state transfer, once in the run: as its receiver
    (after the header, before the bytes), or as its sender once a receiver died (so the two
    deaths come in that order, in two transfers)."""
    send, receive = VerifiedTransport.send_checkpoint, VerifiedTransport.recv_checkpoint
    received, sent = run / "receiver.died", run / "sender.died"

    def sending(self: VerifiedTransport, **kwargs: Any) -> None:
        if side == "send" and received.exists() and not sent.exists():
            header = torch.tensor([1, 0, kwargs["step"]], dtype=torch.int64)
            self._group.send([header], kwargs["dst_ranks"][0], tag=101).wait()
            _die(run, "", signal.SIGKILL, sent)
        send(self, **kwargs)

    def receiving(self: VerifiedTransport, **kwargs: Any) -> Any:
        if side == "receive":
            header = torch.zeros(3, dtype=torch.int64)
            self._group.recv([header], kwargs["src_rank"], tag=101).wait()
            _die(run, "", signal.SIGKILL, received)
        return receive(self, **kwargs)

    VerifiedTransport.send_checkpoint = sending  # type: ignore[method-assign]
    VerifiedTransport.recv_checkpoint = receiving  # type: ignore[method-assign]


def main(
    lighthouse: str, run: Path, member: str, starters: int, kill_step: int = -1, when: str = ""
) -> None:
    if os.environ.get("FT_DIE_IN_TRANSFER"):
        die_in_transfers(run, os.environ["FT_DIE_IN_TRANSFER"])
    x, y = data()
    w = torch.zeros(FEATURES, dtype=torch.float64)
    replica = Replica(
        lighthouse,
        member,
        state_dict=lambda: {"w": w},
        load_state_dict=lambda state: w.copy_(state["w"]),
        min_members=int(os.environ.get("FT_MIN_MEMBERS", "2")),
        timeout_s=3.0,
        quorum_timeout_s=float(os.environ.get("FT_QUORUM_TIMEOUT_S", "5")),
    )
    late, after = float(os.environ.get("FT_LATE_QUORUM_S", "0")), os.environ.get("FT_QUORUM_AFTER")
    if late or after:
        _late_first_quorum(replica, late, Path(after) if after else None)
    (run / f"ready-{member}").touch()
    while len(list(run.glob("ready-*"))) < starters:
        time.sleep(0.01)
    ledger, redone, stopped, stopped_at, slowed, begun = [], 0, "", 0.0, False, False
    abandoned: list[list[Any]] = []  # each attempt abandoned: step, this member's cause, time
    holds = {int(step) for step in os.environ.get("FT_HOLD_AT", "").split(",") if step}
    while replica.step < RUN_STEPS:
        (run / f"{member}.step").write_text(str(replica.step))
        if replica.step in holds:  # until the test has done what it waits for
            end = time.monotonic() + 60
            while not (run / f"release-{replica.step}").exists() and time.monotonic() < end:
                time.sleep(0.01)
        try:  # the first step waits for the members that start together
            if begun:
                replica.next_attempt()  # agreed again only after an abort or a join
            else:
                replica.begin_step(starters or None)
                begun = True
        except DistributedError as error:  # no quorum: the Lighthouse is gone
            stopped, stopped_at = str(error), time.time()
            break
        except RunFinished as finished:  # started after the run's end: nothing to train
            (run / f"{member}.finished").write_text(repr(time.time()))
            print(finished, file=sys.stderr)
            raise
        step, rank, members = replica.step, replica.rank, replica.members
        _write(run / f"{member}.in", str(step))  # the latest step it can have been part of
        mine = [i for j, i in enumerate(batch_of(step)) if j % members == rank]
        row = slots(w, mine, x, y)
        time.sleep(STEP_S)
        if step == kill_step and when in ("before", "stop"):
            _die(run, member, signal.SIGKILL if when == "before" else signal.SIGSTOP)
        if step == kill_step and when == "slow" and not slowed:  # alive, slower than timeout_s
            (run / f"{member}.slow").write_text(repr(time.time()))
            time.sleep(SLOW_S)
            slowed = True
        try:
            summed = replica.communicator.all_reduce(row)
        except PeerLostError:  # a member lost: the commit says no (any other error is a bug)
            summed = None
        if step == kill_step and when == "after":
            _die(run, member, signal.SIGKILL)
        try:
            counts = replica.commit(str(step))
        except DistributedError as error:  # the verdict cannot be read: the Lighthouse is gone
            stopped, stopped_at = str(error), time.time()
            break
        if counts and summed is not None:
            apply(w, summed)
            committed = [step, int(summed[FEATURES]), int(summed[FEATURES + 1]), members]
            ledger.append([*committed, time.time()])
            with open(run / f"{member}.commits", "a") as commits:  # kept if killed later
                commits.write(" ".join(map(repr, [step, ledger[-1][-1], *committed[1:3]])) + "\n")
        else:
            redone += 1
            abandoned.append([step, str(replica.failure or ""), time.time()])
    if not stopped:
        replica.finish()
    store = f":{replica.store_port}"
    listening = {
        f"{c.laddr.ip}:{c.laddr.port}"
        for c in psutil.Process().net_connections("inet")
        if c.status == "LISTEN"
    }
    replica.close()
    report = {
        "steps": replica.step,
        "stopped": stopped,
        "stopped_at": stopped_at,
        "digest": digest(w),
        "ledger": ledger,
        "redone": redone,
        "abandoned": abandoned,
        "listening": sorted(a for a in listening if not a.endswith(store)),
    }
    (run / f"{member}.json").write_text(json.dumps(report))
    if stopped:
        print(stopped, file=sys.stderr)
        sys.exit(1)


def _late_first_quorum(replica: Replica, late_s: float, after: Path | None) -> None:
    """The first request for a quorum leaves ``late_s`` seconds after it is made, or once
    ``after`` exists (for at most a minute)."""
    start = replica.manager.start_quorum

    def late_start(*args: Any, **kwargs: Any) -> Any:
        replica.manager.start_quorum = start
        (Path(sys.argv[2]) / f"{replica.member_id}.asked").touch()  # it asked to join
        time.sleep(late_s)
        end = time.monotonic() + 60
        while after is not None and not after.exists() and time.monotonic() < end:
            time.sleep(0.01)
        return start(*args, **kwargs)

    replica.manager.start_quorum = late_start


def _write(path: Path, text: str) -> None:
    """``text`` in ``path`` whole or not at all (this process may be SIGKILLed any time)."""
    staged = path.with_suffix(".tmp")
    staged.write_text(text)
    os.replace(staged, path)


def _die(run: Path, member: str, how: signal.Signals, mark: Path | None = None) -> None:
    (mark or run / f"{member}.died").write_text(repr(time.time()))
    os.kill(os.getpid(), how)


if __name__ == "__main__":
    lighthouse, run, member, starters, *kill = sys.argv[1:]
    named = os.environ.get("FT_KILL", "").split(":")  # MEMBER:KILL_STEP:WHEN, one member's
    if not kill and named[0] == member:
        kill = named[1:]
    main(lighthouse, Path(run), member, int(starters), *(int(kill[0]), kill[1]) if kill else ())  # type: ignore[arg-type]
