"""Exact resume in one process, and the error paths of saving and resuming."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import (
    PREEMPTED_EXIT_CODE,
    CheckpointError,
    ConfigError,
    HandlerConfig,
    NNHandler,
    TrainingPreempted,
)
from nn_handler.checkpoint import atomic_save, load_file
from nn_handler.checkpoint.store import LATEST
from nn_handler.training.hooks import Hook
from tests.resume_helpers import EPOCHS, SigtermAt, same, scenario
from tests.training_helpers import mlp, regression_data, sgd

DATA = regression_data()
_QUIET = {"trainer": {"progress_bar": False}}
VAL = regression_data(n=16, seed=1)


@pytest.mark.parametrize("features", [False, True], ids=["plain", "ema-bf16-accumulate"])
def test_one_process_resume_is_bit_identical(tmp_path: Path, features: bool) -> None:
    results = scenario(tmp_path, 1, features)
    code, step, path = results["preempted"]
    assert code == PREEMPTED_EXIT_CODE and step == 7 and path is not None
    for stop in ("epoch", "step"):
        for part in ("model", "optimizer", "ema", "history", "global_step"):
            assert same(results["full"][part], results[stop][part]), (stop, part)
    assert len(results["full"]["history"]) == EPOCHS


def _simple(folder: Path, hooks: Any = (), **checkpoint: Any) -> NNHandler:
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8},
            "trainer": {"progress_bar": False},
            "checkpoint": {"dir": str(folder), **checkpoint},
        }
    )
    return NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=hooks)


def test_resume_latest_without_checkpoints_or_folder(tmp_path: Path) -> None:
    with _simple(tmp_path) as h:
        with pytest.raises(CheckpointError, match="no complete checkpoint"):
            h.resume("latest")
        assert h.trainer.resume("latest", missing_ok=True) is None
    with (
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss()) as h,
        pytest.raises(ConfigError, match=r"CheckpointConfig\(dir=\.\.\.\)"),
    ):
        h.resume("latest")


def test_resume_refuses_a_file_that_is_not_a_training_checkpoint(tmp_path: Path) -> None:
    torch.save(mlp().state_dict(), tmp_path / "weights.pt")
    with (
        _simple(tmp_path / "run") as h,
        pytest.raises(
            CheckpointError, match=r"not an nn_handler training checkpoint.*NNHandler.load"
        ),
    ):
        h.resume(tmp_path / "weights.pt")


def _saved_mid_epoch(folder: Path) -> Path:
    with _simple(folder, every_n_steps=2, keep_last=5) as h:
        h.train(DATA, epochs=1)
    return folder / "ckpt-e0000-s00000004.pt"


def test_world_size_change_is_refused_or_resharded(tmp_path: Path) -> None:
    _saved_mid_epoch(tmp_path)
    mid = load_file(tmp_path / "ckpt-e0000-s00000002.pt")  # 2 of 5 batches of 8 done
    after = load_file(tmp_path / "ckpt-e0001-s00000005.pt")
    for checkpoint in (mid, after):
        checkpoint["world_size"] = 2
    with _simple(tmp_path / "other") as h:
        with pytest.raises(CheckpointError, match=r"written by 2 rank\(s\); this run has 1"):
            h.trainer.load_state_dict(after, "after.pt")
        with pytest.raises(CheckpointError, match=r"mid-epoch, the rest of the epoch visits"):
            h.trainer.load_state_dict(mid, "mid.pt")
        h.trainer.load_state_dict(after, "after.pt", allow_world_size_change=True)
        assert h.trainer.state.epoch == 1 and h.trainer.state.global_step == 5
    with _simple(tmp_path / "third") as h:
        # As if 2 ranks had trained 2 batches of 8 each: 32 of the 40 samples are done, and
        # one batch of the 8 others is left for this one rank.
        h.trainer.load_state_dict(mid, "mid.pt", allow_world_size_change=True)
        h.train(DATA, epochs=1)
        assert h.trainer.state.epoch == 1 and h.trainer.state.global_step == 3


def test_resume_auto_follows_the_allow_world_size_change_config_field(tmp_path: Path) -> None:
    with _simple(tmp_path) as h:
        h.train(DATA, epochs=1)
    latest = tmp_path / json.loads((tmp_path / LATEST).read_text())["checkpoint"]
    checkpoint = load_file(latest)
    checkpoint["world_size"] = 2  # as if written by a 2-rank run
    atomic_save(checkpoint, latest)
    with (
        _simple(tmp_path, resume="auto") as h,
        pytest.raises(CheckpointError, match=r"set checkpoint\.allow_world_size_change=True"),
    ):
        h.train(DATA, epochs=2)
    with _simple(tmp_path, resume="auto", allow_world_size_change=True) as h:
        h.train(DATA, epochs=2)
        assert len(h.history) == 2 and h.trainer.state.global_step == 10  # continued


def test_a_shorter_loader_cannot_reach_a_mid_epoch_position(tmp_path: Path) -> None:
    path = _saved_mid_epoch(tmp_path)
    with _simple(tmp_path / "other") as h:
        h.resume(path)
        with pytest.raises(CheckpointError, match="only 2 batches per epoch"):
            h.train(regression_data(n=16), epochs=2)


def test_saving_inside_an_accumulation_window_is_refused(tmp_path: Path) -> None:
    config = HandlerConfig.from_dict(
        {"trainer": {"accumulate_grad_batches": 2, "progress_bar": False}}
    )

    class SaveMidWindow(SigtermAt):
        def after_step(self) -> None:
            if self.trainer.state.batch_index == 0:
                self.trainer.save_checkpoint(tmp_path / "x.pt")

    with (
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=[SaveMidWindow(0)]) as h,
        pytest.raises(ConfigError, match=r"accumulation window.*step_synced"),
    ):
        h.train(DATA, epochs=1)


def test_handler_save_and_load_on_this_hardware(tmp_path: Path) -> None:
    with _simple(tmp_path, every_n_epochs=None, save_last=False) as h:
        h.train(DATA, VAL, epochs=2)
        path = h.save(tmp_path / "final.pt")
        expected = {k: v.clone() for k, v in h.model.state_dict().items()}
        history = h.history.records
    assert sorted(p.name for p in tmp_path.iterdir()) == ["final.pt"]
    with NNHandler.load(path, mlp(seed=9), loss_fn=nn.CrossEntropyLoss()) as loaded:
        assert same(dict(loaded.model.state_dict()), expected)
        assert loaded.config.loader.batch_size == 8  # the checkpoint's own config
        assert loaded.history.records == history
        assert loaded.trainer.optimizer is None
        metrics = loaded.evaluate(VAL)
        assert set(metrics) == {"loss"}
    with NNHandler.load(path, mlp(seed=9), sgd, nn.CrossEntropyLoss()) as loaded:
        assert loaded.trainer.optimizer is not None
        assert loaded.trainer.optimizer.state_dict()["state"]  # momentum buffers restored


def test_save_best_keeps_the_best_epoch_and_needs_its_metric(tmp_path: Path) -> None:
    with _simple(tmp_path, save_best=True, keep_last=1) as h:
        h.train(DATA, VAL, epochs=3)
        losses = h.history["val_loss"]
    best = load_file(tmp_path / "best.pt")
    assert best["trainer"]["epoch"] == losses.index(min(losses)) + 1
    with (
        _simple(tmp_path / "b", save_best=True, monitor="val_accuracy") as h,
        pytest.raises(ConfigError, match="save_best monitors 'val_accuracy'"),
    ):
        h.train(DATA, VAL, epochs=1)


SCORES = [0.5, 0.3, 0.4, 0.2, 0.6]  # by epoch: the 2 best end as epochs 4 and 2


def _scored(folder: Path, every_n_epochs: int | None = 1) -> NNHandler:
    """Validation's ``val_score`` is SCORES[epoch] (a constant per validation run)."""
    holder: dict[str, Any] = {}

    def score(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return torch.tensor(SCORES[holder["trainer"].state.epoch])

    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8},
            "trainer": {"progress_bar": False},
            "checkpoint": {
                "dir": str(folder),
                "save_best": True,
                "save_top_k": 2,
                "monitor": "val_score",
                "keep_last": 5,
                "every_n_epochs": every_n_epochs,
                "save_last": every_n_epochs is not None,
                "resume": "never",
            },
        }
    )
    handler = NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, metrics={"score": score})
    holder["trainer"] = handler.trainer
    return handler


def _tops(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("top-"))


@pytest.mark.parametrize("periodic", [True, False], ids=["linked", "written"])
def test_save_top_k_keeps_the_k_best_checkpoints_by_the_monitored_value(
    tmp_path: Path, periodic: bool
) -> None:
    with _scored(tmp_path, every_n_epochs=1 if periodic else None) as h:
        h.train(DATA, VAL, epochs=5)
    assert h.history["val_score"] == pytest.approx(SCORES)
    kept = ["top-e0002-s00000010-val_score=0.3.pt", "top-e0004-s00000020-val_score=0.2.pt"]
    assert _tops(tmp_path) == kept
    assert (tmp_path / kept[1]).stat().st_ino == (tmp_path / "best.pt").stat().st_ino
    for name, epoch in zip(kept, (2, 4), strict=True):
        assert load_file(tmp_path / name)["trainer"]["epoch"] == epoch
        if periodic:  # a link to the epoch's checkpoint, not a second write
            periodic_path = tmp_path / f"ckpt-e{epoch:04d}-s{5 * epoch:08d}.pt"
            assert (tmp_path / name).stat().st_ino == periodic_path.stat().st_ino
    if periodic:
        # Each checkpoint holds the ranking with its own epoch's value in it (and best.pt's
        # value), so a resume from it goes on exactly.
        third = load_file(tmp_path / "ckpt-e0003-s00000015.pt")
        assert [name for _, name in third["top_k"]] == [
            "top-e0002-s00000010-val_score=0.3.pt",
            "top-e0003-s00000015-val_score=0.4.pt",
        ]
        assert [value for value, _ in third["top_k"]] == pytest.approx([0.3, 0.4])
        assert third["best"] == pytest.approx(0.3)
        second = load_file(tmp_path / "ckpt-e0002-s00000010.pt")
        assert second["best"] == pytest.approx(0.3)  # its own epoch's, the best so far


def test_a_resumed_run_goes_on_ranking_the_same_top_k(tmp_path: Path) -> None:
    with _scored(tmp_path) as h:
        h.train(DATA, VAL, epochs=3)
    assert _tops(tmp_path) == [
        "top-e0002-s00000010-val_score=0.3.pt",
        "top-e0003-s00000015-val_score=0.4.pt",
    ]
    with _scored(tmp_path) as h:
        h.resume("latest")
        h.train(DATA, VAL, epochs=5)
    assert _tops(tmp_path) == [
        "top-e0002-s00000010-val_score=0.3.pt",
        "top-e0004-s00000020-val_score=0.2.pt",
    ]


def test_save_top_k_without_save_best_is_a_config_error_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"save_top_k=3 keeps the best .* set save_best=True"):
        HandlerConfig.from_dict({"checkpoint": {"dir": "x", "save_top_k": 3}})


def test_resume_falls_back_when_the_newest_checkpoint_is_torn(tmp_path: Path) -> None:
    with _simple(tmp_path, keep_last=3) as h:
        h.train(DATA, epochs=2)
    newest = tmp_path / "ckpt-e0002-s00000010.pt"
    newest.write_bytes(newest.read_bytes()[:100])
    with _simple(tmp_path) as h:
        assert h.resume() == tmp_path / "ckpt-e0001-s00000005.pt"
        assert h.trainer.state.epoch == 1


def test_an_emergency_save_over_budget_is_cancelled_and_never_appears(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nn_handler.checkpoint import single_file as writer_module

    real_save = writer_module.write_file
    waited: list[bool] = []

    def slow_save(obj: Any, path: Any, cancel: Any = None, name: Any = None) -> Any:
        if "s00000003" in str(path):  # a write far slower than its budget
            waited.append(cancel.wait(5.0))
        return real_save(obj, path, cancel, name)

    monkeypatch.setattr(writer_module, "write_file", slow_save)
    budget = {"every_n_steps": 2, "preemption_budget_s": 0.2}
    with (
        _simple(tmp_path, hooks=[SigtermAt(3)], **budget) as h,
        pytest.raises(TrainingPreempted) as info,
    ):
        h.train(DATA, epochs=2)
    assert waited == [True], "the writer was not cancelled at the budget"
    assert info.value.checkpoint is None and info.value.global_step == 3
    assert "ckpt-e0000-s00000002.pt" in (tmp_path / LATEST).read_text()
    # The writer has stopped (it was joined): no file and no temporary file, now or later.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-e0000-s00000002.pt", LATEST]


def test_a_fresh_run_in_a_used_folder_warns(tmp_path: Path) -> None:
    from loguru import logger

    with _simple(tmp_path) as h:
        h.train(DATA, epochs=1)
    seen: list[str] = []
    logger.enable("nn_handler")
    sink = logger.add(seen.append, level="WARNING", format="{message}")
    try:
        with _simple(tmp_path, resume="never") as h:
            h.train(DATA, epochs=1)
    finally:
        logger.remove(sink)
        logger.disable("nn_handler")
    assert any("already holds 1 checkpoint(s)" in m and "resume='auto'" in m for m in seen), seen


def test_config_values_json_cannot_hold_are_stored_as_text() -> None:
    import json

    from nn_handler import TrainerConfig
    from nn_handler.training.checkpointing import plain_config

    plain = plain_config(TrainerConfig(compile_kwargs={"backend": len}))
    assert plain["compile_kwargs"]["backend"] == repr(len)
    assert json.loads(json.dumps(plain)) == plain


def test_a_checkpoint_from_a_newer_format_asks_for_an_upgrade(tmp_path: Path) -> None:
    with _simple(tmp_path) as h:
        h.train(DATA, epochs=1)
        checkpoint = load_file(tmp_path / "ckpt-e0001-s00000005.pt")
        checkpoint["version"] = 99
        with pytest.raises(CheckpointError, match=r"newer nn_handler \(format version 99"):
            h.trainer.load_state_dict(checkpoint, "future.pt")


def test_resuming_from_a_folder_or_saving_to_a_path_leaves_other_files_alone(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    with _simple(run) as h:
        h.train(DATA, epochs=1)
    in_flight = run / ".other.pt.tmp-999"  # another writer's temporary file
    in_flight.write_bytes(b"partial")
    elsewhere = tmp_path / "exports"
    elsewhere.mkdir()
    (elsewhere / ".x.pt.tmp-1").write_bytes(b"partial")
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss()) as h:
        assert h.resume(run) == run / "ckpt-e0001-s00000005.pt"
        h.save(elsewhere / "copy.pt")
    assert in_flight.exists() and (elsewhere / ".x.pt.tmp-1").exists()


def test_extra_training_values_resume_exactly_mid_epoch(tmp_path: Path) -> None:
    from tests.unit.test_trainer import _TwoLosses

    def run(folder: Path, hooks: Any = (), **checkpoint: Any) -> NNHandler:
        config = HandlerConfig.from_dict(
            {
                "loader": {"batch_size": 8, "seed": 3},
                "trainer": {"progress_bar": False},
                "checkpoint": {"dir": str(folder), "every_n_steps": 2, **checkpoint},
            }
        )
        return NNHandler(
            mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=hooks, trainer_class=_TwoLosses
        )

    with run(tmp_path / "full") as h:
        full = h.train(DATA, epochs=2).records
    with run(tmp_path / "cut", hooks=[SigtermAt(3)]) as h, pytest.raises(TrainingPreempted):
        h.train(DATA, epochs=2)  # stopped mid epoch 1 (5 steps per epoch)
    with run(tmp_path / "cut", resume="auto") as h:
        resumed = h.train(DATA, epochs=2).records
    for key in ("train_loss", "train_doubled", "train_size"):
        assert [r[key] for r in resumed] == [r[key] for r in full], key


def test_loading_another_world_sizes_checkpoint_for_inference_says_nothing_until_train(
    tmp_path: Path,
) -> None:
    """NNHandler.load of a 2-rank checkpoint in one process: no re-sharding warning for an
    inference; the next train(), where the data order matters, says it once."""
    from loguru import logger

    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=_QUIET) as h:
        h.train(DATA, epochs=1)
        one_rank = h.save(tmp_path / "one.pt")
    checkpoint = load_file(one_rank)
    checkpoint["world_size"] = 2
    checkpoint["ranks"] = [checkpoint["ranks"][0], checkpoint["ranks"][0]]
    two_ranks = tmp_path / "two.pt"
    atomic_save(checkpoint, two_ranks)
    seen: list[str] = []
    logger.enable("nn_handler")
    sink = logger.add(seen.append, level="WARNING", format="{message}")
    try:
        loaded = NNHandler.load(two_ranks, mlp(), sgd, nn.CrossEntropyLoss(), config=_QUIET)
        with loaded:
            loaded.evaluate(DATA)
            assert not [m for m in seen if "re-sharded" in m], seen
            loaded.train(DATA, epochs=2)
    finally:
        logger.remove(sink)
        logger.disable("nn_handler")
    assert len([m for m in seen if "written by 2 ranks" in m and "re-sharded" in m]) == 1, seen


class _PositionInFirstStep(Hook):
    """Records the batches done that a checkpoint taken in the first step would hold."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def before_step(self) -> None:
        if not self.seen:
            self.seen.append(self.trainer.checkpointing.state_dict()["trainer"]["batches_done"])


def test_a_checkpoint_inside_the_first_step_after_a_mid_epoch_resume_keeps_its_position(
    tmp_path: Path,
) -> None:
    """A save before the resumed loop's first step ends (a fault-tolerant member's emergency
    checkpoint) holds the batches already done, not 0: resumed from it, the run would
    otherwise train the epoch's first batches twice."""
    config = {
        "loader": {"batch_size": 8},
        "trainer": {"progress_bar": False, "max_steps": 3},  # 3 of the epoch's 5 batches
        "checkpoint": {"dir": str(tmp_path), "every_n_steps": 3, "every_n_epochs": None},
    }
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as h:
        h.train(regression_data(), epochs=1)
    probe = _PositionInFirstStep()
    with _simple(tmp_path, hooks=[probe], resume="auto") as h:
        h.train(regression_data(), epochs=1)
    assert probe.seen == [3]
