"""Error paths of saving, resuming and loading that each name the culprit (path, part) and
say what to do, and leave nothing behind (no sink, no group) when they fail."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import CheckpointError, HandlerConfig, Hook, NNHandler
from nn_handler import log as nn_log
from nn_handler.checkpoint.store import local
from tests.training_helpers import mlp, regression_data, sgd

DATA = regression_data()
VAL = regression_data(n=16, seed=1)


def _handler(folder: Path, optimizer: Any = sgd, **checkpoint: Any) -> NNHandler:
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8},
            "trainer": {"progress_bar": False},
            "checkpoint": {"dir": str(folder), **checkpoint},
        }
    )
    return NNHandler(mlp(), optimizer, nn.CrossEntropyLoss(), config=config)


def test_a_part_whose_state_cannot_load_is_named(tmp_path: Path) -> None:
    with _handler(tmp_path) as h:
        h.train(DATA, epochs=1)

    def two_groups(params: Any) -> torch.optim.Optimizer:
        params = list(params)
        return torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)

    with (
        _handler(tmp_path, optimizer=two_groups, resume="auto") as h,
        pytest.raises(CheckpointError, match=r"cannot load the optimizer state from .*ckpt-"),
    ):
        h.train(DATA, epochs=2)


def test_resume_from_a_missing_file_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt"
    with _handler(tmp_path / "run") as h, pytest.raises(CheckpointError, match=r"nope\.pt"):
        h.resume(missing)


def test_an_os_error_writing_latest_json_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(local, "atomic_write_json", full)
    with (
        _handler(tmp_path) as h,
        pytest.raises(CheckpointError, match=r"latest\.json.*No space left on device"),
    ):
        h.train(DATA, epochs=1)


def test_an_os_error_linking_best_pt_is_a_checkpoint_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(local, "atomic_link", refuse)
    with (
        _handler(tmp_path, save_best=True) as h,
        pytest.raises(CheckpointError, match=r"best\.pt.*Permission denied"),
    ):
        h.train(DATA, VAL, epochs=1)


def test_nn_handler_load_that_fails_leaves_no_sink_behind(tmp_path: Path) -> None:
    with _handler(tmp_path) as h:
        h.train(DATA, epochs=1)
    saved = next(tmp_path.glob("ckpt-*.pt"))
    handles_before = dict(nn_log._LEASE.handles)
    wider = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 3))  # other shapes
    shapes = r"\['0\.weight'\] is float32 of shape \(16, 6\) there and float32 of shape \(32, 6\)"
    with pytest.raises(CheckpointError, match=shapes):
        NNHandler.load(saved, wider, sgd, nn.CrossEntropyLoss())
    assert nn_log._LEASE.handles == handles_before, "the failed handler was closed"


def test_a_local_checkpoint_that_cannot_be_read_is_never_rotated_away(tmp_path: Path) -> None:
    """The rule of the object store holds for a plain folder: a damaged checkpoint is kept by
    rotation (its run cannot be read, so it is not known to be this run's to delete)."""
    with _handler(tmp_path, every_n_steps=5, keep_last=3) as h:
        h.train(DATA, epochs=2)
    oldest = min(tmp_path.glob("ckpt-*.pt"))
    data = oldest.read_bytes()[:-200]  # torn: its zip directory (and its run id) is lost
    oldest.write_bytes(data)
    with _handler(tmp_path, every_n_steps=5, keep_last=1, resume="auto") as h:
        h.train(DATA, epochs=4)
        assert h.trainer.state.global_step == 20
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == [
        oldest.name,
        "ckpt-e0004-s00000020.pt",
    ]
    assert oldest.read_bytes() == data


class AnotherJobPoints(Hook):
    """After optimizer step ``step``, 'another job' (same folder, no lock between them: two
    srun steps of one allocation on two nodes, a store without conditional writes) points
    latest.json at a later step of its own."""

    def __init__(self, step: int, write: Any) -> None:
        self.step, self.write = step, write

    def after_optimizer_step(self) -> None:
        if self.trainer.state.global_step == self.step:
            pointer = {"checkpoint": "ckpt-e0009-s00000090.pt", "epoch": 9,
                       "global_step": 90, "reason": "periodic", "time": 1.0}  # fmt: skip
            self.write(json.dumps(pointer).encode())


@pytest.mark.parametrize("where", ["folder", "store"])
def test_latest_json_never_moves_back_over_another_jobs_pointer(tmp_path: Path, where: str) -> None:
    import uuid

    from nn_handler.checkpoint.store.remote_store import RemoteStore

    if where == "folder":
        folder: str = str(tmp_path / "ckpt")

        def write(data: bytes) -> None:
            (tmp_path / "ckpt" / "latest.json").write_bytes(data)
    else:
        folder = f"memory://{uuid.uuid4().hex}/run"

        def write(data: bytes) -> None:
            RemoteStore(folder).write("latest.json", data)

    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8},
            "trainer": {"progress_bar": False},
            "checkpoint": {"dir": folder, "every_n_steps": 2, "staging_dir": str(tmp_path / "w")},
        }
    )
    with (
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config,
                  hooks=[AnotherJobPoints(3, write)]) as h,
        pytest.raises(CheckpointError, match=r"names ckpt-e0009-s00000090\.pt \(step 90\), "
                      r"written by another job since this one started; this run's step 4"),
    ):  # fmt: skip
        h.train(DATA, epochs=1)
