"""Run by tests/distributed/test_sharded_checkpoints.py under the real torchrun (not by pytest).

Usage: torchrun --nproc-per-node=2 torchrun_sharded_kill.py CKPT_DIR WHEN

Trains the tests' MLP with FSDP2 for 3 epochs with a sharded checkpoint after each, and dies
inside the second save: WHEN 'before_shards' SIGKILLs rank 1 as it starts writing its shards;
'before_commit' SIGKILLs rank 0 once every shard and DCP's index are written, just before the
rename that commits the folder. The job never finishes (torchrun stops the other rank).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parents[2]))

from nn_handler import HandlerConfig, NNHandler
from nn_handler.checkpoint import sharded
from nn_handler.checkpoint.store import local
from tests.training_helpers import mlp, regression_data


def _die_on_second(original: Any, rank: int) -> Any:
    calls = {"n": 0}

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2 and int(os.environ["RANK"]) == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(*args, **kwargs)

    return wrapped


def main() -> None:
    folder, when = Path(sys.argv[1]), sys.argv[2]
    if when == "before_shards":
        sharded.dcp_save = _die_on_second(sharded.dcp_save, rank=1)  # type: ignore[assignment]
    else:
        local.commit_folder = _die_on_second(local.commit_folder, rank=0)  # type: ignore[assignment]
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 4, "shuffle": True, "seed": 3},
            "trainer": {
                "accumulate_grad_batches": 2,
                "progress_bar": False,
                "strategy": "fsdp",
                "fsdp": {"blocks": ["Linear"]},
            },
            "checkpoint": {"dir": str(folder), "keep_last": 5, "resume": "never"},
        }
    )
    optimizer = torch.optim.Adam
    with NNHandler(mlp(), optimizer, nn.CrossEntropyLoss(), config=config) as handler:
        handler.train(regression_data(), epochs=3)


if __name__ == "__main__":
    main()
