"""Run by tests/unit/test_run_identity.py (not by pytest): one experiment writing its
checkpoints into RUN_DIR/ckpt, as a job launched by hand would.

Usage: python shared_folder.py RUN_DIR LR RESUME EPOCHS [HOLD_S]
Trains the tests' MLP with SGD(lr=LR) for EPOCHS epochs (checkpoint.resume=RESUME, keep_last
2); with HOLD_S, prints 'holding' after the first epoch and sleeps HOLD_S seconds (a live job
holding the folder). Prints 'ERROR: <type>: <message>' and exits 1 on an nn_handler error.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[2]))

from nn_handler import Hook, NNHandler, NNHandlerError
from tests.training_helpers import mlp, regression_data


class Hold(Hook):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def after_epoch(self) -> None:
        if self.trainer.state.epoch == 1:
            print("holding", flush=True)
            time.sleep(self.seconds)


def main() -> None:
    run, lr, resume, epochs = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    hooks = [Hold(float(sys.argv[5]))] if len(sys.argv) > 5 else []
    config = {
        "loader": {"batch_size": 8, "shuffle": True, "seed": 1},
        "trainer": {"progress_bar": False},
        "checkpoint": {"dir": str(run / "ckpt"), "keep_last": 2, "resume": resume},
    }
    sgd = lambda p: torch.optim.SGD(p, lr=lr)  # noqa: E731
    try:
        with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=hooks) as h:
            h.train(regression_data(), epochs=epochs)
            print(f"trained to epoch {h.trainer.state.epoch}", flush=True)
    except NNHandlerError as error:
        print(f"ERROR: {type(error).__name__}: {error}", flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
