"""Run by tests/distributed/test_handler_launchers.py under the real torchrun (not by pytest).

Usage: torchrun --nproc-per-node=2 torchrun_digits.py OUTDIR
Trains the small digits CNN with NNHandler exactly as a user script would, unchanged from one
process; each rank writes its view of the run to OUTDIR/rank<r>.json.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

from nn_handler import NNHandler, accuracy
from nn_handler.digits import DigitsCNN, digits_datasets


def main() -> None:
    outdir = Path(sys.argv[1])
    started = time.perf_counter()
    torch.manual_seed(0)
    train, val = digits_datasets()
    with NNHandler(
        DigitsCNN(),
        lambda params: torch.optim.Adam(params, lr=3e-3),
        nn.CrossEntropyLoss(),
        config={"loader": {"batch_size": 32}, "trainer": {"epochs": 12}},
        metrics={"accuracy": accuracy},
    ) as handler:
        history = handler.train(train, val)
        result = {
            "rank": handler.rank,
            "world_size": handler.world_size,
            "ddp": type(handler.trainer.model).__name__,
            "val_accuracy": history["val_accuracy"],
            "seconds": time.perf_counter() - started,
        }
    (outdir / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
