"""Exact resume and failure propagation in real 2-rank gloo groups.

One group runs the resume scenarios (uninterrupted, stopped after an epoch, SIGTERM'd on rank 1
mid-epoch) with and without EMA + bf16 + accumulation; a second group checks that an error
on one rank mid-step stops both ranks promptly, with the original traceback.
"""

from __future__ import annotations

import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import (
    PREEMPTED_EXIT_CODE,
    CheckpointError,
    DistributedContext,
    HandlerConfig,
    NNHandler,
    RankFailedError,
    Trainer,
)
from nn_handler.checkpoint import load_file, load_model_state
from tests.harness import run_group
from tests.resume_helpers import EPOCHS, same, scenario
from tests.timeouts import scaled_now
from tests.training_helpers import mlp, regression_data, sgd

pytestmark = pytest.mark.distributed


def _resume_group(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    context = DistributedContext().setup()
    out: dict[Any, Any] = {}
    for features in (False, True):
        base = Path(folder) / f"features{int(features)}"
        out[features] = scenario(base, world_size, features, context=context)
    out["ddp_load"] = _load_into_ddp(context)
    out["write_failure"] = _failed_write(rank, Path(folder) / "failing", context)
    return out


def _load_into_ddp(context: Any) -> bool:
    """Plain keys load into the DDP-wrapped model, and DDP's own keys back into a plain one."""
    handler = NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), context=context)
    ddp = handler.trainer.model
    assert isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
    plain = mlp(seed=4)
    load_model_state(ddp, plain.state_dict())
    loaded_into_ddp = same(dict(handler.model.state_dict()), dict(plain.state_dict()))
    fresh = mlp(seed=5)
    load_model_state(fresh, ddp.state_dict())  # keys with "module."
    handler.close()
    return loaded_into_ddp and same(dict(fresh.state_dict()), dict(plain.state_dict()))


def _failed_write(rank: int, folder: Path, context: Any) -> str:
    """Rank 0 cannot write: every rank raises the same CheckpointError."""
    from nn_handler.checkpoint import single_file

    real = single_file.write_file

    def disk_full(obj: Any, path: Any, cancel: Any = None, name: Any = None) -> Any:
        raise CheckpointError(f"cannot write checkpoint {name}: [Errno 28] No space left")

    single_file.write_file = disk_full  # type: ignore[assignment]
    config = HandlerConfig.from_dict(
        {"trainer": {"progress_bar": False}, "checkpoint": {"dir": str(folder)}}
    )
    try:
        with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, context=context) as h:
            h.train(regression_data(), epochs=1)
    except CheckpointError as error:
        return str(error)
    finally:
        single_file.write_file = real  # type: ignore[assignment]
    return "no error"


@pytest.fixture(scope="module")
def resumed() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="nnh-resume-") as folder:
        return run_group(_resume_group, 2, args=(folder,), timeout=240)


@pytest.mark.parametrize("features", [False, True], ids=["plain", "ema-bf16-accumulate"])
@pytest.mark.parametrize("stop", ["epoch", "step"])
def test_two_rank_resume_is_bit_identical(
    resumed: list[dict[str, Any]], features: bool, stop: str
) -> None:
    for rank in (0, 1):
        full, again = resumed[rank][features]["full"], resumed[rank][features][stop]
        assert full["global_step"] == again["global_step"]
        assert len(full["history"]) == EPOCHS
        for part in ("model", "optimizer", "ema", "history"):
            assert same(full[part], again[part]), (rank, part)
    # Both ranks agree on the stop: the same model on both, and rank 0's weights after resume
    # equal rank 1's.
    assert same(resumed[0][features]["step"]["model"], resumed[1][features]["step"]["model"])


@pytest.mark.parametrize("features", [False, True], ids=["plain", "ema-bf16-accumulate"])
def test_sigterm_on_one_rank_stops_both_after_the_same_step(
    resumed: list[dict[str, Any]], features: bool
) -> None:
    # SigtermAt(7) signals rank 0 only, after step 7; rank 1 never received a signal. Flags are
    # reduced asynchronously and read at the next check (at the latest, the end of the epoch):
    # both ranks stop after the same later step of that epoch.
    code0, step0, path0 = resumed[0][features]["preempted"]
    code1, step1, path1 = resumed[1][features]["preempted"]
    steps_per_epoch = 3 if features else 5
    epoch_end = (7 // steps_per_epoch + 1) * steps_per_epoch
    assert code0 == code1 == PREEMPTED_EXIT_CODE
    assert 7 < step0 == step1 <= epoch_end
    assert path0 == path1 and path0 is not None and f"s{step0:08d}" in path0


def test_weights_load_into_and_out_of_a_ddp_wrapped_model(resumed: list[dict[str, Any]]) -> None:
    assert resumed[0]["ddp_load"] and resumed[1]["ddp_load"]


def test_a_failed_write_on_rank_zero_raises_on_every_rank(resumed: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        message = resumed[rank]["write_failure"]
        assert "failed on rank(s) [0]" in message and "No space left" in message, message


class FailsOnRankOne(Trainer):
    """Rank 1 raises inside its third training step; rank 0 is then in a collective."""

    def training_step(self, batch: Any) -> torch.Tensor:
        if self.comm.rank == 1 and self.state.global_step == 2:
            raise ValueError("bad batch on rank 1")
        return super().training_step(batch)


def _failure_group(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 4},
            "trainer": {"progress_bar": False},
            "checkpoint": {"dir": folder, "every_n_steps": 2},
        }
    )
    handler = NNHandler(
        mlp(), sgd, nn.CrossEntropyLoss(), config=config, trainer_class=FailsOnRankOne
    )
    started = time.monotonic()
    try:
        handler.train(regression_data(), epochs=2)
    except Exception as error:
        result = {
            "type": type(error).__name__,
            "text": str(error),
            "cause": type(error.__cause__).__name__ if error.__cause__ else None,
            "printed": "".join(traceback.format_exception(error)),
            "whole": getattr(error, "rank_messages", None),
            "seconds": time.monotonic() - started,
        }
    else:
        result = {"type": None}
    handler.close()
    return result


def test_an_error_on_one_rank_stops_every_rank_with_its_traceback() -> None:
    with tempfile.TemporaryDirectory(prefix="nnh-fail-") as folder:
        # The group's timeout is 120 s: a hang would show as ~120 s, not a few.
        results = run_group(_failure_group, 2, args=(folder,), init="env", timeout=120)
        latest = load_file(Path(folder) / "ckpt-e0000-s00000002.pt")
    assert results[1]["type"] == "ValueError"
    assert "bad batch on rank 1" in results[1]["text"]
    assert results[0]["type"] == "RankFailedError"
    assert "rank(s) [1]" in results[0]["text"]
    # Rank 0's report names rank 1's error and line in one line; rank 1 prints its traceback
    # itself (the output holds it once), and the backend's broken connection is not chained.
    brief = next(line for line in results[0]["text"].splitlines() if "--- rank 1 ---" in line)
    assert "ValueError: bad batch on rank 1 at " in brief, brief
    assert "in training_step (the traceback: rank 1's output" in brief, brief
    assert "Traceback" not in results[0]["text"]
    assert "Traceback" in results[1]["printed"] and "bad batch on rank 1" in results[1]["printed"]
    printed = results[0]["printed"]
    assert results[0]["cause"] is None and "direct cause" not in printed, printed
    assert "During handling of the above exception" not in printed, printed
    assert "Connection closed" not in printed and "gloo" not in printed, printed
    assert "Traceback" in results[0]["whole"][1]  # the whole text stays on the error
    assert max(r["seconds"] for r in results) < min(scaled_now(30), 100)  # not the 120 s
    # The checkpoint on disk is the last complete one, written before the failure.
    assert latest["trainer"]["global_step"] == 2
    assert RankFailedError.__name__ == results[0]["type"]
