"""val_check_interval: validation inside the epoch (every N batches or a fraction of the
epoch), its arithmetic, its errors, and an exact resume from a preemption right after a
mid-epoch validation (2 ranks: tests/distributed/test_strategy.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from loguru import logger
from torch import nn
from torch.utils.data import DataLoader

from nn_handler import ConfigError, Hook, NNHandler, TrainingPreempted
from nn_handler.config.training import TrainerConfig
from nn_handler.training.limits import val_check_every
from tests.resume_helpers import SigtermAt, adam, model, outcome, same, step_lr
from tests.training_helpers import mlp, regression_data, sgd

DATA = regression_data()  # 40 samples
VAL = regression_data(n=12, seed=1)


class Validations(Hook):
    """Where each validation ran: (epoch, batch, val loss)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[int, int, float]] = []

    def after_validation(self, metrics: dict[str, float]) -> None:
        state = self.trainer.state
        self.seen.append((state.epoch, state.batch_index + 1, metrics["loss"]))


def _handler(hooks: Any = (), folder: Path | None = None, **trainer: Any) -> NNHandler:
    config: dict[str, Any] = {
        "loader": {"batch_size": 4, "shuffle": True, "seed": 3},
        "trainer": {"progress_bar": False, **trainer},
    }
    if folder is not None:
        config["checkpoint"] = {"dir": str(folder), "every_n_steps": 3}
    return NNHandler(model(), adam, nn.CrossEntropyLoss(), step_lr, config=config, hooks=hooks)


@given(
    st.one_of(st.none(), st.integers(1, 500)),
    st.integers(1, 8),
    st.one_of(st.integers(1, 50), st.floats(0.001, 1.0)),
)
def test_validation_points_are_whole_windows_inside_the_epoch(
    batches: int | None, accumulate: int, interval: int | float
) -> None:
    if isinstance(interval, int):
        interval *= accumulate  # the config refuses other ints
    if isinstance(interval, float) and batches is None:
        with pytest.raises(ValueError, match="unknown length"):
            val_check_every(batches, interval, accumulate)
        return
    every = val_check_every(batches, interval, accumulate)
    if every is None:  # the first point would be the epoch's end (or past it)
        assert batches is not None
        return
    assert every % accumulate == 0 and every >= accumulate
    assert batches is None or every < batches
    if isinstance(interval, int):
        assert every == interval
    else:
        assert batches is not None and every <= max(accumulate, batches * interval)


def test_every_n_batches_validates_inside_each_epoch_and_at_its_end() -> None:
    seen = Validations()
    lines: list[str] = []
    logger.enable("nn_handler")
    sink = logger.add(lines.append, level="INFO", format="{message}")
    try:
        with _handler([seen], val_check_interval=4) as h:  # 10 batches per epoch
            h.train(DATA, VAL, epochs=2)
            record = h.history.last
    finally:
        logger.remove(sink)
        logger.disable("nn_handler")
    assert [(e, b) for e, b, _ in seen.seen] == [(0, 4), (0, 8), (0, 10), (1, 4), (1, 8), (1, 10)]
    assert record["val_loss"] == seen.seen[-1][2]  # the record keeps the epoch-end validation
    mid = [line for line in lines if line.startswith("validation at step")]
    assert len(mid) == 4 and mid[0].startswith("validation at step 4 (epoch 1, batch 4/10): val_")


def test_a_fraction_of_the_epoch_rounds_to_whole_accumulation_windows() -> None:
    seen = Validations()
    with _handler([seen], val_check_interval=0.25, accumulate_grad_batches=2) as h:
        h.train(DATA, VAL, epochs=1)  # 10 batches: every 2 (2.5 rounded down to a window)
    assert [b for _, b, _ in seen.seen] == [2, 4, 6, 8, 10]
    seen = Validations()
    with _handler([seen], val_check_interval=1.0) as h:
        h.train(DATA, VAL, epochs=1)
    assert [b for _, b, _ in seen.seen] == [10]  # the epoch's end only


def test_val_check_interval_errors_name_the_setting() -> None:
    with pytest.raises(ConfigError, match="val_check_interval=3 batches ends inside an accum"):
        TrainerConfig(val_check_interval=3, accumulate_grad_batches=2)
    with pytest.raises(ConfigError, match="val_check_interval"):
        TrainerConfig(val_check_interval=1.5)

    def unsized() -> Any:
        yield from ((x.unsqueeze(0), y.unsqueeze(0)) for x, y in DATA)

    class Once:
        def __iter__(self) -> Any:
            return unsized()

    trainer_config = {"progress_bar": False, "val_check_interval": 0.5}
    with (
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": trainer_config}) as h,
        pytest.raises(ConfigError, match="no len\\(\\); pass an int number of batches"),
    ):
        h.trainer.fit(Once(), Once(), epochs=1)


def test_a_preemption_right_after_a_mid_epoch_validation_resumes_bit_identical(
    tmp_path: Path,
) -> None:
    """The step checkpoint is taken after the mid-epoch validation, so its RNG state includes
    what validation drew (a plain DataLoader draws its seed from the global RNG, and dropout
    draws from it while training): the resumed run continues exactly."""
    val = DataLoader(VAL, batch_size=4)
    with _handler(folder=tmp_path / "full", val_check_interval=4) as h:
        h.train(DATA, val, epochs=2)
        full = outcome(h)
    stop = SigtermAt(14)  # epoch 2, batch 4: a validation point
    with _handler([stop], folder=tmp_path / "cut", val_check_interval=4) as h:
        with pytest.raises(TrainingPreempted) as preempted:
            h.train(DATA, val, epochs=2)
        assert preempted.value.global_step == 14
    with _handler(folder=tmp_path / "cut", val_check_interval=4) as h:
        h.resume("latest")
        h.train(DATA, val, epochs=2)
        assert same(outcome(h), full)
