"""Run by tests/distributed/test_step_fault_tolerance.py (not by pytest): one member of a
fault-tolerant NNHandler run (trainer.fault_tolerance over the reproducible mode's CNN with
BatchNorm and dropout, tests/reproducible_helpers.py), which may SIGKILL itself in a step.

Usage: python ft_trainer_member.py LIGHTHOUSE RUN_DIR MEMBER_ID STARTERS [KILL_STEP WHEN]
WHEN: 'forward' (dies in the step's first forward: the others' sum fails), 'vote' (after the
step's sum, before its vote: the others wait for it), 'save' (in the middle of writing the
periodic checkpoint after that step), 'validate' (in the first forward of the validation
after that step: between two steps), 'term' (a SIGTERM in the step's first forward: a
preemption) or 'notice' (with FT_CHECKPOINTS: the file of its ``preemption_notice``,
RUN_DIR/notice-<id>, appears in the step's first forward: a preemption without a signal).
Its environment: FT_CHECKPOINTS=1 writes periodic checkpoints (every 3 steps) in
RUN_DIR/checkpoints/<id> and resumes from them (resume 'auto', or FT_RESUME's);
FT_KILL=MEMBER:STEP:WHEN the kill for that member only, on its first start (a command that
`nn-handler supervise` gives every member, and again to a restarted one);
FT_AWAIT_RESTART=MEMBER:STEP holds every other member from STEP on until MEMBER, restarted,
trains (see await_restart); FT_KILL_LIGHTHOUSE=PID:STEP:JOINER kills the Lighthouse once
JOINER joined, after STEP (see kill_lighthouse); FT_QUORUM_TIMEOUT_S sets quorum_timeout_s
(default 10), FT_START_MEMBERS start_members, FT_MIN_MEMBERS min_members (default 1),
FT_MAX_MEMBERS max_members, FT_REDUCTION the mode's reduction ('exact' or 'float'); FT_LR,
FT_SEED and FT_THREADS another learning rate, mode's seed and thread count than the run's (a
member the run must refuse).
Every member has a CSV tracker in RUN_DIR/tracked (shared: the run's first member writes it).
RUN_DIR/<id>.json gets the run's SHA-256 (weights, buffers, optimizer state, History), the
attempts redone, the steps done, the steps it ran a micro-batch of (0-based; a spare runs
none), the training samples it loaded in each step, and why it stopped early (exit 1) if it
did;
RUN_DIR/<id>.pt its weights.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parents[2]))

import torch
from torch import nn
from torch.utils.data import Dataset

from nn_handler import NNHandler
from nn_handler.checkpoint import restart_count, single_file
from nn_handler.errors import DistributedError
from nn_handler.training.fault_tolerance.replica import Replica
from tests.reproducible_helpers import EPOCHS, WORKLOADS, config, digest


def die_in_forward(h: NNHandler, step: int) -> None:
    def forward(module: nn.Module, args: Any) -> None:
        if h.trainer.state.global_step == step and module.training:
            os.kill(os.getpid(), signal.SIGKILL)

    h.trainer.module.register_forward_pre_hook(forward)


def die_in_validation(h: NNHandler, step: int) -> None:
    """SIGKILL in the first forward of the validation that follows optimizer step ``step``
    (between two steps: no step of the run's is in flight)."""

    def forward(module: nn.Module, args: Any) -> None:
        if h.trainer.state.global_step == step and not module.training:
            os.kill(os.getpid(), signal.SIGKILL)

    h.trainer.module.register_forward_pre_hook(forward)


def preempted_in_forward(h: NNHandler, step: int) -> None:
    """A SIGTERM (a preemption) in the step's first forward: the step goes on, the member
    stops after it."""

    def forward(module: nn.Module, args: Any) -> None:
        if h.trainer.state.global_step == step and module.training:
            os.kill(os.getpid(), signal.SIGTERM)

    h.trainer.module.register_forward_pre_hook(forward)


def noticed_in_forward(h: NNHandler, notice: Path, step: int) -> None:
    """A preemption notice (``checkpoint.preemption_notice``: a file that appears) in the
    step's first forward: the member stops at a step boundary soon after, without a signal."""

    def forward(module: nn.Module, args: Any) -> None:
        if h.trainer.state.global_step == step and module.training:
            notice.touch()

    h.trainer.module.register_forward_pre_hook(forward)


def die_before_voting(step: int) -> None:
    commit = Replica.commit

    def dying(replica: Replica, position: str = "", leaving: bool = False) -> bool:
        if replica.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(replica, position, leaving)

    Replica.commit = dying  # type: ignore[method-assign]


def die_in_save(step: int) -> None:
    """SIGKILL in the middle of writing the periodic checkpoint of ``step``: half its bytes
    are in the staging file."""
    write = single_file.write_file

    def dying(checkpoint: Any, path: Path, **kwargs: Any) -> None:
        if int(checkpoint["trainer"]["global_step"]) == step:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            Path(path).write_bytes(buffer.getvalue()[: buffer.tell() // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        write(checkpoint, path, **kwargs)

    single_file.write_file = dying  # type: ignore[assignment]


def kill_lighthouse(h: NNHandler, run: Path, pid: int, step: int, joiner: str) -> None:
    """Kill the Lighthouse (process ``pid``) once ``joiner`` joined the run: this member waits
    in its first forward of ``step`` for the joiner's process to be up, then takes 0.5 s more
    per forward until the joiner is in (so that the run does not end before it joins), and
    kills it in the first forward after the join."""
    waited = False

    def forward(module: nn.Module, args: Any) -> None:
        nonlocal waited
        if h.trainer.state.global_step < step or not module.training:
            return
        if not waited:
            end = time.monotonic() + 60
            while not (run / f"ready-{joiner}").exists() and time.monotonic() < end:
                time.sleep(0.01)
            waited = True
        if "joined the run" in (run / f"{joiner}.log").read_text():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        else:  # slow steps until the joiner is in (its start can take seconds on a busy host)
            time.sleep(0.5)

    h.trainer.module.register_forward_pre_hook(forward)


def await_restart(h: NNHandler, run: Path, member: str, awaited: str, step: int) -> None:
    """The restarted ``awaited`` member says when its process is up (RUN_DIR/up-MEMBER) and
    when it trains (its first forward: it is in the run; RUN_DIR/restarted-MEMBER). The
    others, in their first forward from ``step`` on, wait for it to be up (a new interpreter:
    seconds on a busy host), then take 0.5 s more per forward until it trains, so that the
    run does not end before it joins; 60 s at most in all."""
    up, trains = run / f"up-{awaited}", run / f"restarted-{awaited}"
    if member == awaited:
        if restart_count(os.environ) > 0:
            up.touch()
            h.trainer.module.register_forward_pre_hook(
                lambda module, args: trains.touch() if module.training else None
            )
        return
    end = time.monotonic() + 60

    def forward(module: nn.Module, args: Any) -> None:
        if h.trainer.state.global_step < step or not module.training or trains.exists():
            return
        while not up.exists() and time.monotonic() < end:
            time.sleep(0.05)
        if time.monotonic() < end:
            time.sleep(0.5)

    h.trainer.module.register_forward_pre_hook(forward)


class Loaded(Dataset[Any]):
    """``data`` (the training set), noting which samples are loaded in which step."""

    def __init__(self, data: Dataset[Any], h: NNHandler, loaded: dict[int, list[int]]) -> None:
        self.data, self.h, self.loaded = data, h, loaded

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, index: int) -> Any:
        self.loaded.setdefault(self.h.trainer.state.global_step, []).append(index)
        return self.data[index]


def main(lighthouse: str, run: Path, member: str, starters: int, *kill: str) -> None:
    settings: dict[str, Any] = {
        "lighthouse": lighthouse,
        "member_id": member,
        "min_members": int(os.environ.get("FT_MIN_MEMBERS", "1")),
        "timeout_s": 3.0,
        "quorum_timeout_s": float(os.environ.get("FT_QUORUM_TIMEOUT_S", "10")),
    }
    if os.environ.get("FT_START_MEMBERS"):
        settings["start_members"] = int(os.environ["FT_START_MEMBERS"])
    if os.environ.get("FT_MAX_MEMBERS"):
        settings["max_members"] = int(os.environ["FT_MAX_MEMBERS"])
    if os.environ.get("FT_KILL") and restart_count(os.environ) == 0:
        target, *when = os.environ["FT_KILL"].split(":")
        kill = tuple(when) if target == member else ()
    folder = run / "checkpoints" if os.environ.get("FT_CHECKPOINTS") else None
    # One CSV tracker in a folder every member shares: the run's first member writes it.
    settings_of_run = config("cnn", folder, run / "tracked", fault_tolerance=settings)
    if folder is not None:
        settings_of_run["checkpoint"]["resume"] = os.environ.get("FT_RESUME", "auto")
    notice = run / f"notice-{member}"
    if folder is not None and kill and kill[1] == "notice":
        settings_of_run["checkpoint"]["preemption_notice"] = str(notice)
        settings_of_run["checkpoint"]["preemption_notice_interval_s"] = 0.02
    if os.environ.get("FT_REDUCTION"):
        settings_of_run["trainer"]["reproducible"]["reduction"] = os.environ["FT_REDUCTION"]
    if os.environ.get("FT_SEED"):  # another run, or a member started with another seed
        settings_of_run["trainer"]["reproducible"]["seed"] = int(os.environ["FT_SEED"])
    if os.environ.get("FT_THREADS"):
        torch.set_num_threads(int(os.environ["FT_THREADS"]))
    lr = float(os.environ.get("FT_LR", "3e-3"))
    model = WORKLOADS["cnn"][0]
    h = NNHandler(
        model(),
        lambda p: torch.optim.Adam(p, lr=lr),
        nn.CrossEntropyLoss(),
        config=settings_of_run,
    )
    trained: set[int] = set()  # the steps this member ran a micro-batch of (a spare: none)
    h.trainer.module.register_forward_pre_hook(
        lambda module, args: trained.add(h.trainer.state.global_step) if module.training else None
    )
    if kill and kill[1] == "forward":
        die_in_forward(h, int(kill[0]))
    elif kill and kill[1] == "validate":
        die_in_validation(h, int(kill[0]))
    elif kill and kill[1] == "term":
        preempted_in_forward(h, int(kill[0]))
    elif kill and kill[1] == "notice":
        noticed_in_forward(h, notice, int(kill[0]))
    elif kill and kill[1] == "save":
        die_in_save(int(kill[0]))
    elif kill:
        die_before_voting(int(kill[0]))
    if os.environ.get("FT_AWAIT_RESTART"):
        awaited, step = os.environ["FT_AWAIT_RESTART"].split(":")
        await_restart(h, run, member, awaited, int(step))
    if os.environ.get("FT_KILL_LIGHTHOUSE"):
        pid, step, joiner = os.environ["FT_KILL_LIGHTHOUSE"].split(":")
        kill_lighthouse(h, run, int(pid), int(step), joiner)
    (run / f"ready-{member}").touch()
    while len(list(run.glob("ready-*"))) < starters:
        time.sleep(0.01)
    stopped = ""
    _, data, n, _, _ = WORKLOADS["cnn"]
    loaded: dict[int, list[int]] = {}  # step -> the training samples loaded in it
    try:
        h.train(Loaded(data(n, 0), h, loaded), data(40, 1), epochs=EPOCHS)
    except DistributedError as error:  # the run cannot go on step by step
        stopped = str(error)
    steps = h.trainer.mode.steps  # type: ignore[attr-defined]
    exact = h.trainer.mode.inner.exact  # type: ignore[attr-defined]
    plan = h.trainer.memory.plan
    width = 2 + len(exact.norms.layers) + exact.norms.width + len(exact.params)
    report = {
        # What the exact sum holds (its kept copy of each step's sum included), the plan's
        # items, and the slots (a row per micro-batch, in the sum and in its copy; not planned).
        "memory": [
            exact.held_bytes(),
            {item: size for item, size, _ in plan.items} if plan else {},
            8 * width * exact.config.micro_batches * 2,
        ],
        "digest": digest(h),
        "redone": steps.redone if steps else 0,
        "trained": sorted(trained),
        "loaded": {step: sorted(samples) for step, samples in sorted(loaded.items())},
        "step": h.trainer.state.global_step,
        "stopped": stopped,
    }
    (run / f"{member}.json").write_text(json.dumps(report))
    if h.is_reporting_process:  # the README's `if handler.is_reporting_process:` writes once
        (run / f"reporter-{member}").touch()
    torch.save(h.model.state_dict(), run / f"{member}.pt")  # the weights, for tolerances
    h.close()
    if stopped:
        sys.exit(1)


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), *sys.argv[5:])
