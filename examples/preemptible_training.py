"""A training script that survives preemption, restarts and crashes.

    python examples/preemptible_training.py --dir runs/digits            # one process
    torchrun --nproc-per-node=2 --max-restarts=3 examples/preemptible_training.py --dir runs/d

Run it again with the same --dir (after a kill, a SIGTERM, or with more --epochs) and it
continues exactly where the last complete checkpoint left it. On SIGTERM every rank stops after
the same step, writes an emergency checkpoint and exits with status 75; under SLURM, requeue
the job on that status (docs/checkpoints.md has a batch script).
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from nn_handler import NNHandler, accuracy
from nn_handler.digits import DigitsCNN, digits_datasets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", required=True, help="the checkpoint folder (shared by ranks)")
    parser.add_argument("--epochs", type=int, default=6)
    args = parser.parse_args()

    torch.manual_seed(0)
    train, val = digits_datasets()
    config = {
        "loader": {"batch_size": 32, "shuffle": True, "seed": 0},
        "trainer": {"progress_bar": False},
        "checkpoint": {
            "dir": args.dir,
            "every_n_steps": 20,  # and after every epoch
            "keep_last": 2,
            "save_best": True,
            "monitor": "val_accuracy",
            "mode": "max",
            "resume": "auto",  # continue whatever run left checkpoints in --dir
        },
    }
    with NNHandler(
        DigitsCNN(),
        lambda params: torch.optim.Adam(params, lr=3e-3),
        nn.CrossEntropyLoss(),
        config=config,
        metrics={"accuracy": accuracy},
    ) as handler:
        history = handler.train(train, val, epochs=args.epochs)
        if handler.is_main_process:
            accuracies = ", ".join(f"{a:.3f}" for a in history["val_accuracy"])
            print(f"epochs done: {len(history)}; val accuracy by epoch: {accuracies}")
            print(f"optimizer steps: {handler.trainer.state.global_step}")


if __name__ == "__main__":
    main()
