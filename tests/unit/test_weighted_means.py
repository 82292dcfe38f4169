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


def test_a_key_from_some_ranks_only_is_said_once_naming_them() -> None:
    """Three ranks (as threads): 'iou' from rank 1 only. Its mean is rank 1's, and one
    warning names the key and the rank, once over two reductions."""
    from loguru import logger

    from nn_handler.distributed.communicator.threads import run_in_threads
    from nn_handler.training.weighted_means import MetricKeys

    def reduce_twice(comm: Any) -> list[dict[str, float]]:
        keys = MetricKeys("validation metric")
        results = []
        for _ in range(2):
            means = WeightedMeans()
            values = {"loss": 1.0, **({"iou": 0.5} if comm.rank == 1 else {})}
            means.update(values, 4)
            results.append(means.reduce(comm, keys=keys)[0])
        return results

    seen: list[str] = []
    logger.enable("nn_handler")
    sink = logger.add(
        seen.append, level="WARNING", format="{message}", filter=lambda r: r["extra"]["rank"] == 0
    )
    try:
        out = run_in_threads(reduce_twice, 3)
    finally:
        logger.remove(sink)
        logger.disable("nn_handler")
    assert all(r == {"loss": 1.0, "iou": 0.5} for rank in out for r in rank)
    said = [m for m in seen if "'iou' came from rank(s) [1] only (of 3)" in m]
    assert len(said) == 1, seen
