"""The same NNHandler script under torchrun, nn_handler.launch and a SLURM allocation, and
the convergence of the small digits CNN with 2 gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import NNHandler, launch
from tests.harness import free_port, run_command, run_group, slurm_env, torchrun_command
from tests.timeouts import scaled
from tests.training_helpers import max_difference, mlp, regression_data, sgd, state_of

pytestmark = pytest.mark.distributed
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def test_digits_cnn_reaches_95_percent_with_two_gloo_ranks_under_torchrun(
    tmp_path: Path,
) -> None:
    pytest.importorskip("sklearn")
    code, output = run_command(
        torchrun_command(SCRIPTS / "torchrun_digits.py", str(tmp_path)), timeout=120
    )
    assert code == 0, output
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank, result in enumerate(results):
        assert (result["rank"], result["world_size"]) == (rank, 2)
        assert result["ddp"] == "DistributedDataParallel"
    assert results[0]["val_accuracy"] == results[1]["val_accuracy"]  # reduced, so shared
    assert results[0]["val_accuracy"][-1] >= 0.95, results[0]["val_accuracy"]


def _train_small() -> dict[str, Any]:
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"loader": {"batch_size": 4}}) as h:
        history = h.train(regression_data(), epochs=2)
        wrapped = type(h.trainer.model).__name__
    return {
        "world": h.world_size,
        "rank": h.rank,
        "loss": history["train_loss"],
        "state": state_of(h.model),
        "wrapped": wrapped,
        # close() drops the DDP wrapper before the group goes (a late reducer can hang exit)
        "after_close": type(h.trainer.model).__name__,
    }


def test_the_same_handler_code_runs_under_launch_and_in_one_process() -> None:
    results = launch(_train_small, 2, deadline=scaled(90))
    assert [r["rank"] for r in results] == [0, 1] and results[0]["world"] == 2
    assert [(r["wrapped"], r["after_close"]) for r in results] == [
        ("DistributedDataParallel", "Sequential")
    ] * 2
    assert max_difference(results[0]["state"], results[1]["state"]) == 0.0
    single = _train_small()
    assert single["world"] == 1 and len(single["loss"]) == 2
    assert torch.isfinite(torch.tensor(single["loss"])).all()


def _slurm_rank(rank: int, world_size: int) -> dict[str, Any]:
    return _train_small()


def test_the_same_handler_code_runs_in_a_slurm_allocation() -> None:
    port = free_port(12000, 32000)  # SLURM ports derive from the job id into this range
    results = run_group(_slurm_rank, 2, init="none", env=slurm_env(port), timeout=90)
    assert [(r["rank"], r["world"]) for r in results] == [(0, 2), (1, 2)]
    assert results[0]["loss"] == results[1]["loss"]
    assert max_difference(results[0]["state"], results[1]["state"]) == 0.0
