"""An error at the after_train_epoch point on one rank, where the throughput monitor runs its
collective: the other rank, waiting in that collective, stops with the error (no hang)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from torch import nn

from nn_handler import Hook, NNHandler
from tests.harness import run_group
from tests.timeouts import scaled_now
from tests.training_helpers import mlp, regression_data, sgd

pytestmark = pytest.mark.distributed


class FailOnRankOne(Hook):
    order = -100  # before the monitor's all_reduce: rank 0 waits in it

    def after_train_epoch(self) -> None:
        if self.trainer.comm.rank == 1:
            raise ValueError("rank 1's hook broke after its training batches")


def _train(rank: int, world_size: int) -> dict[str, Any]:
    started = time.monotonic()
    config = {"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}}
    handler = NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=[FailOnRankOne()])
    try:
        handler.train(regression_data(), epochs=1)
    except Exception as error:
        return {
            "raised": type(error).__name__,
            "text": str(error),
            "seconds": time.monotonic() - started,
        }
    finally:
        handler.close()
    return {"raised": None}


def test_a_failure_before_the_monitors_collective_stops_every_rank() -> None:
    waiting, failed = run_group(_train, 2, init="env", timeout=90)
    assert failed["raised"] == "ValueError", failed
    assert waiting["raised"] == "RankFailedError", waiting
    assert "rank 1" in waiting["text"] and "hook broke" in waiting["text"], waiting
    assert waiting["seconds"] < scaled_now(60), waiting  # stopped at once, not at a timeout
