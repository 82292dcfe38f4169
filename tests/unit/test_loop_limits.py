"""max_steps, limit_train_batches / limit_val_batches, fast_dev_run and the stepping-batches
estimate, and a per-step schedule whose length comes from it (no arithmetic by hand)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from nn_handler import ConfigError, Hook, NNHandler
from nn_handler.training.history import PARTIAL
from nn_handler.training.limits import limited, optimizer_steps_per_epoch, stepping_batches
from tests.resume_helpers import TIMING_KEYS
from tests.training_helpers import mlp, regression_data, sgd

DATA = regression_data()  # 40 samples
VAL = regression_data(n=20, seed=1)


class Steps(Hook):
    def __init__(self) -> None:
        super().__init__()
        self.steps = 0

    def after_step(self) -> None:
        self.steps += 1


def _handler(scheduler: Any = None, hooks: Any = (), **trainer: Any) -> NNHandler:
    return NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        scheduler,
        config={"loader": {"batch_size": 4}, "trainer": {"progress_bar": False, **trainer}},
        hooks=hooks,
    )


@given(st.integers(0, 1000), st.one_of(st.none(), st.integers(1, 50), st.floats(0.001, 1.0)))
def test_limited_never_exceeds_the_loader_and_keeps_one_batch(
    batches: int, limit: int | float | None
) -> None:
    got = limited(batches, limit)
    assert got is not None and 0 <= got <= batches
    if batches:
        assert got >= 1
    if limit is None:
        assert got == batches


@given(st.integers(1, 500), st.integers(1, 8), st.integers(1, 20), st.integers(0, 20))
def test_stepping_batches_counts_every_window_once(
    batches: int, accumulate: int, epochs: int, done: int
) -> None:
    done = min(done, epochs)
    per_epoch = optimizer_steps_per_epoch(batches, accumulate)
    assert per_epoch == math.ceil(batches / accumulate)
    steps_done = done * per_epoch
    total = stepping_batches(batches, accumulate, epochs, epochs_done=done, steps_done=steps_done)
    assert total == epochs * per_epoch
    assert stepping_batches(batches, accumulate, epochs, max_steps=3) == min(3, total)


def test_limit_train_and_val_batches() -> None:
    steps = Steps()
    handler = _handler(hooks=[steps], limit_train_batches=3, limit_val_batches=0.5)
    history = handler.train(DATA, VAL, epochs=2)
    assert steps.steps == 6 and handler.trainer.state.global_step == 6
    assert handler.estimated_stepping_batches(DATA, epochs=2) == 6
    assert len(history) == 2 and math.isfinite(history.last["val_loss"])
    handler.close()


def test_max_steps_stops_in_the_middle_of_an_epoch() -> None:
    handler = _handler(max_steps=13)  # 10 steps per epoch
    history = handler.train(DATA, epochs=5)
    assert handler.trainer.state.global_step == 13 and len(history) == 2
    assert PARTIAL not in history.records[0] and history.last[PARTIAL] == 3.0
    assert handler.estimated_stepping_batches(DATA, epochs=5) == 13
    handler.train(DATA, epochs=6)  # already there: nothing more to do
    assert handler.trainer.state.global_step == 13
    handler.close()


def test_fast_dev_run_runs_one_batch_and_writes_no_checkpoint(tmp_path: Path) -> None:
    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={
            "loader": {"batch_size": 4},
            "trainer": {"progress_bar": False, "fast_dev_run": 1},
            "checkpoint": {"dir": str(tmp_path), "save_best": True},
        },
    )
    history = handler.train(DATA, VAL, epochs=10)
    assert len(history) == 1 and handler.trainer.state.global_step == 1
    assert not any(tmp_path.iterdir())
    handler.close()


def test_a_two_argument_scheduler_factory_gets_the_run_length() -> None:
    seen: list[int] = []

    def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        seen.append(total_steps)
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=total_steps)

    handler = _handler(one_cycle, scheduler_interval="step", accumulate_grad_batches=3)
    assert handler.trainer.scheduler is None  # built when train knows the length
    handler.train(DATA, epochs=3)  # 10 batches -> 4 windows per epoch (3, 3, 3, 1)
    assert seen == [12] and handler.trainer.state.global_step == 12
    handler.close()  # OneCycleLR would raise on a 13th step


def test_limits_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"fraction of the batches must be at most 1\.0"):
        _handler(limit_train_batches=1.5)


class _Estimate(Hook):
    """What ``estimated_stepping_batches`` says after each step."""

    def __init__(self) -> None:
        self.seen: set[int] = set()

    def after_step(self) -> None:
        loader = torch.utils.data.DataLoader(DATA, batch_size=4)  # the run's 10 batches
        self.seen.add(self.trainer.estimated_stepping_batches(loader, epochs=2))


def test_a_deferred_scheduler_resumes_its_state(tmp_path: Path, lines: list[str]) -> None:
    """Resumed mid-epoch (step 5 of 10), the schedule's length is the run's (20 steps): no
    warning that it ends early (the estimate once counted the resumed epoch as whole: 25),
    and ``estimated_stepping_batches`` says 20 at every step."""
    from nn_handler import TrainingPreempted
    from tests.resume_helpers import SigtermAt

    def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=total_steps)

    def handler(hooks: Any = ()) -> NNHandler:
        return NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            one_cycle,
            config={
                "loader": {"batch_size": 4},
                "trainer": {"progress_bar": False, "scheduler_interval": "step"},
                "checkpoint": {"dir": str(tmp_path), "every_n_steps": 2, "resume": "never"},
            },
            hooks=hooks,
        )

    with handler([SigtermAt(5)]) as first, pytest.raises(TrainingPreempted):
        first.train(DATA, epochs=2)
    estimate = _Estimate()
    with handler([estimate]) as second:
        second.resume("latest")  # before train: the scheduler does not exist yet
        second.train(DATA, epochs=2)
        scheduler = second.trainer.scheduler
        assert scheduler is not None and scheduler.last_epoch == 20  # 5 restored + 15 more
    assert not [line for line in lines if "LR scheduler" in line], lines
    assert estimate.seen == {20}


def test_extending_a_finished_one_cycle_run_is_refused_before_training(tmp_path: Path) -> None:
    """OneCycleLR raises one step past its end (torch): a resumed run extended past it is
    refused before its first step, naming the lengths and the fix; nothing is trained."""
    settings = {
        "loader": {"batch_size": 4},
        "trainer": {"progress_bar": False, "scheduler_interval": "step"},
        "checkpoint": {"dir": str(tmp_path), "resume": "auto"},
    }

    def one_cycle(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
        return torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=total_steps)

    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), one_cycle, config=settings) as first:
        first.train(DATA, epochs=2)  # 20 steps: the schedule's whole length
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), one_cycle, config=settings) as second:
        with pytest.raises(ConfigError) as refused:
            second.train(DATA, epochs=3)
        assert second.trainer.state.global_step == 20
    message = str(refused.value)
    assert "OneCycleLR has total_steps=20 but this run goes to 30 optimizer steps" in message
    assert "trainer.max_steps=20" in message


@given(st.integers(1, 300), st.integers(1, 9))
def test_windows_cover_the_epoch_once_and_step_once_each(total: int, accumulate: int) -> None:
    from nn_handler.training.limits import window

    windows = [window(index, accumulate, total) for index in range(total)]
    steps = [index for index, (_, end) in enumerate(windows) if index + 1 == end]
    assert len(steps) == optimizer_steps_per_epoch(total, accumulate)
    assert steps[-1] == total - 1  # the last, possibly short, window also steps
    for index, (start, end) in enumerate(windows):
        assert start <= index < end <= total and start % accumulate == 0
        assert end - start == accumulate or end == total
    # Resuming after a step: the window of the next batch starts there.
    for step in steps[:-1]:
        assert window(step + 1, accumulate, total)[0] == step + 1


def _extending(folder: Path, reproducible: bool, **trainer: Any) -> NNHandler:
    if reproducible:
        trainer["reproducible"] = {"global_batch_size": 4, "micro_batch_size": 2}
    torch.manual_seed(0)
    return NNHandler(
        nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.2), nn.Linear(16, 3)),
        sgd,
        nn.CrossEntropyLoss(),
        lambda optimizer: torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.8),
        config={
            "loader": {"batch_size": 4, "shuffle": True, "seed": 3},
            "trainer": {"progress_bar": False, **trainer},
            "checkpoint": {"dir": str(folder), "every_n_steps": 1, "resume": "auto"},
        },
    )


def _outcome(handler: NNHandler) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    timing = TIMING_KEYS
    records = [{k: v for k, v in r.items() if k not in timing} for r in handler.history.records]
    return dict(handler.model.state_dict()), records


@pytest.mark.parametrize("reproducible", [False, True])
def test_a_run_stopped_by_max_steps_mid_epoch_is_extended_exactly(
    tmp_path: Path, reproducible: bool
) -> None:
    """Lightning's rule: max_steps ends the fit, not the run. Stopped at step 13 (epoch 2,
    batch 3 of 10), resumed with max_steps=30 and epochs=3: the rest of epoch 2 is trained,
    the partial record is replaced by the complete one, and the end is the same (weights and
    History, bit for bit) as a run that never stopped."""
    with _extending(tmp_path / "straight", reproducible) as handler:
        handler.train(DATA, VAL, epochs=3)
        straight = _outcome(handler)
    with _extending(tmp_path / "run", reproducible, max_steps=13) as handler:
        history = handler.train(DATA, VAL, epochs=2)
        assert handler.trainer.state.global_step == 13
        assert history.last[PARTIAL] == 3.0 and "val_loss" not in history.last
    with _extending(tmp_path / "run", reproducible, max_steps=30) as handler:
        handler.train(DATA, VAL, epochs=3)
        assert handler.trainer.state.global_step == 30
        extended = _outcome(handler)
    assert extended[1] == straight[1] and len(extended[1]) == 3
    assert all(torch.equal(extended[0][k], v) for k, v in straight[0].items())


def test_a_run_stopped_by_max_steps_at_an_epoch_end_goes_on_without_a_limit(
    tmp_path: Path,
) -> None:
    with _extending(tmp_path, False, max_steps=10) as handler:
        history = handler.train(DATA, VAL, epochs=3)
        assert handler.trainer.state.global_step == 10 and PARTIAL not in history.last
    with _extending(tmp_path, False) as handler:  # no max_steps: the epochs decide
        handler.train(DATA, VAL, epochs=3)
        assert handler.trainer.state.global_step == 30


def _patient(folder: Path, patience: int | None) -> NNHandler:
    trainer: dict[str, Any] = {"progress_bar": False}
    if patience is not None:
        trainer["early_stopping"] = {"monitor": "val_loss", "patience": patience}
    return NNHandler(
        mlp(),
        lambda params: torch.optim.SGD(params, lr=0.0),  # nothing improves
        nn.CrossEntropyLoss(),
        config={
            "loader": {"batch_size": 8},
            "trainer": trainer,
            "checkpoint": {"dir": str(folder), "resume": "auto"},
        },
    )


@pytest.mark.parametrize(("patience", "epochs_done"), [(1, 2), (3, 4), (None, 6)])
def test_a_resumed_early_stop_stands_unless_its_settings_changed(
    tmp_path: Path, patience: int | None, epochs_done: int
) -> None:
    with _patient(tmp_path, 1) as handler:
        handler.train(DATA, VAL, epochs=6)
        assert handler.trainer.state.epoch == 2  # patience 1 ran out after epoch 2
    with _patient(tmp_path, patience) as handler:
        handler.train(DATA, VAL, epochs=6)
        assert handler.trainer.state.epoch == epochs_done
