"""What a Lightning user reaches for on day one (issue 76), in one process: clipping by value,
``train(..., ckpt_path=...)``, a two-argument scheduler factory stepped per optimizer step, and
``full_state_dict``. (Under FSDP and at 2 ranks: tests/distributed/test_fsdp.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import ConfigError, NNHandler
from nn_handler.training.hooks import Hook
from tests.training_helpers import mlp, regression_data, sgd, state_of

DATA = regression_data(n=40)
QUIET = {"progress_bar": False}


class _Gradients(Hook):
    """The gradients as the optimizer stepped with them (kept until the next window)."""

    def __init__(self) -> None:
        self.seen: list[list[torch.Tensor]] = []

    def after_optimizer_step(self) -> None:
        params = self.trainer.module.parameters()
        self.seen.append([p.grad.detach().clone() for p in params if p.grad is not None])


@pytest.mark.parametrize("algorithm", ["value", "norm"])
def test_clipping_by_value_clamps_each_element_and_by_norm_the_whole(algorithm: str) -> None:
    grads = _Gradients()
    trainer = {**QUIET, "gradient_clip_val": 0.01, "gradient_clip_algorithm": algorithm}
    config = {"loader": {"batch_size": 8}, "trainer": trainer}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=[grads]) as h:
        h.train(DATA, epochs=1)
    for step in grads.seen:
        flat = torch.cat([g.flatten() for g in step])
        norm = float(flat.norm())
        if algorithm == "value":  # each element in [-0.01, 0.01], some at the bound
            assert float(flat.abs().max()) == pytest.approx(0.01) and norm > 0.011
        else:  # the whole norm at the bound
            assert norm == pytest.approx(0.01, rel=1e-4)


def test_an_unknown_clipping_algorithm_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="gradient_clip_algorithm"):
        NNHandler(mlp(), sgd, config={"trainer": {"gradient_clip_algorithm": "max"}})


def test_train_with_ckpt_path_continues_the_run_exactly(tmp_path: Path) -> None:
    config = {"loader": {"batch_size": 8}, "trainer": QUIET}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as straight:
        straight.train(DATA, epochs=1)
        path = straight.save(tmp_path / "one.pt")
        straight.train(DATA, epochs=2)
        reference = state_of(straight.model)
    with NNHandler(mlp(seed=3), sgd, nn.CrossEntropyLoss(), config=config) as again:
        again.train(DATA, epochs=2, ckpt_path=path)
        assert again.trainer.state.epoch == 2
        resumed = state_of(again.model)
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)


def test_ckpt_path_last_is_the_folders_latest(tmp_path: Path) -> None:
    config = {"loader": {"batch_size": 8}, "trainer": QUIET,
              "checkpoint": {"dir": str(tmp_path), "resume": "never"}}  # fmt: skip
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as first:
        first.train(DATA, epochs=1)
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as second:
        second.train(DATA, epochs=2, ckpt_path="last")
        assert len(second.history) == 2 and second.trainer.state.global_step == 10


def _one_cycle(optimizer: torch.optim.Optimizer, total_steps: int) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, 0.1, total_steps=total_steps)


def test_a_two_argument_scheduler_factory_steps_per_optimizer_step(tmp_path: Path) -> None:
    """Left to the default interval ('epoch'), OneCycleLR ran 3 of its steps and never warmed
    up; a factory of (optimizer, total_steps) now implies scheduler_interval 'step', which the
    checkpoint's configuration says."""
    config = {"loader": {"batch_size": 8}, "trainer": QUIET}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), _one_cycle, config=config) as h:
        assert h.trainer.config.scheduler_interval == "step"
        h.train(DATA, epochs=3)
        scheduler = h.trainer.scheduler
        assert scheduler is not None and scheduler.total_steps == 15 == scheduler.last_epoch
        saved = torch.load(h.save(tmp_path / "c.pt"), weights_only=True)
    assert saved["config"]["handler"]["trainer"]["scheduler_interval"] == "step"
    assert (
        h.config.trainer.scheduler_interval == "step"
        and h.trainer.hyperparameters()["trainer.scheduler_interval"] == "step"
    )


def test_a_two_argument_factory_with_a_per_epoch_interval_is_refused() -> None:
    config = {"trainer": {**QUIET, "scheduler_interval": "epoch"}}
    with pytest.raises(
        ConfigError, match=r"scheduler_interval is 'epoch'.*scheduler_interval: step"
    ):
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), _one_cycle, config=config)


def test_a_one_argument_factory_keeps_the_per_epoch_interval() -> None:
    def step_lr(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(optimizer, 1)

    config = {"loader": {"batch_size": 8}, "trainer": QUIET}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), step_lr, config=config) as h:
        h.train(DATA, epochs=2)
        assert h.trainer.config.scheduler_interval == "epoch"
        assert h.trainer.scheduler.last_epoch == 2


def test_full_state_dict_in_one_process_is_the_models_own() -> None:
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": QUIET}) as h:
        full = h.full_state_dict()
        assert full.keys() == h.trainer.module.state_dict().keys()
        assert all(torch.equal(full[k], v) for k, v in h.trainer.module.state_dict().items())


def test_several_validation_sets_by_name_or_by_index_in_one_process() -> None:
    from nn_handler import accuracy

    sets = [regression_data(n=10, seed=1), regression_data(n=6, seed=2)]
    config = {"loader": {"batch_size": 8}, "trainer": QUIET}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config,
                   metrics={"accuracy": accuracy}) as h:  # fmt: skip
        h.train(DATA, sets, epochs=1)
        record = h.history.last
        for index, data in enumerate(sets):
            alone = h.evaluate(data)
            assert record[f"val_loss/dataloader_idx_{index}"] == alone["loss"]
            assert record[f"val_accuracy/dataloader_idx_{index}"] == alone["accuracy"]
        h.train(DATA, {"small": sets[1]}, epochs=2)
        assert h.history.last["val_loss/small"] == h.evaluate(sets[1])["loss"]


@pytest.mark.parametrize(
    ("sets", "says"),
    [({}, "an empty dict"), ({"a/b": DATA}, "without '/'"), ({"": DATA}, "non-empty strings")],
)
def test_badly_named_validation_sets_are_config_errors(sets: Any, says: str) -> None:
    with (
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": QUIET}) as h,
        pytest.raises(ConfigError, match=says),
    ):
        h.train(DATA, sets, epochs=1)


def test_several_validation_sets_in_the_reproducible_mode_are_each_exact() -> None:
    trainer = {**QUIET, "reproducible": {"global_batch_size": 8, "micro_batch_size": 4}}
    sets = {"a": regression_data(n=10, seed=1), "b": regression_data(n=6, seed=2)}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": trainer}) as h:
        h.train(DATA, sets, epochs=1)
        for name, data in sets.items():
            assert h.history.last[f"val_loss/{name}"] == h.evaluate(data)["loss"]
        with pytest.raises(ConfigError, match="a validation loader is a DataLoader"):
            loader = torch.utils.data.DataLoader(sets["a"], batch_size=4)
            h.trainer.fit(h.loaders.reproducible_train_loader(DATA, h.config.trainer.reproducible),  # type: ignore[arg-type]
                          {"a": loader}, epochs=2)  # fmt: skip


# ----------------------------------------------------------------- the LR finder
def _optimizer_state(h: NNHandler) -> dict[str, Any]:
    import copy

    optimizer = h.trainer.optimizer
    assert optimizer is not None
    return copy.deepcopy(optimizer.state_dict())


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def test_lr_find_puts_everything_back_and_training_goes_on_as_without_it(tmp_path: Path) -> None:
    config = {"loader": {"batch_size": 8}, "trainer": QUIET, "precision": "bf16"}
    with NNHandler(mlp(), torch.optim.Adam, nn.CrossEntropyLoss(), config=config) as plain:
        plain.train(DATA, epochs=1)
        plain.train(DATA, epochs=2)
        reference = state_of(plain.model)
    with NNHandler(mlp(), torch.optim.Adam, nn.CrossEntropyLoss(), config=config) as h:
        h.train(DATA, epochs=1)
        weights, optimizer, step = (
            state_of(h.model),
            _optimizer_state(h),
            h.trainer.state.global_step,
        )
        result = h.lr_find(regression_data(n=64, seed=4), min_lr=1e-4, max_lr=1.0, num_training=30)
        assert len(result.lrs) == len(result.losses) and 2 <= len(result.lrs) <= 30
        assert result.lrs[0] == pytest.approx(1e-4) and result.lrs == sorted(result.lrs)
        assert _same(state_of(h.model), weights) and _same(_optimizer_state(h), optimizer)
        assert (
            h.trainer.state.global_step == step
            and h.trainer.optimizer.param_groups[0]["lr"] == 1e-3
        )  # type: ignore[union-attr]
        assert result.plot(tmp_path / "lr.png").stat().st_size > 0
        h.train(DATA, epochs=2)  # the same bits as a run that never looked for a rate
        assert _same(state_of(h.model), reference)


def test_the_suggestion_is_the_steepest_descent_of_the_curve() -> None:
    from nn_handler.lr_finder import LRFinderResult

    lrs = [10.0 ** (-6 + i / 4) for i in range(25)]
    losses = [2.0] * 12 + [1.9, 1.5, 1.2, 1.1, 1.05] + [1.0] * 4 + [1.5, 3.0, 9.0, 20.0]
    result = LRFinderResult(lrs, losses)
    assert result.suggestion() == lrs[12]  # 1.9 -> 1.5: the steepest fall
    assert result.suggestion(skip_begin=14) == lrs[14]
    assert LRFinderResult(lrs[:5], losses[:5]).suggestion() is None  # too few points


@pytest.mark.parametrize(
    ("arguments", "says"),
    [({"min_lr": 1.0, "max_lr": 0.1}, "0 < min_lr < max_lr"), ({"num_training": 1}, ">= 2")],
)
def test_lr_find_refuses_bad_ranges(arguments: dict[str, Any], says: str) -> None:
    with (
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": QUIET}) as h,
        pytest.raises(ConfigError, match=says),
    ):
        h.lr_find(DATA, **arguments)


def test_lr_find_in_the_reproducible_mode_puts_its_scales_back() -> None:
    trainer = {**QUIET, "reproducible": {"global_batch_size": 8, "micro_batch_size": 4}}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": trainer}) as h:
        before = state_of(h.model)
        result = h.lr_find(DATA, min_lr=1e-3, max_lr=0.5, num_training=12)
        assert len(result.losses) >= 2 and _same(state_of(h.model), before)


def test_lr_find_refuses_manual_optimization_and_fault_tolerance() -> None:
    from tests.unit.test_trainer_structure import GanLike

    with (
        NNHandler(mlp(), config={"trainer": QUIET}, trainer_class=GanLike) as manual,
        pytest.raises(ConfigError, match="with manual optimization set the rates yourself"),
    ):
        manual.lr_find(DATA)
    pytest.importorskip("torchft")
    trainer = {**QUIET, "reproducible": {"global_batch_size": 8, "micro_batch_size": 4},
               "fault_tolerance": {"lighthouse": "http://127.0.0.1:9"}}  # fmt: skip
    with (
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": trainer}) as member,
        pytest.raises(ConfigError, match="lr_find runs no fault-tolerant steps"),
    ):
        member.lr_find(DATA)


# ----------------------------------------------------------------- max_time
class _Slow(Hook):
    """Each step takes at least ``seconds`` (a slow model, as far as the clock can tell)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def after_step(self) -> None:
        import time

        time.sleep(self.seconds)


def test_max_time_stops_at_a_check_step_and_the_run_resumes_exactly(tmp_path: Path) -> None:
    base = {"loader": {"batch_size": 4}, "checkpoint": {"dir": str(tmp_path)}}
    straight_config = {**base, "trainer": QUIET, "checkpoint": {"dir": None}}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=straight_config) as straight:
        straight.train(DATA, epochs=2)  # 10 steps per epoch
        reference = state_of(straight.model)
    limited = {**base, "trainer": {**QUIET, "max_time": 0.3, "log_every_n_steps": 2}}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=limited, hooks=[_Slow(0.05)]) as first:
        first.train(DATA, epochs=2)
        stopped = first.trainer.state.global_step
        assert 2 <= stopped < 20 and stopped % 2 == 0, stopped  # at a check step, before the end
    resumed = {**base, "trainer": QUIET, "checkpoint": {"dir": str(tmp_path), "resume": "auto"}}
    with NNHandler(mlp(seed=4), sgd, nn.CrossEntropyLoss(), config=resumed) as second:
        second.train(DATA, epochs=2)
        assert second.trainer.state.global_step == 20
        assert _same(state_of(second.model), reference)


@pytest.mark.parametrize(
    ("given", "seconds"), [("00:01:30:05", 5405.0), ("2:00", 120.0), (90, 90.0), (0.5, 0.5)]
)
def test_max_time_takes_seconds_or_lightnings_string(given: Any, seconds: float) -> None:
    from nn_handler.config.training import TrainerConfig

    assert TrainerConfig(max_time=given).max_time == seconds


@pytest.mark.parametrize("given", ["1h", "1:2:3:4:5", "-1", 0, "::"])
def test_a_bad_max_time_is_a_config_error(given: Any) -> None:
    with pytest.raises(ConfigError, match="max_time"):
        NNHandler(mlp(), sgd, config={"trainer": {"max_time": given}})


def test_max_time_in_a_fault_tolerant_run_is_refused() -> None:
    trainer = {"max_time": 60, "reproducible": {"global_batch_size": 8, "micro_batch_size": 4},
               "fault_tolerance": {"lighthouse": "http://127.0.0.1:9"}}  # fmt: skip
    with pytest.raises(ConfigError, match="max_time: each member of a fault-tolerant run"):
        NNHandler(mlp(), sgd, config={"trainer": trainer})


# ----------------------------------------------------------------- validation cadence
class _Validations(Hook):
    def __init__(self) -> None:
        self.epochs: list[int] = []

    def after_validation(self, metrics: dict[str, float]) -> None:
        self.epochs.append(self.trainer.state.epoch)


def test_check_val_every_n_epoch_validates_every_nth_and_monitors_skip_the_others(
    tmp_path: Path,
) -> None:
    seen = _Validations()

    def plateau(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, patience=0)

    trainer = {**QUIET, "check_val_every_n_epoch": 2, "val_check_interval": 5,
               "early_stopping": {"monitor": "val_loss", "patience": 3}}  # fmt: skip
    checkpoint = {"dir": str(tmp_path), "save_best": True, "monitor": "val_loss"}
    config = {"loader": {"batch_size": 4}, "trainer": trainer, "checkpoint": checkpoint}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), plateau, config=config, hooks=[seen]) as h:
        h.train(DATA, regression_data(n=8, seed=1), epochs=4)
        records = h.history.records
        assert ["val_loss" in r for r in records] == [False, True, False, True]
        # epoch 2 and 4 validate, inside (after batch 5 of 10) and at their end
        assert seen.epochs == [1, 1, 3, 3]
        assert h.trainer.early_stopping is not None and h.trainer.early_stopping.best_epoch in (
            2,
            4,
        )
    assert (tmp_path / "best").exists() or any("best" in p.name for p in tmp_path.iterdir())


# ----------------------------------------------------------------- the model summary
def test_the_model_summary_counts_trainable_and_frozen_parameters_per_module(
    lines: list[str],
) -> None:
    model = mlp(batchnorm=True)
    model[0].requires_grad_(False)  # 112 frozen
    with NNHandler(model, sgd, nn.CrossEntropyLoss(), config={"trainer": QUIET}):
        pass
    text = "\n".join(lines)
    assert "model: Sequential, 195 parameters (83 trainable, 112 frozen), 780 B" in text
    assert "  0: Linear, 112 parameters (0 trainable, 112 frozen), 448 B" in text
    assert "  2: Tanh, no parameters" in text
    before = len(lines)
    config = {"trainer": {**QUIET, "model_summary": False}}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config):
        pass
    assert not any("model: Sequential" in line for line in lines[before:])


# ----------------------------------------------------------------- the sanity check
def test_num_sanity_val_steps_fails_a_broken_validation_before_any_step() -> None:
    from nn_handler.training.trainer import Trainer

    class Broken(Trainer):
        def validation_step(self, batch: Any) -> Any:
            raise KeyError("logits")  # e.g. a wrong key in the model's output

    config = {"loader": {"batch_size": 4}, "trainer": {**QUIET, "num_sanity_val_steps": 2}}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, trainer_class=Broken) as h:
        with pytest.raises(KeyError, match="logits"):
            h.train(DATA, regression_data(n=8, seed=1), epochs=1)
        assert h.trainer.state.global_step == 0  # not one training step taken


def test_the_sanity_check_leaves_the_run_as_it_would_have_been() -> None:
    from nn_handler import accuracy

    runs = []
    for sanity in (0, 2, -1):
        config = {"loader": {"batch_size": 4}, "trainer": {**QUIET, "num_sanity_val_steps": sanity}}
        torch.manual_seed(0)  # the weights, then dropout's draws in training
        model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.3), nn.Tanh(), nn.Linear(16, 3))
        with NNHandler(model, sgd, nn.CrossEntropyLoss(), config=config,
                       metrics={"accuracy": accuracy}) as h:  # fmt: skip
            h.train(DATA, regression_data(n=8, seed=1), epochs=1)
            runs.append((state_of(h.model), h.history.last["val_accuracy"]))
    for weights, value in runs[1:]:
        assert _same(weights, runs[0][0]) and value == runs[0][1]


# ----------------------------------------------------------------- a local folder of checkpoints
def test_a_local_folder_of_checkpoints_opens_its_newest_like_an_object_stores(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from nn_handler.cli import main as cli

    folder = tmp_path / "ckpt"
    checkpoint = {"dir": str(folder), "keep_last": 3}  # epochs 1 and 2: the newest is 2's
    config = {"loader": {"batch_size": 8}, "trainer": QUIET, "checkpoint": checkpoint}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as h:
        h.train(DATA, epochs=2)
        weights = state_of(h.model)
    assert len(list(folder.glob("ckpt-*.pt"))) == 2
    with NNHandler.load(folder, mlp(seed=3)) as loaded:  # the folder, not a file in it
        assert loaded.trainer.state.epoch == 2 and _same(state_of(loaded.model), weights)
    assert cli(["checkpoint", "inspect", str(folder)]) == 0
    said = capsys.readouterr().out
    assert "ckpt-e0002-s00000010.pt" in said and "epochs done 2, optimizer steps 10" in said
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(Exception, match="no complete checkpoint"):
        NNHandler.load(empty, mlp())


def test_lr_find_on_an_empty_loader_is_a_config_error() -> None:
    empty = torch.utils.data.DataLoader(regression_data(n=0), batch_size=4)
    with (
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": QUIET}) as h,
        pytest.raises(ConfigError, match="lr_find got an empty training loader"),
    ):
        h.lr_find(empty)
