"""Run by tests/distributed/test_step_fault_tolerance.py (not by pytest): one member of a
fault-tolerant NNHandler run (trainer.fault_tolerance over the reproducible mode's CNN with
BatchNorm and dropout, tests/reproducible_helpers.py), which may SIGKILL itself in a step.

Usage: python ft_trainer_member.py LIGHTHOUSE RUN_DIR MEMBER_ID STARTERS [KILL_STEP WHEN]
WHEN: 'forward' (dies in the step's first forward: the others' sum fails) or 'vote' (after the
step's sum, before its vote: the others wait for it). RUN_DIR/<id>.json gets the run's SHA-256
(weights, buffers, optimizer state, History) and the attempts redone. FT_MIN_MEMBERS in its
environment sets min_members (default 1).
"""

from __future__ import annotations

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

from nn_handler import NNHandler
from nn_handler.training.fault_tolerance.replica import Replica
from tests.reproducible_helpers import WORKLOADS, config, digest, train


def die_in_forward(h: NNHandler, step: int) -> None:
    def forward(module: nn.Module, args: Any) -> None:
        if h.trainer.state.global_step == step and module.training:
            os.kill(os.getpid(), signal.SIGKILL)

    h.trainer.module.register_forward_pre_hook(forward)


def die_before_voting(step: int) -> None:
    commit = Replica.commit

    def dying(replica: Replica) -> bool:
        if replica.step == step:
            os.kill(os.getpid(), signal.SIGKILL)
        return commit(replica)

    Replica.commit = dying  # type: ignore[method-assign]


def main(lighthouse: str, run: Path, member: str, starters: int, *kill: str) -> None:
    settings: dict[str, Any] = {
        "lighthouse": lighthouse,
        "member_id": member,
        "min_members": int(os.environ.get("FT_MIN_MEMBERS", "1")),
        "timeout_s": 3.0,
        "quorum_timeout_s": 10.0,
    }
    model = WORKLOADS["cnn"][0]
    h = NNHandler(
        model(),
        lambda p: torch.optim.Adam(p, lr=3e-3),
        nn.CrossEntropyLoss(),
        config=config("cnn", fault_tolerance=settings),
    )
    if kill and kill[1] == "forward":
        die_in_forward(h, int(kill[0]))
    elif kill:
        die_before_voting(int(kill[0]))
    (run / f"ready-{member}").touch()
    while len(list(run.glob("ready-*"))) < starters:
        time.sleep(0.01)
    train(h, "cnn")
    steps = h.trainer.reproducible.fault_tolerance  # type: ignore[union-attr]
    report = {"digest": digest(h), "redone": steps.redone if steps else 0}
    (run / f"{member}.json").write_text(json.dumps(report))
    h.close()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4]), *sys.argv[5:])
