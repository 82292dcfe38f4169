"""Run by tests/distributed/test_stall_watchdog.py on 2 ranks (by hand or under torchrun), not
by pytest: one desync or stall SCENARIO with a short stall timeout; each rank writes
OUT/rank{R}.json with what it raised, its message, a stall's report and when, then re-raises.

Usage: python stall_scenarios.py OUT SCENARIO
SCENARIO: 'hook' (rank 1 sleeps in an after_step hook inside fit), 'skip' (rank 1 skips one
all_reduce, then works on), 'dtype' (float32 on rank 0, int32 on rank 1), 'shape' ([4] and
[6]), 'op' (broadcast on rank 0, all_reduce on rank 1), 'kill' (rank 1 is killed by SIGKILL
while rank 0 is in an all_reduce), 'validate' (rank 1's own validation fails before a
collective and it carries on with other work).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from nn_handler import Hook, NNHandler
from nn_handler.config import DistributedConfig
from nn_handler.distributed import DistributedContext
from tests.training_helpers import regression_data

STALL_TIMEOUT = 2.0
SLEEP = 60.0


class SleepInHook(Hook):
    def after_step(self) -> None:
        trainer = self.trainer
        if trainer.comm.rank == 1 and trainer.state.global_step == 3:
            _stall_begins()
            time.sleep(SLEEP)  # hook-rank1: the line the report must name


def _stall_begins() -> None:
    (Path(sys.argv[1]) / "stall.json").write_text(json.dumps({"time": time.time()}))


def hook() -> None:
    data = regression_data(n=400)
    config = {
        "loader": {"batch_size": 4},
        "trainer": {"progress_bar": False},
        "distributed": {"timeout": 60, "stall_timeout": STALL_TIMEOUT},
    }
    model, loss = nn.Linear(6, 3), nn.CrossEntropyLoss()
    with NNHandler(model, lambda p: torch.optim.SGD(p, lr=0.1), loss, config=config,
                   hooks=[SleepInHook()]) as handler:  # fmt: skip
        handler.train(data, epochs=1)


def user_code(scenario: str) -> None:
    config = DistributedConfig.model_validate({"timeout": 60, "stall_timeout": STALL_TIMEOUT})
    with DistributedContext(config) as context:
        comm, rank = context.communicator, context.rank
        comm.all_reduce(torch.ones(4))
        if scenario == "skip":
            if rank == 0:
                comm.all_reduce(torch.ones(4))  # skip-first (rank 0 only)
            comm.all_reduce(torch.ones(4))  # skip-second (both ranks)
            _stall_begins()
            time.sleep(SLEEP)  # rank 1 works on; rank 0 waits in skip-second
        elif scenario == "dtype":
            if rank == 0:
                comm.all_reduce(torch.ones(4, dtype=torch.float32))  # dtype-rank0
            else:
                comm.all_reduce(torch.ones(4, dtype=torch.int32))  # dtype-rank1
            time.sleep(SLEEP)  # both work on with what gloo returned
        elif scenario == "shape":
            if rank == 0:
                comm.all_reduce(torch.ones(4))  # shape-rank0
            else:
                comm.all_reduce(torch.ones(6))  # shape-rank1
            time.sleep(SLEEP)
        elif scenario == "op":
            if rank == 0:
                comm.broadcast(torch.ones(4), src=0)  # op-rank0
            else:
                comm.all_reduce(torch.ones(4))  # op-rank1
            time.sleep(SLEEP)
        elif scenario == "kill":
            if rank == 1:
                (Path(sys.argv[1]) / "left.json").write_text(json.dumps({"time": time.time()}))
                os.kill(os.getpid(), signal.SIGKILL)
            comm.all_reduce(torch.ones(4))  # kill-rank0
        elif scenario == "validate":
            if rank == 1:
                try:
                    raise ValueError("rank 1's own validation failed")
                except ValueError:
                    _stall_begins()
                    time.sleep(SLEEP)  # validate-rank1: handles it locally, goes on
            comm.all_reduce(torch.ones(4))  # validate-both


def last_moment(scenario: str) -> None:
    """'last-dtype' and 'last-op': a mismatch in the process's last collective (gloo passes
    both silently) and the group torn down at once; the context's teardown compares once
    more, so both ranks raise instead of leaving with garbage and status 0."""
    config = DistributedConfig.model_validate({"timeout": 60, "stall_timeout": STALL_TIMEOUT})
    with DistributedContext(config) as context:
        comm, rank = context.communicator, context.rank
        comm.all_reduce(torch.ones(4))
        if scenario == "last-dtype":
            if rank == 0:
                comm.all_reduce(torch.ones(4, dtype=torch.float32))  # last-dtype-rank0
            else:
                comm.all_reduce(torch.ones(4, dtype=torch.int32))  # last-dtype-rank1
        elif rank == 0:
            comm.all_reduce(torch.ones(4), op="sum")  # last-op-rank0
        else:
            comm.all_reduce(torch.ones(4), op="max")  # last-op-rank1
    _stall_begins()  # not reached when the teardown raises


def save_on_rank_zero() -> None:
    """'save-rank0': handler.save() under ``if rank == 0`` (every rank must call it), then
    both ranks close their handlers."""
    config = {
        "loader": {"batch_size": 4},
        "trainer": {"progress_bar": False},
        "distributed": {"timeout": 60, "stall_timeout": 30},
    }
    model, loss = nn.Linear(6, 3), nn.CrossEntropyLoss()
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    with NNHandler(model, sgd, loss, config=config) as handler:
        handler.train(regression_data(n=16), epochs=1)
        if handler.rank == 0:
            _stall_begins()
            handler.save(Path(sys.argv[1]) / "model.pt")  # save-rank0


def main() -> None:
    out, scenario = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    started = time.time()
    try:
        if scenario == "hook":
            hook()
        elif scenario.startswith("last-"):
            last_moment(scenario)
        elif scenario == "save-rank0":
            save_on_rank_zero()
        else:
            user_code(scenario)
    except Exception as error:
        report = {
            "type": type(error).__name__,
            "message": str(error),
            "report": getattr(error, "report", None),
            "seconds": time.time() - started,
            "time": time.time(),
        }
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        raise
    (out / f"rank{rank}.json").write_text(json.dumps({"type": None, "message": ""}))


if __name__ == "__main__":
    main()
