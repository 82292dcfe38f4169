"""WeightedMeans in one process: folding, its checkpointed partial state and its errors (the
multi-rank agreement on keys is tested in tests/distributed/test_trainer.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import ConfigError, NNHandler, Trainer
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.training import WeightedMeans
from tests.training_helpers import mlp, regression_data, sgd


def _values(i: int) -> dict[str, Any]:
    value = torch.tensor(0.1 * i + 1 / 3, dtype=torch.float32)
    return {"loss": value, "half": value / 2, "nan_sometimes": float("nan") if i % 3 else 0.5 * i}


def test_a_state_saved_between_folds_resumes_bit_identical() -> None:
    whole = WeightedMeans(fold_every=4)
    for i in range(11):
        whole.update(_values(i), 3 + i)
    first = WeightedMeans(fold_every=4)
    for i in range(6):  # saved with two values pending since the last fold
        first.update(_values(i), 3 + i)
    resumed = WeightedMeans(fold_every=4)
    resumed.load_state_dict(first.state_dict(), torch.device("cpu"))
    for i in range(6, 11):
        resumed.update(_values(i), 3 + i)
    expected = whole.compute(NullCommunicator())
    assert resumed.compute(NullCommunicator()) == expected  # exact, not approximately
    assert sorted(expected) == ["half", "loss", "nan_sometimes"]
    assert expected["nan_sometimes"] == pytest.approx((0.0 * 3 + 1.5 * 6 + 4.5 * 12) / 21)


def test_the_first_state_format_of_sums_and_counts_still_loads() -> None:
    means = WeightedMeans()
    state = {"sums": {"loss": torch.tensor(6.0, dtype=torch.float64)}}
    state["counts"] = {"loss": torch.tensor(4.0, dtype=torch.float64)}
    means.load_state_dict(state, torch.device("cpu"))
    means.update({"loss": torch.tensor(1.0)}, 2)
    assert means.compute(NullCommunicator()) == {"loss": 8.0 / 6.0}


def test_a_validation_value_that_is_not_a_scalar_is_named() -> None:
    class PerClassLoss(Trainer):
        def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
            inputs, targets = batch
            losses = nn.functional.cross_entropy(self.forward(inputs), targets, reduction="none")
            return {"loss": losses.mean(), "per_sample": losses}

    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={"loader": {"batch_size": 8}, "trainer": {"progress_bar": False}},
        trainer_class=PerClassLoss,
    )
    with pytest.raises(ConfigError, match=r"\['per_sample'\] must be scalars"):
        handler.evaluate(regression_data(n=16))
    handler.close()


def test_scalars_of_any_one_element_shape_average_and_a_late_vector_is_refused() -> None:
    means = WeightedMeans(fold_every=2)
    means.update({"a": torch.tensor(1.0), "b": torch.tensor([3.0])}, 1)
    means.update({"a": torch.tensor(2.0), "b": torch.tensor([5.0])}, 3)
    assert means.compute(NullCommunicator()) == {"a": 7.0 / 4.0, "b": 18.0 / 4.0}
    means.update({"a": torch.tensor(1.0)}, 1)
    with pytest.raises(ConfigError, match="must all be scalars"):
        means.update({"a": torch.tensor([1.0, 2.0])}, 1)  # the second update folds
