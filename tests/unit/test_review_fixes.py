"""Bugs a code review found (issue 18's review list): each pinned by the behaviour it broke."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn

from nn_handler import ConfigError, Hook, NNHandler
from nn_handler.errors import CollectiveMismatchError
from nn_handler.tracking import ExperimentLogger
from tests.training_helpers import mlp, regression_data, sgd


def test_a_collective_mismatch_keeps_its_hint_across_processes() -> None:
    error = CollectiveMismatchError("all_gather", ["(3,)", "(4,)"], hint="match the shapes")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.hint == "match the shapes" and str(copy) == str(error)


def test_an_experiment_logger_without_its_methods_cannot_be_built() -> None:
    class Incomplete(ExperimentLogger):
        pass

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()  # type: ignore[abstract]


def test_every_after_train_hook_runs_when_one_raises() -> None:
    seen: list[str] = []

    class Failing(Hook):
        def after_train(self) -> None:
            seen.append("failing")
            raise RuntimeError("the first hook's clean-up failed")

    class Finalizer(Hook):
        def after_train(self) -> None:
            seen.append("finalizer")

    config = {"trainer": {"progress_bar": False}}
    hooks = [Failing(), Finalizer()]
    with (
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=hooks) as handler,
        pytest.raises(RuntimeError, match="first hook's clean-up"),
    ):
        handler.train(regression_data(n=8), epochs=1)
    assert seen == ["failing", "finalizer"]


def test_a_handler_that_fails_to_build_leaves_the_group_it_joined() -> None:
    config: dict[str, Any] = {"distributed": {"enabled": True}}  # a group of one process
    with pytest.raises(ConfigError, match="optimizer must be"):
        NNHandler(mlp(), "adam", nn.CrossEntropyLoss(), config=config)  # type: ignore[arg-type]
    assert not dist.is_initialized(), "the failed constructor left its process group behind"
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as handler:
        assert dist.is_initialized() and handler.world_size == 1
    assert not dist.is_initialized()
