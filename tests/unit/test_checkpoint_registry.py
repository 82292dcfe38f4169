"""StateRegistry (checkpoint/registry.py) and the Trainer's parts built on it: shared and
per-rank parts, what a missing or unused state does, world-size changes, and that checkpoints
are written and read without a Trainer (a 2-rank gather in tests/distributed/test_strategy.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import CheckpointError, HandlerConfig, Hook, NNHandler
from nn_handler.checkpoint.registry import Part, StateRegistry, part_of
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.config.training import TrainerConfig
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.strategies import SingleDeviceStrategy
from nn_handler.training.checkpointing import TrainerCheckpoints
from nn_handler.training.metrics import RunningLoss
from nn_handler.training.position import LoopPosition
from nn_handler.training.state import TrainerState
from tests.training_helpers import mlp, regression_data, sgd


class Box:
    def __init__(self, value: Any = None) -> None:
        self.value = value

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.value = state["value"]


def test_shared_and_per_rank_parts_round_trip_in_one_process() -> None:
    shared, mine = Box(1), Box("rank 0")
    registry = StateRegistry([part_of("shared", shared), part_of("mine", mine, per_rank=True)])
    collected = registry.collect(NullCommunicator())
    assert collected == ({"shared": {"value": 1}}, [{"mine": {"value": "rank 0"}}])
    shared.value, mine.value = 0, None
    registry.restore(*collected, rank=0, source="ckpt")
    assert (shared.value, mine.value) == (1, "rank 0")


def test_a_name_registered_twice_is_an_error() -> None:
    registry = StateRegistry([part_of("a", Box())])
    with pytest.raises(CheckpointError, match="'a' is registered twice"):
        registry.add(part_of("a", Box()))
    registry.add(part_of("a", Box(5)), replace=True)
    assert registry.collect(NullCommunicator()) == ({"a": {"value": 5}}, [{}])


def test_missing_states_warn_raise_or_stay_quiet_as_the_part_says(lines: list[str]) -> None:
    warned, quiet, required = Box(1), Box(2), Box(3)
    registry = StateRegistry(
        [
            part_of("warned", warned),
            part_of("quiet", quiet, missing="ignore"),
        ]
    )
    registry.restore({}, [{}], 0, "old.pt")
    assert (warned.value, quiet.value) == (1, 2)  # untouched
    assert any("old.pt has no warned state" in line for line in lines)
    assert not any("quiet" in line for line in lines)
    registry.add(part_of("required", required, missing="error"))
    with pytest.raises(CheckpointError, match=r"old\.pt has no 'required' state"):
        registry.restore({}, [{}], 0, "old.pt")


def test_unused_states_are_named_once_and_a_failing_load_names_the_part(
    lines: list[str],
) -> None:
    registry = StateRegistry([part_of("kept", Box())])
    registry.restore(
        {"kept": {"value": 1}, "ema": {"x": 1}, "gone": None, "optimizers": []},
        [{"tracked.sums": {"v": 1}}],
        0,
        "a.pt",
    )
    unused = [line for line in lines if "not used" in line]
    assert unused == ["a.pt: ['ema', 'tracked.sums'] not used (this run has no such part)"]
    with pytest.raises(CheckpointError, match=r"cannot load the kept state from a.pt: 'value'"):
        registry.restore({"kept": {"other": 1}}, [{}], 0, "a.pt")


def test_per_rank_parts_after_a_world_size_change_keep_or_take_rank_0s() -> None:
    kept, followed = Box("mine"), Box("mine")
    registry = StateRegistry(
        [
            part_of("kept", kept, per_rank=True),
            part_of("followed", followed, per_rank=True, on_resize="rank0"),
        ]
    )
    ranks = [{"kept": {"value": r}, "followed": {"value": r}} for r in (0, 1)]
    registry.restore({}, ranks, 1, "c.pt", same_world=False)
    assert (kept.value, followed.value) == ("mine", 0)
    registry.restore({}, ranks, 1, "c.pt", same_world=True)
    assert (kept.value, followed.value) == (1, 1)


def test_collective_parts_are_saved_on_every_rank() -> None:
    calls: list[str] = []
    registry = StateRegistry(
        [Part("sharded", lambda: calls.append("save") or 7, lambda s, _src: None, collective=True)]
    )
    assert registry.collect(NullCommunicator()) == ({"sharded": 7}, [{}])
    assert calls == ["save"]  # once, not again for rank 0's shared states


def test_a_checkpoint_is_written_and_read_without_a_trainer(tmp_path: Path) -> None:
    """The registry, the strategy's model parts and the loop position are all it takes."""
    comm = NullCommunicator()
    strategy = SingleDeviceStrategy(comm, torch.device("cpu"), TrainerConfig())
    module, _ = strategy.setup(nn.Linear(3, 2))
    state = TrainerState(epoch=2, global_step=7)
    position = LoopPosition(state)
    checkpoints = TrainerCheckpoints(
        position,
        comm,
        torch.device("cpu"),
        CheckpointConfig(),
        {"run": 1},
        group=strategy.checkpoint_group,
    )
    checkpoints.adopt([*strategy.checkpoint_parts(), *position.parts()])
    path = checkpoints.save(tmp_path / "x.pt")
    saved = torch.load(path, weights_only=True)
    assert saved["config"] == {"run": 1} and saved["trainer"]["global_step"] == 7
    assert set(saved["ranks"][0]) == {"rng", "epoch_rng", "running"}
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    with torch.no_grad():
        for p in module.parameters():
            p.zero_()
    state.epoch = state.global_step = 0
    checkpoints.resume(path, allow_world_size_change=None, missing_ok=False)
    assert (state.epoch, state.global_step) == (2, 7)
    for key, value in module.state_dict().items():
        assert torch.equal(value, weights[key])


class StepCounter(Hook):
    def __init__(self) -> None:
        self.calls: list[int] = []

    def after_optimizer_step(self) -> None:
        self.calls.append(self.trainer.state.global_step)


def test_after_optimizer_step_runs_once_per_optimizer_step_with_the_step_counted() -> None:
    counter = StepCounter()
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8, "seed": 1},
            "trainer": {"progress_bar": False, "accumulate_grad_batches": 2},
        }
    )
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=[counter]) as h:
        h.train(regression_data(), epochs=2)
        steps = h.trainer.state.global_step
    assert steps > 0 and counter.calls == list(range(1, steps + 1))


def test_checkpoints_of_the_first_format_with_nested_tracked_state_still_resume(
    tmp_path: Path,
) -> None:
    config = HandlerConfig.from_dict(
        {"loader": {"batch_size": 8, "seed": 1}, "trainer": {"progress_bar": False}}
    )
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as h:
        box = Box(41)
        h.trainer.track("box", box)
        checkpoint = h.trainer.state_dict()
        assert checkpoint is not None
        rank = checkpoint["ranks"][0]
        rank["tracked"] = {"box": rank.pop("tracked.box")}  # as the first writers stored it
        box.value = 0
        h.trainer.load_state_dict(checkpoint, "first.pt")
        assert box.value == 41


def test_a_checkpoint_written_before_the_loop_takes_a_resumed_position_is_that_position() -> None:
    """Between a resume and the fit (a fault-tolerant member sends its state to a joining one
    there) the loop has not moved: what is saved is the restored mid-epoch position (batches
    done, the RNG streams, the partial loss), not the loop's own (batch 0, no loss)."""
    state = TrainerState(epoch=1, global_step=9)
    source = LoopPosition(state)
    source.batches_done, source.epoch_rng = 3, {"epoch": "start"}
    source.running = RunningLoss(10)
    source.running.add(torch.tensor(2.0), 4)
    parts = {p.name: p for p in source.parts()}
    saved = {name: part.save() for name, part in parts.items()}  # mid-epoch, in the loop
    resumed = LoopPosition(TrainerState())
    for part in resumed.parts():
        part.load(saved[part.name], "ckpt")
    again = {p.name: p.save() for p in resumed.parts()}  # before the loop takes it
    assert again["trainer"]["batches_done"] == 3 and again["trainer"]["global_step"] == 9
    assert again["rng"] == saved["rng"] and again["epoch_rng"] == {"epoch": "start"}
    assert again["running"] == saved["running"] and again["running"] is not None
    resumed.take_resume()  # the loop took it: the loop's own position again
    assert resumed.parts()[0].save()["batches_done"] == 0
