"""Ctrl-C during training (one process): with checkpoints it stops after the step like a
SIGTERM (emergency checkpoint, status 130, exact resume); a second Ctrl-C stops at once;
without checkpoints, or with handle_sigint=False, it is Python's KeyboardInterrupt."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from nn_handler import (
    INTERRUPTED_EXIT_CODE,
    HandlerConfig,
    NNHandler,
    TrainingInterrupted,
    TrainingPreempted,
)
from nn_handler.checkpoint.store import LATEST
from tests.resume_helpers import SigtermAt, same, scenario
from tests.training_helpers import mlp, regression_data, sgd

DATA = regression_data()


def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    handler_before = signal.getsignal(signal.SIGINT)
    results = scenario(tmp_path, 1, features=True, signum=signal.SIGINT)
    code, step, path = results["preempted"]
    assert code == INTERRUPTED_EXIT_CODE == 130 and step == 7 and path is not None
    for part in ("model", "optimizer", "ema", "history", "global_step"):
        assert same(results["full"][part], results["step"][part]), part
    assert signal.getsignal(signal.SIGINT) is handler_before  # given back after fit


def _handler(folder: Path | None, hooks: Any = (), **checkpoint: Any) -> NNHandler:
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8},
            "trainer": {"progress_bar": False},
            "checkpoint": {
                "dir": str(folder) if folder else None,
                "every_n_steps": 2,
                **checkpoint,
            },
        }
    )
    return NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=hooks)


def test_the_interrupted_run_is_marked_in_latest_json(tmp_path: Path) -> None:
    hook = SigtermAt(3, signum=signal.SIGINT)
    with _handler(tmp_path, hooks=[hook]) as h, pytest.raises(TrainingInterrupted) as stop:
        h.train(DATA, epochs=3)
    assert isinstance(stop.value, TrainingPreempted) and stop.value.code == 130
    assert "interrupted (Ctrl-C) after optimizer step 3" in str(stop.value)
    latest = json.loads((tmp_path / LATEST).read_text())
    assert latest["reason"] == "interrupted" and latest["global_step"] == 3


def test_a_second_ctrl_c_stops_at_once_without_a_checkpoint(tmp_path: Path) -> None:
    hook = SigtermAt(3, signum=signal.SIGINT, times=2)
    with _handler(tmp_path, hooks=[hook]) as h, pytest.raises(KeyboardInterrupt) as stop:
        h.train(DATA, epochs=3)
    assert not isinstance(stop.value, TrainingPreempted)
    latest = json.loads((tmp_path / LATEST).read_text())
    assert latest["global_step"] == 2 and latest["reason"] == "periodic"  # the last saved


@pytest.mark.parametrize("folder", [False, True], ids=["no-checkpoints", "handle_sigint-off"])
def test_ctrl_c_is_a_plain_keyboard_interrupt_otherwise(tmp_path: Path, folder: bool) -> None:
    extra = {"handle_sigint": False} if folder else {}
    target = tmp_path if folder else None
    # Python's own Ctrl-C handler, whatever the suite inherited: a shell starts a background
    # job (`make test &`) with SIGINT ignored, and Python then installs no handler at all.
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with _handler(target, hooks=[SigtermAt(3, signum=signal.SIGINT)], **extra) as h:
            with pytest.raises(KeyboardInterrupt):
                h.train(DATA, epochs=3)
            assert h.trainer.state.global_step == 3  # raised at once, inside step 3's hooks
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # left alone
    finally:
        signal.signal(signal.SIGINT, inherited)
