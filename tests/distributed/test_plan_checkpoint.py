"""What ``nn-handler plan`` says a checkpoint writes (nn_handler/planning/checkpoint_plan.py)
against the files a real run writes, in real gloo groups: a sharded folder under FSDP2 over 2
ranks, HSDP 2 x 2 and DDP with ``format: sharded``, and DDP's single file. The plan counts
tensors' bytes; the files also hold torch.distributed.checkpoint's records (about 2 KB a
tensor) and the loop's state: within 10% for a model of 266K parameters (1 MB a copy), never
below the plan."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import NNHandler
from nn_handler.planning.run_plan import plan_run
from tests.harness import run_group
from tests.training_helpers import regression_data, sgd

pytestmark = pytest.mark.distributed

CASES: dict[str, tuple[int, dict[str, Any], str]] = {
    "fsdp 2": (2, {"strategy": "fsdp", "fsdp": {"min_params": 1000}}, "auto"),
    "ddp 2, sharded": (2, {"strategy": "ddp"}, "sharded"),
    "ddp 2, single file": (2, {"strategy": "ddp"}, "auto"),
    "hsdp 2 x 2": (4, {"strategy": "fsdp", "fsdp": {"min_params": 1000, "replicate": 2}}, "auto"),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 512), nn.Tanh(), nn.Linear(512, 512), nn.Linear(512, 3))


def _config(trainer: dict[str, Any], form: str, folder: str) -> dict[str, Any]:
    return {
        "loader": {"batch_size": 4},
        "trainer": {**trainer, "progress_bar": False},
        "checkpoint": {"dir": folder, "format": form},
    }


def _save(rank: int, world_size: int, folder: str) -> None:
    for name, (world, trainer, form) in CASES.items():
        if world != world_size:
            continue
        config = _config(trainer, form, f"{folder}/{name}")
        handler = NNHandler(_model(), sgd, nn.CrossEntropyLoss(), config=config)
        try:
            handler.train(regression_data(n=8 * world), epochs=1)
        finally:
            handler.close()


@pytest.mark.parametrize("world", [2, 4])
def test_the_planned_checkpoint_is_what_a_real_run_writes(world: int, tmp_path: Path) -> None:
    run_group(_save, world, args=(str(tmp_path),), init="harness", timeout=180)
    for name, (w, trainer, form) in CASES.items():
        if w != world:
            continue
        plan = plan_run(_config(trainer, form, "unused"), world, _model, optimizer_slots=1)
        saved = plan.checkpoint
        assert saved is not None
        [checkpoint] = [p for p in (tmp_path / name).iterdir() if p.name.startswith("ckpt-")]
        if saved.format == "single file":
            assert form == "auto" and checkpoint.is_file(), name
            sizes = [checkpoint.stat().st_size]
        else:
            assert checkpoint.is_dir(), name
            sizes = [f.stat().st_size for f in checkpoint.glob("__*_0.distcp")]
            assert len(sizes) == world, name  # every rank writes its file
        assert saved.tensors <= sum(sizes) <= saved.tensors * 1.10, (name, sizes, saved)
        assert saved.most_per_rank <= max(sizes) * 1.01, (name, sizes, saved)
        assert max(sizes) <= saved.most_per_rank * 1.10, (name, sizes, saved)
