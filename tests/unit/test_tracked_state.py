"""The user's own state in checkpoints: ``trainer.track(name, obj)`` and hooks with a
state_dict, saved per rank and restored exactly (one process here; 2 ranks in
tests/distributed/test_strategy.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from torch import nn

from nn_handler import ConfigError, HandlerConfig, Hook, NNHandler, TrainingPreempted
from tests.resume_helpers import SigtermAt
from tests.training_helpers import mlp, regression_data, sgd

DATA = regression_data()


class LossSums(Hook):
    """Sums every step's loss: state a plain resume would lose."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0.0
        self.steps = 0

    def after_step(self) -> None:
        loss = self.trainer.state.last_loss
        self.total += float(loss) if loss is not None else 0.0
        self.steps += 1

    def state_dict(self) -> dict[str, Any]:
        return {"total": self.total, "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.total, self.steps = state["total"], state["steps"]


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def _run(folder: Path, hooks: list[Hook], **checkpoint: Any) -> NNHandler:
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8, "seed": 1},
            "trainer": {"progress_bar": False},
            "checkpoint": {"dir": str(folder), "every_n_steps": 2, **checkpoint},
        }
    )
    return NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=hooks)


def test_hook_state_and_tracked_objects_resume_exactly(tmp_path: Path) -> None:
    full_sums, counter = LossSums(), Counter()
    with _run(tmp_path / "full", [full_sums]) as h:
        h.train(DATA, epochs=2)
    cut_sums = LossSums()
    with _run(tmp_path / "cut", [cut_sums, SigtermAt(3)]) as h:
        h.trainer.track("counter", counter)
        counter.value = 41
        with pytest.raises(TrainingPreempted):
            h.train(DATA, epochs=2)
    assert "hook.LossSums" in h.trainer.tracked
    resumed_sums, fresh_counter = LossSums(), Counter()
    with _run(tmp_path / "cut", [resumed_sums], resume="auto") as h:
        h.trainer.track("counter", fresh_counter)
        h.train(DATA, epochs=2)
    assert fresh_counter.value == 41  # restored from the checkpoint
    assert resumed_sums.steps == full_sums.steps == 10
    assert resumed_sums.total == full_sums.total  # the same sum, bit for bit


def test_track_rejects_what_it_cannot_save() -> None:
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss()) as h:
        with pytest.raises(ConfigError, match="has no state_dict or load_state_dict"):
            h.trainer.track("x", object())  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="non-empty str name"):
            h.trainer.track("", Counter())
        h.trainer.track("c", Counter())
        with pytest.raises(ConfigError, match="already tracked for another object"):
            h.trainer.track("c", Counter())
