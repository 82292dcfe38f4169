"""Run by tests/distributed/test_orphaned_workers.py under the real torchrun (not by pytest).

Usage: torchrun --nproc-per-node=2 orphaned_worker.py OUT CKPT_DIR

Trains slowly (0.1 s a batch) for many epochs with a checkpoint every 2 optimizer steps; each
rank writes OUT/rank<R>.json (its pid) once it trains, OUT/rank<R>-steps.txt (the time each
batch ended) and OUT/rank<R>-error.txt with the error that stopped it. The test SIGKILLs
torchrun's agent and watches the workers.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[2]))

from nn_handler import Hook, NNHandler
from tests.training_helpers import mlp, regression_data


class Slow(Hook):
    def __init__(self, out: Path) -> None:
        self.out = out

    def after_step(self) -> None:
        rank = self.trainer.comm.rank
        marker = self.out / f"rank{rank}.json"
        if not marker.exists():
            marker.write_text(json.dumps({"pid": os.getpid()}))
        with (self.out / f"rank{rank}-steps.txt").open("a") as steps:
            steps.write(f"{self.trainer.state.batch_index} {time.time()}\n")
        time.sleep(0.1)


def main() -> None:
    out, folder = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    config = {
        "loader": {"batch_size": 4},
        "trainer": {"progress_bar": False},
        "distributed": {"stall_timeout": 60.0},  # the watchdog looks every 2 s (its most)
        "checkpoint": {"dir": str(folder), "every_n_steps": 2, "keep_last": 1000},
    }
    try:
        with NNHandler(
            mlp(), lambda p: torch.optim.SGD(p, lr=0.01), nn.CrossEntropyLoss(),
            config=config, hooks=[Slow(out)],
        ) as handler:  # fmt: skip
            handler.train(regression_data(), epochs=500)
    except BaseException:
        (out / f"rank{rank}-error.txt").write_text(traceback.format_exc())
        raise


if __name__ == "__main__":
    main()
