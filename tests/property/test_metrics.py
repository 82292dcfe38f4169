"""Property tests: exact metric reduction, early stopping and trainer config validation."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_handler.config import EarlyStoppingConfig, HandlerConfig, TrainerConfig
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.errors import ConfigError
from nn_handler.training import EarlyStopping, WeightedMeans
from nn_handler.training.metrics import RunningLoss

values = st.one_of(st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False), st.just(math.nan))
batches = st.lists(st.tuples(values, st.integers(1, 64)), min_size=1, max_size=30)


def _expected(batches: list[tuple[float, int]]) -> float:
    kept = [(v, n) for v, n in batches if not math.isnan(v)]
    count = sum(n for _, n in kept)
    return sum(v * n for v, n in kept) / count if count else math.nan


@settings(max_examples=60, deadline=None)
@given(batches)
def test_weighted_means_equal_the_mean_over_all_samples_ignoring_nan(
    batches: list[tuple[float, int]],
) -> None:
    means = WeightedMeans()
    for value, n in batches:
        means.update({"metric": value}, n)
    result = means.compute(NullCommunicator())["metric"]
    expected = _expected(batches)
    if math.isnan(expected):
        assert math.isnan(result)
    else:
        assert result == pytest.approx(expected, rel=1e-9, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(batches, st.integers(1, 7))
def test_running_loss_does_not_depend_on_how_often_it_folds(
    batches: list[tuple[float, int]], fold_every: int
) -> None:
    import torch

    running = RunningLoss(fold_every)
    for value, n in batches:
        running.add(torch.tensor(value), n)
        running.end_window(1, skipped=False)
    mean, samples, extras = running.compute(NullCommunicator())
    assert extras == {}
    assert samples == sum(n for _, n in batches)
    # The losses are float32 tensors: the exact mean is that of the float32 values.
    expected = _expected([(float(torch.tensor(v)), n) for v, n in batches])
    assert (math.isnan(mean) and math.isnan(expected)) or mean == pytest.approx(
        expected, rel=1e-6, abs=1e-3
    )


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(batches, st.booleans()), min_size=1, max_size=6), st.integers(1, 7))
def test_skipped_windows_leave_the_mean_but_their_samples_count(
    windows: list[tuple[list[tuple[float, int]], bool]], fold_every: int
) -> None:
    import torch

    running = RunningLoss(fold_every)
    for window, skipped in windows:
        for value, n in window:
            running.add(torch.tensor(value, dtype=torch.float64), n)
        running.end_window(len(window), skipped)
    mean, samples, extras = running.compute(NullCommunicator())
    assert extras == {}
    assert samples == sum(n for window, _ in windows for _, n in window)
    expected = _expected([b for window, skipped in windows if not skipped for b in window])
    assert (math.isnan(mean) and math.isnan(expected)) or mean == pytest.approx(
        expected, rel=1e-6, abs=1e-3
    )


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(-100, 100, allow_nan=False), min_size=1, max_size=20),
    st.integers(1, 5),
    st.sampled_from(["min", "max"]),
)
def test_early_stopping_stops_exactly_after_patience_epochs_without_a_new_best(
    history: list[float], patience: int, mode: str
) -> None:
    stopper = EarlyStopping(EarlyStoppingConfig(monitor="m", mode=mode, patience=patience))
    best = math.inf if mode == "min" else -math.inf
    wait = 0
    for epoch, value in enumerate(history, start=1):
        better = value < best if mode == "min" else value > best
        best, wait = (value, 0) if better else (best, wait + 1)
        assert stopper.update({"m": value}, epoch) == (wait >= patience)
        assert stopper.best == best
        if wait >= patience:
            break


@given(st.integers(-5, 5), st.floats(-2.0, 2.0, allow_nan=False))
def test_trainer_config_accepts_exactly_the_valid_values(accumulate: int, clip: float) -> None:
    valid = accumulate >= 1 and clip > 0
    try:
        config = TrainerConfig(accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    except ConfigError as error:
        assert not valid
        fields = {line.split(":")[0].strip() for line in str(error).splitlines()[1:]}
        assert fields and fields <= {"accumulate_grad_batches", "gradient_clip_val"}
        with pytest.raises(ConfigError, match=r"trainer\.(accumulate_grad_batches|gradient)"):
            HandlerConfig.from_dict(
                {"trainer": {"accumulate_grad_batches": accumulate, "gradient_clip_val": clip}}
            )
    else:
        assert valid and config.accumulate_grad_batches == accumulate
