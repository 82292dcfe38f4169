"""Run by tests/unit/test_tracking_after_kill.py (not by pytest): a tracked training (CSV,
MLflow, TensorBoard; every step logged) that SIGKILLs itself at WHEN, as a preempted or crashed
job is; relaunched with WHEN 'none' it resumes from the latest checkpoint.

Usage: python tracked_kill.py RUN_DIR WHEN
WHEN: 'epoch-record' (epoch 2's record is logged by the trackers, then the process dies before
the epoch's checkpoint: the last checkpoint is the step checkpoint at the same step),
'before-checkpoint' (dies at step 2, before any checkpoint), 'none' (runs to the end).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[2]))

from nn_handler import Hook, NNHandler
from tests.training_helpers import mlp, regression_data

EPOCHS, STEPS_PER_EPOCH = 3, 5


class DieAt(Hook):
    order = 20  # after the trackers (10) have logged; the checkpoint hook runs after all

    def __init__(self, when: str) -> None:
        super().__init__()
        self.when = when

    def after_step(self) -> None:
        if self.when == "before-checkpoint" and self.trainer.state.global_step == 2:
            os.kill(os.getpid(), signal.SIGKILL)

    def after_epoch(self) -> None:
        if self.when == "epoch-record" and self.trainer.state.epoch == 2:
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    run, when = Path(sys.argv[1]), sys.argv[2]
    config = {
        "loader": {"batch_size": 8, "shuffle": True, "seed": 1},
        "trainer": {"progress_bar": False},
        "logging": {
            "dir": str(run / "logs"),
            "trackers": [
                {"type": "csv", "every_n_steps": 1},
                {"type": "mlflow", "experiment": "killed", "every_n_steps": 1},
                {"type": "tensorboard", "every_n_steps": 1},
            ],
        },
        "checkpoint": {"dir": str(run / "ckpt"), "every_n_steps": 5, "keep_last": 3,
                       "resume": "auto"},
    }  # fmt: skip
    sgd = lambda p: torch.optim.SGD(p, lr=0.1)  # noqa: E731
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=[DieAt(when)]) as h:
        h.train(regression_data(n=8 * STEPS_PER_EPOCH), epochs=EPOCHS)


if __name__ == "__main__":
    main()
