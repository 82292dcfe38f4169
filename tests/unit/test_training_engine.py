"""Seed 003's TrainingEngine in one process, and its fallback when distributed setup fails."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from torch import nn
from torch.utils.data import DataLoader

from nn_handler import ConfigError, DistributedError
from nn_handler.training_engine import TrainingEngine, distributed_train_worker
from tests.engine_helpers import YourModel
from tests.training_helpers import regression_data


def test_engine_trains_in_one_process_and_saves(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    engine = TrainingEngine(
        model,
        "cpu",
        use_ema=True,
        ema_decay=0.9,
        experiment_name="one",
        checkpoint_dir=tmp_path,
        progress_bar=False,
    )
    history = engine.train(
        DataLoader(regression_data(), batch_size=8, shuffle=True),
        DataLoader(regression_data(n=16, seed=1), batch_size=8),
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        num_epochs=3,
        save_best=True,
        save_last=True,
    )
    assert len(history) == 3 and history["train_loss"][-1] < history["train_loss"][0]
    assert {"best.pt", "latest.json"} <= {p.name for p in (tmp_path / "one").iterdir()}
    assert torch.equal(engine._reduce_tensor(torch.tensor([2.0])), torch.tensor([2.0]))


def test_engine_needs_the_group_for_distributed_training() -> None:
    with pytest.raises(DistributedError, match=r"setup_distributed\(rank, world_size\)"):
        TrainingEngine(nn.Linear(2, 2), "cpu", distributed=True, world_size=2)


def _worker_whose_setup_fails(rank: int, folder: Path) -> tuple[Any, list[str]]:
    seen: list[str] = []
    logger.enable("nn_handler")
    sink = logger.add(seen.append, level="WARNING", format="{message}")
    data: Any = regression_data(n=64)
    data.tensors = (torch.randn(64, 8, 8), data.tensors[1])  # digits-shaped inputs
    try:
        history = distributed_train_worker(
            rank,
            2,
            backend="nccl",  # no CUDA here: the setup fails at once
            model_fn=YourModel,
            train_dataset=data,
            val_dataset=None,
            batch_size=16,
            optimizer_fn=lambda params: torch.optim.SGD(params, lr=0.1),
            criterion_fn=nn.CrossEntropyLoss,
            engine_kwargs={"checkpoint_dir": folder, "progress_bar": False},
            train_kwargs={"num_epochs": 1, "save_last": True},
        )
    finally:
        logger.remove(sink)
        logger.disable("nn_handler")
    return history, seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs nccl to fail")
def test_worker_falls_back_to_one_process_on_rank_0_only(tmp_path: Path) -> None:
    history, seen = _worker_whose_setup_fails(0, tmp_path / "zero")
    assert len(history) == 1
    assert any("distributed setup failed" in m and "single process" in m for m in seen), seen
    # Rank 1 of the same failed group does not train "as rank 0" into the same folder.
    history, seen = _worker_whose_setup_fails(1, tmp_path / "one")
    assert len(history) == 0 and not (tmp_path / "one").exists()
    assert any("rank 0 trains in a single process, this rank 1 does not train" in m for m in seen)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs nccl to fail")
def test_worker_never_falls_back_under_torchrun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "TORCHELASTIC_RUN_ID": "x",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
    }.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(DistributedError, match="not falling back to a single process"):
        _worker_whose_setup_fails(0, tmp_path)
    assert not tmp_path.joinpath("experiment").exists()


def test_save_best_needs_a_validation_loader(tmp_path: Path) -> None:
    model = nn.Linear(6, 3)
    engine = TrainingEngine(model, "cpu", checkpoint_dir=tmp_path, progress_bar=False)
    with pytest.raises(ConfigError, match="save_best=True needs a val_loader"):
        engine.train(
            DataLoader(regression_data(), batch_size=8),
            None,
            torch.optim.SGD(model.parameters(), lr=0.1),
            nn.CrossEntropyLoss(),
            save_best=True,
        )


@pytest.mark.parametrize("warmup", [True, False])
def test_the_ema_warm_up_follows_the_engines_argument(tmp_path: Path, warmup: bool) -> None:
    """ema_warmup=False: the seed's plain EMA (decay from the first step); True: warmed up."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    engine = TrainingEngine(
        model, "cpu", use_ema=True, ema_decay=0.99, ema_warmup=warmup,
        experiment_name="ema", checkpoint_dir=tmp_path, progress_bar=False,
    )  # fmt: skip
    engine.train(
        DataLoader(regression_data(n=8), batch_size=8),
        None,
        torch.optim.SGD(model.parameters(), lr=0.1),
        nn.CrossEntropyLoss(),
        num_epochs=1,
    )
    assert engine.trainer is not None and engine.trainer.ema is not None
    assert engine.trainer.ema.config.warmup is warmup
    assert engine.trainer.ema.decay() == pytest.approx(0.99 if not warmup else 2 / 11)
