"""One training function for Ray Train workers and torchrun ranks (tests/distributed/
test_ray_train.py): resume_helpers' small run, with the RayTrainReport bridge, optional faults
and a bound on its own run time.

Under torchrun: ``python -m torch.distributed.run ... tests/ray_helpers.py '<json settings>'``
(with the repository on PYTHONPATH).
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from nn_handler import Hook, NNHandler
from nn_handler.ray_train import RayTrainReport
from tests.reproducible_helpers import EPOCHS as REPRODUCIBLE_EPOCHS
from tests.reproducible_helpers import WORKLOADS, digest
from tests.reproducible_helpers import config as reproducible_config
from tests.resume_helpers import EPOCHS, adam, config, model
from tests.training_helpers import regression_data

#: Seconds after which a worker prints every thread's stack and exits (a hang fails the test
#: with each rank's traceback instead of waiting for pytest's bound).
HANG_BOUND_S = 150


class FaultAt(Hook):
    """After optimizer step ``step`` on rank ``rank``: SIGKILL this process (once per
    ``marker`` file: the restarted group goes on), or raise ValueError."""

    def __init__(self, step: int, rank: int, kind: str, marker: str | None = None) -> None:
        super().__init__()
        self.step, self.rank, self.kind, self.marker = step, rank, kind, marker

    def after_optimizer_step(self) -> None:
        trainer = self.trainer
        if trainer.state.global_step != self.step or trainer.comm.rank != self.rank:
            return
        if self.kind == "raise":
            raise ValueError(f"a bad batch on rank {self.rank} at step {self.step}")
        marker = Path(str(self.marker))
        if not marker.exists():
            marker.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)


def train_loop(settings: dict[str, Any]) -> None:
    """Train resume_helpers' model for EPOCHS epochs with checkpoints every 2 steps in
    ``settings['dir']``; rank 0 saves the History and weights to ``settings['out']``.
    ``settings['fault']``: {'step', 'rank', 'kind': 'kill' | 'raise', 'marker'};
    ``settings['reproducible']``: reproducible_helpers' CNN in the reproducible mode instead."""
    faulthandler.dump_traceback_later(HANG_BOUND_S, exit=True)
    try:
        torch.set_num_threads(1)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        hooks: list[Hook] = [RayTrainReport()]
        if settings.get("fault"):
            hooks.append(FaultAt(**settings["fault"]))
        if settings.get("reproducible"):
            reproducible_run(settings, hooks)
            return
        with NNHandler(
            model(),
            adam,
            nn.CrossEntropyLoss(),
            config=config(Path(settings["dir"]), world, features=False),
            hooks=hooks,
        ) as handler:
            history = handler.train(regression_data(), epochs=EPOCHS)
            if handler.is_main_process:
                weights = {k: v.detach().clone() for k, v in handler.model.state_dict().items()}
                torch.save({"history": history.records, "weights": weights}, settings["out"])
    finally:
        faulthandler.cancel_dump_traceback_later()


def reproducible_run(settings: dict[str, Any], hooks: list[Hook]) -> None:
    """reproducible_helpers' CNN in the reproducible mode (checkpoints every 3 of its 12
    steps); rank 0 saves the run's digest to ``settings['out']``."""
    cnn, data, samples, _, _ = WORKLOADS["cnn"]
    with NNHandler(
        cnn(),
        lambda p: torch.optim.Adam(p, lr=3e-3),
        nn.CrossEntropyLoss(),
        config=reproducible_config("cnn", Path(settings["dir"])),
        hooks=hooks,
    ) as handler:
        handler.train(data(samples, 0), data(40, 1), epochs=REPRODUCIBLE_EPOCHS)
        done = digest(handler)  # every rank
        if handler.is_main_process:
            torch.save({"digest": done, "world_size": handler.world_size}, settings["out"])


if __name__ == "__main__":
    train_loop(json.loads(sys.argv[1]))


def report_foreign(settings: dict[str, Any]) -> None:
    """On the run's first start: report a checkpoint nn_handler did not write
    (``settings['foreign']``, a folder), then fail. On Ray's restart, which is given that
    checkpoint: :func:`train_loop`, whose resume must refuse it."""
    import ray.train

    if ray.train.get_checkpoint() is not None:
        train_loop(settings)
        return
    checkpoint = ray.train.Checkpoint.from_directory(settings["foreign"])
    ray.train.report({"epoch": 0}, checkpoint=checkpoint)
    raise RuntimeError("stopped after reporting a foreign checkpoint")
