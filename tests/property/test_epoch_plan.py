"""EpochPlan (training/epoch_plan.py): an epoch's numbers, for any length, limit, accumulation
and validation interval. The windows tile the epoch and each makes one optimizer step; the
validation points fall on window ends, never on the epoch's last batch; the plan is the same
whichever rank builds it, and a rank whose loader differs is named."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nn_handler.config.training import TrainerConfig
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.errors import ConfigError, UnevenDataError
from nn_handler.training.epoch_plan import EpochPlan, check_equal_lengths, plan_epoch


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Any:
        return iter(range(self.n))


class _Ranks(NullCommunicator):
    """What an all_gather of the loaders' lengths gives on a rank of ``lengths``."""

    def __init__(self, lengths: list[int]) -> None:
        super().__init__()
        self.lengths = lengths
        self.gathers = 0

    @property
    def world_size(self) -> int:
        return len(self.lengths)

    def raise_if_any_failed(self, error: Any, what: str, share: Any = None) -> list[list[int]]:
        self.gathers += 1
        return [[n] for n in self.lengths]


@given(
    batches=st.integers(0, 300),
    accumulate=st.integers(1, 9),
    limit=st.none() | st.integers(1, 400),
    windows=st.none() | st.integers(1, 12) | st.floats(0.01, 1.0),
)
def test_windows_tile_the_epoch_and_validation_falls_on_their_ends(
    batches: int, accumulate: int, limit: int | None, windows: int | float | None
) -> None:
    # val_check_interval: a whole number of windows (the config refuses others), or a fraction.
    interval = windows * accumulate if isinstance(windows, int) else windows
    config = TrainerConfig(
        accumulate_grad_batches=accumulate, limit_train_batches=limit, val_check_interval=interval
    )
    plan = plan_epoch(config, NullCommunicator(), _Sized(batches), _Sized(3), epoch=0)
    trained = batches if limit is None else min(batches, limit)
    assert plan.batches == trained and plan.cut == (limit is not None)
    ends = []
    index = 0
    while index < trained:
        start, end = plan.window(index)
        assert start == index and index < end <= trained
        assert all(plan.window(i) == (start, end) for i in range(start, end))
        ends.append(end)
        index = end
    assert plan.steps == len(ends)
    validations = [i for i in range(trained) if plan.validates_after(i)]
    assert all(i + 1 in ends for i in validations)  # after a whole window, never inside one
    assert trained - 1 not in validations  # the epoch's own validation follows its last batch
    if isinstance(interval, int) and interval < trained:
        assert validations == [i for i in range(trained - 1) if (i + 1) % interval == 0]


def test_without_validation_data_or_interval_nothing_validates_inside() -> None:
    config = TrainerConfig(val_check_interval=2)
    plan = plan_epoch(config, NullCommunicator(), _Sized(10), None, epoch=0)
    assert plan.validate_every is None and not any(plan.validates_after(i) for i in range(10))


def test_an_unsized_loader_has_no_length_nor_steps_and_refuses_accumulation() -> None:
    plan = plan_epoch(TrainerConfig(), NullCommunicator(), iter(range(5)), None, epoch=2)
    assert plan == EpochPlan(epoch=2, batches=None, cut=False, validate_every=None)
    assert plan.steps is None and plan.window(7) == (7, 8)
    with pytest.raises(ConfigError, match="gradient accumulation needs a loader with len"):
        plan_epoch(TrainerConfig(accumulate_grad_batches=2), NullCommunicator(), iter([]), None, 0)


def test_agreed_lengths_are_used_as_given_and_a_differing_rank_is_named() -> None:
    ranks = _Ranks([4, 4])
    check_equal_lengths(ranks, 4, [4, 4], epoch=0)
    assert ranks.gathers == 0  # fit's before_epoch agreement carried them: no collective
    check_equal_lengths(ranks, 4, None, epoch=0)
    assert ranks.gathers == 1  # train_epoch called alone: one all_gather
    with pytest.raises(UnevenDataError, match=r"rank 0: 4, rank 1: no len\(\)\) in epoch 3"):
        check_equal_lengths(ranks, 4, [4, -1], epoch=2)
