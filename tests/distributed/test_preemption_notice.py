"""A preemption notice that only one rank gets (its own notice file) stops every rank after
the same optimizer step, with one emergency checkpoint, as a SIGTERM to one rank does."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from nn_handler import Hook, NNHandler, TrainingPreempted
from tests.harness import run_group
from tests.training_helpers import mlp, regression_data, sgd

pytestmark = pytest.mark.distributed


class NoticeOnRankOne(Hook):
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def after_optimizer_step(self) -> None:
        trainer = self.trainer
        if trainer.comm.rank == 1 and trainer.state.global_step == 2:
            self.marker.touch()
            watch = trainer.checkpointing.hook.watch
            deadline = time.monotonic() + 10
            while not watch.requested and time.monotonic() < deadline:
                time.sleep(0.01)


def _ranks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    marker = Path(folder) / f"notice-rank{rank}"  # each rank polls its own: rank 1's appears
    config = {
        "loader": {"batch_size": 4},
        "trainer": {"progress_bar": False},
        "checkpoint": {
            "dir": str(Path(folder) / "ckpt"),
            "preemption_notice": str(marker),
            "preemption_notice_interval_s": 0.02,
            "preemption_check_interval_s": 0.01,
        },
    }
    with NNHandler(
        mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=[NoticeOnRankOne(marker)]
    ) as handler:
        try:
            handler.train(regression_data(), epochs=5)
        except TrainingPreempted as stop:
            return {"step": stop.global_step, "checkpoint": stop.checkpoint}
    return {"step": None}


def test_a_notice_on_one_rank_stops_every_rank_at_the_same_step(tmp_path: Path) -> None:
    results = run_group(_ranks, 2, args=(str(tmp_path),), init="env", timeout=90)
    steps = {r["step"] for r in results}
    assert len(steps) == 1 and None not in steps, results
    step = steps.pop()
    assert step >= 2 and results[0]["checkpoint"] == results[1]["checkpoint"], results
    latest = json.loads((tmp_path / "ckpt" / "latest.json").read_text())
    assert latest["reason"] == "preempted" and latest["global_step"] == step
    assert Path(results[0]["checkpoint"]).exists()
