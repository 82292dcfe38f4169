"""Run under torchrun by tests/distributed/test_fault_tolerance.py (not by pytest): three
NNHandlers in a row in one process, as a notebook, a sweep or a test suite makes them, each
joining and leaving its own process group through torchrun's store. Each rank writes
OUT/rank<r>.json with every handler's final train loss and world size.

Usage: torchrun --nproc-per-node=2 torchrun_handlers.py OUT
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from nn_handler import NNHandler


def main() -> None:
    out = Path(sys.argv[1])
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(32, 6, generator=generator), torch.randint(0, 3, (32,), generator=generator)
    )
    runs = []
    for trial in range(3):
        torch.manual_seed(trial)
        with NNHandler(
            nn.Linear(6, 3),
            lambda p: torch.optim.SGD(p, lr=0.1),
            nn.CrossEntropyLoss(),
            config={"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}},
        ) as handler:
            history = handler.train(data, epochs=2)
            runs.append({"loss": history.last["train_loss"], "world": handler.world_size})
            rank = handler.rank
    (out / f"rank{rank}.json").write_text(json.dumps(runs))


if __name__ == "__main__":
    main()
