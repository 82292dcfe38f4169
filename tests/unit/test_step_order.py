"""The order of a training step's parts: gradients are zeroed on the first micro-batch of each
accumulation window, just before its forward, never between ``step()`` and the next forward
(freeing them there costs thousands of page faults per step on a ResNet under glibc's malloc:
benchmarks/realistic.py records them)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import Hook, Trainer
from nn_handler.config import TrainerConfig
from tests.training_helpers import regression_data


class _RecordingSGD(torch.optim.SGD):
    def __init__(self, params: Iterable[nn.Parameter], events: list[str]) -> None:
        super().__init__(params, lr=0.01)
        self.events = events

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.events.append("zero_grad")
        super().zero_grad(set_to_none)

    def step(self, closure: Any = None) -> Any:
        self.events.append("step")
        return super().step(closure)


class _RecordingModel(nn.Module):
    def __init__(self, events: list[str], fail_at: int | None = None) -> None:
        super().__init__()
        self.layer = nn.Linear(6, 3)
        self.events = events
        self.fail_at = fail_at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            if self.fail_at is not None and self.events.count("forward") == self.fail_at:
                self.fail_at = None
                raise RuntimeError("a bad batch")
            self.events.append("forward")
        return self.layer(x)  # type: ignore[no-any-return]


class _GradientsAfterStep(Hook):
    def __init__(self) -> None:
        self.present: list[bool] = []

    def after_optimizer_step(self) -> None:
        self.present.append(all(p.grad is not None for p in self.trainer.module.parameters()))


def _trainer(events: list[str], accumulate: int, hooks: Iterable[Hook] = (), **model: Any) -> Any:
    module = _RecordingModel(events, **model)
    return Trainer(
        module,
        _RecordingSGD(module.parameters(), events),
        nn.CrossEntropyLoss(),
        config=TrainerConfig(accumulate_grad_batches=accumulate, progress_bar=False),
        hooks=hooks,
    )


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    data = regression_data(n=4 * n)
    return [
        (data.tensors[0][4 * i : 4 * i + 4], data.tensors[1][4 * i : 4 * i + 4]) for i in range(n)
    ]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_gradients_are_zeroed_just_before_each_windows_first_forward(accumulate: int) -> None:
    events: list[str] = []
    hook = _GradientsAfterStep()
    trainer = _trainer(events, accumulate, [hook])
    trainer.fit(_batches(5), epochs=1)
    windows = [[i] for i in range(5)] if accumulate == 1 else [[0, 1], [2, 3], [4]]
    expected: list[str] = []
    for window in windows:
        expected += ["zero_grad", *["forward"] * len(window), "step"]
    assert events == expected
    # Nothing frees the gradients between step() and the next window: a hook still reads them.
    assert hook.present == [True] * len(windows)


def test_gradients_left_on_the_model_never_reach_the_first_step() -> None:
    events: list[str] = []
    trainer = _trainer(events, 1)
    for param in trainer.module.parameters():
        param.grad = torch.full_like(param, 1e6)
    before = [p.detach().clone() for p in trainer.module.parameters()]
    trainer.fit(_batches(1), epochs=1)
    moved = max(
        float((p.detach() - b).abs().max())
        for p, b in zip(trainer.module.parameters(), before, strict=True)
    )
    assert events[0] == "zero_grad"
    assert moved < 1.0  # lr 0.01 x a stale 1e6 gradient would have moved them by 1e4


def test_a_window_cut_short_by_an_error_is_zeroed_when_training_starts_again() -> None:
    events: list[str] = []
    trainer = _trainer(events, 2, fail_at=1)  # raises on the window's second micro-batch
    with pytest.raises(RuntimeError, match="a bad batch"):
        trainer.fit(_batches(4), epochs=1)
    assert events == ["zero_grad", "forward"]
    events.clear()
    trainer.fit(_batches(4), epochs=1)
    assert events[:2] == ["zero_grad", "forward"]  # the half window's gradients are dropped
