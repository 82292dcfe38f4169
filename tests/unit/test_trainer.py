"""The Trainer and NNHandler in one process: the loop's rules, its override points and errors."""

from __future__ import annotations

import gc
import math
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nn_handler import (
    ConfigError,
    HandlerConfig,
    History,
    Hook,
    NNHandler,
    NonFiniteError,
    NullCommunicator,
    TensorBoardLogger,
    Trainer,
    accuracy,
)
from nn_handler.config import EmaConfig, PrecisionConfig, TrainerConfig
from nn_handler.training import ModelEma, resolve_precision
from tests.training_helpers import max_difference, mlp, regression_data, sgd, state_of


def _handler(**config: Any) -> NNHandler:
    config.setdefault("trainer", {}).setdefault("progress_bar", False)
    return NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config)


def test_accumulation_equals_one_big_batch_including_the_partial_last_window() -> None:
    # 40 samples: batch 4 x accumulate 3 gives windows of 3, 3, 3, 1 micro-batches; batch 12
    # gives batches of 12, 12, 12, 4. Same samples per step, so the same parameters.
    accumulated = _handler(
        loader={"batch_size": 4, "shuffle": False}, trainer={"accumulate_grad_batches": 3}
    )
    accumulated.train(regression_data(), epochs=2)
    whole = _handler(loader={"batch_size": 12, "shuffle": False})
    whole.train(regression_data(), epochs=2)
    assert accumulated.trainer.state.global_step == whole.trainer.state.global_step == 8
    assert max_difference(state_of(accumulated.model), state_of(whole.model)) < 1e-6


def test_history_holds_one_record_per_epoch_with_every_quantity() -> None:
    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        config={"loader": {"batch_size": 8}, "trainer": {"progress_bar": False}},
        metrics={"accuracy": accuracy},
    )
    history = handler.train(regression_data(), regression_data(n=13, seed=1), epochs=3)
    assert len(history) == 3 and history["epoch"] == [1.0, 2.0, 3.0]
    assert history["lr"] == [0.1, 0.05, 0.025]  # the rate each epoch trained with
    assert set(history.last) >= {
        "train_loss",
        "val_loss",
        "val_accuracy",
        "epoch_time",
        "samples_per_sec",
        "lr",
    }
    # Training further continues the same run: epochs counts the total.
    handler.train(regression_data(), regression_data(n=13, seed=1), epochs=4)
    assert history["epoch"] == [1.0, 2.0, 3.0, 4.0]


def test_per_step_scheduling_steps_once_per_optimizer_step() -> None:
    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
        config={
            "loader": {"batch_size": 10},
            "trainer": {"scheduler_interval": "step", "accumulate_grad_batches": 2},
        },
    )
    handler.train(regression_data(), epochs=1)  # 4 batches, 2 optimizer steps
    assert handler.trainer.optimizer is not None
    assert handler.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 / 3)


def test_train_loss_is_the_sample_weighted_mean_of_the_epoch() -> None:
    seen: list[tuple[float, int]] = []

    class Recorder(Hook):
        def after_step(self) -> None:
            loss = self.trainer.state.last_loss
            assert loss is not None
            seen.append((float(loss), 1))

    handler = NNHandler(
        mlp(),
        torch.optim.SGD(mlp().parameters(), lr=0.0),
        nn.CrossEntropyLoss(),
        config={"loader": {"batch_size": 16, "shuffle": False}},
        hooks=[Recorder()],
    )
    # A frozen model (lr 0 on another model's parameters): per-batch losses are fixed.
    history = handler.train(regression_data(), epochs=1)  # batches of 16, 16, 8
    sizes = [16, 16, 8]
    expected = sum(loss * n for (loss, _), n in zip(seen, sizes, strict=True)) / 40
    assert history.last["train_loss"] == pytest.approx(expected, rel=1e-6)


class Counting(NullCommunicator):
    """A Communicator test double that counts the collectives the trainer asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def all_reduce(self, data: Any, op: Any = "sum") -> Any:
        self.calls.append("all_reduce")
        return super().all_reduce(data, op)

    def all_reduce_(self, tensor: torch.Tensor, op: Any = "sum") -> torch.Tensor:
        self.calls.append("all_reduce_")
        return super().all_reduce_(tensor, op)

    def broadcast(self, data: Any, src: int = 0) -> Any:
        self.calls.append("broadcast")
        return super().broadcast(data, src)


def test_the_loop_reduces_once_per_epoch_and_never_per_step() -> None:
    for batch_size in (20, 2):  # 2 and 20 steps per epoch
        comm = Counting()
        handler = NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            communicator=comm,
            config={"loader": {"batch_size": batch_size}},
        )
        handler.train(regression_data(), regression_data(n=9), epochs=2)
        # One in-place reduction for the train loss, one for validation, per epoch.
        assert comm.calls == ["all_reduce_"] * 4


HOST_SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")


def _count_host_syncs(monkeypatch: pytest.MonkeyPatch, run: Any) -> int:
    calls = 0

    def counting(name: str) -> Any:
        original = getattr(torch.Tensor, name)

        def wrapper(self: torch.Tensor, *args: Any) -> Any:
            nonlocal calls
            calls += 1
            return original(self, *args)

        return wrapper

    for name in HOST_SYNCS:
        monkeypatch.setattr(torch.Tensor, name, counting(name))
    try:
        run()
    finally:
        monkeypatch.undo()
    return calls


def test_the_hot_path_never_synchronises_with_the_host_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    counts = {}
    for batch_size in (20, 1):  # 2 and 40 steps per epoch
        handler = _handler(
            loader={"batch_size": batch_size}, trainer={"nonfinite": "off", "epochs": 2}
        )
        counts[batch_size] = _count_host_syncs(
            monkeypatch, lambda handler=handler: handler.train(regression_data())
        )
    assert counts[1] == counts[20], f"host syncs grow with the number of steps: {counts}"
    # The counter sees a sync in the step (so the equality above can fail).
    guarded = _handler(loader={"batch_size": 1}, trainer={"epochs": 2})
    with_guard = _count_host_syncs(monkeypatch, lambda: guarded.train(regression_data()))
    assert with_guard >= counts[1] + 80  # the NaN guard's one decision per optimizer step


def test_the_nonfinite_guard_skips_the_step_and_keeps_the_weights() -> None:
    class NaNAtSecondBatch(Trainer):
        def training_step(self, batch: Any) -> torch.Tensor:
            loss = super().training_step(batch)
            assert isinstance(loss, torch.Tensor)
            return loss * float("inf") if self.state.batch_index == 1 else loss

    before: dict[str, torch.Tensor] = {}
    after: dict[str, torch.Tensor] = {}

    class Snapshots(Hook):
        def before_step(self) -> None:
            if self.trainer.state.batch_index == 1:
                before.update(state_of(self.trainer.module))

        def after_step(self) -> None:
            if self.trainer.state.batch_index == 1:
                after.update(state_of(self.trainer.module))

    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        trainer_class=NaNAtSecondBatch,
        hooks=[Snapshots()],
        config={"loader": {"batch_size": 10, "shuffle": False}},
    )
    history = handler.train(regression_data(), epochs=1)
    assert history.last["skipped_steps"] == 1.0
    assert max_difference(before, after) == 0.0
    assert all(torch.isfinite(v).all() for v in state_of(handler.model).values())
    assert math.isfinite(history.last["train_loss"])  # the inf batch is left out of the mean


@pytest.mark.parametrize("accumulate", [1, 2])
def test_a_nonfinite_loss_with_finite_gradients_is_still_skipped(accumulate: int) -> None:
    # The NaN has no gradient path: only the loss shows it (in one process the guard checks
    # the window's losses with the gradients; with DDP the seeded backward carries it).
    class NaNLossOnly(Trainer):
        def training_step(self, batch: Any) -> torch.Tensor:
            loss = super().training_step(batch)
            assert isinstance(loss, torch.Tensor)
            return loss + torch.tensor(float("nan")) if self.state.batch_index == 0 else loss

    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        trainer_class=NaNLossOnly,
        config={
            "loader": {"batch_size": 10, "shuffle": False},
            "trainer": {"accumulate_grad_batches": accumulate},
        },
    )
    history = handler.train(regression_data(), epochs=1)
    assert history.last["skipped_steps"] == 1.0, "the window holding the NaN loss is skipped"
    assert all(torch.isfinite(v).all() for v in state_of(handler.model).values())


def test_the_nonfinite_guard_can_raise_instead() -> None:
    class AlwaysNaN(Trainer):
        def compute_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
            return super().compute_loss(outputs, targets) * float("nan")

    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        trainer_class=AlwaysNaN,
        config={"trainer": {"nonfinite": "raise"}},
    )
    with pytest.raises(NonFiniteError, match=r"epoch 1, optimizer step 1.*nonfinite='skip'"):
        handler.train(regression_data())


def test_hooks_run_in_order_and_after_train_runs_when_training_raises() -> None:
    events: list[str] = []

    class Recorder(Hook):
        def before_train(self) -> None:
            events.append("before_train")

        def before_epoch(self) -> None:
            events.append("before_epoch")

        def after_epoch(self) -> None:
            events.append(f"after_epoch:{self.trainer.history.last['epoch']:.0f}")

        def after_train(self) -> None:
            events.append("after_train")

    handler = NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), hooks=[Recorder()])
    handler.train(regression_data(), epochs=2)
    assert events == [
        "before_train",
        "before_epoch",
        "after_epoch:1",
        "before_epoch",
        "after_epoch:2",
        "after_train",
    ]

    class Broken(Trainer):
        def training_step(self, batch: Any) -> torch.Tensor:
            raise RuntimeError("boom in training_step")

    events.clear()
    broken = NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), hooks=[Recorder()], trainer_class=Broken)
    with pytest.raises(RuntimeError, match="boom"):
        broken.train(regression_data())
    assert events == ["before_train", "before_epoch", "after_train"]


def test_hooks_hold_only_a_weak_reference_to_the_trainer() -> None:
    hook = Hook()
    trainer = Trainer(mlp(), sgd, nn.CrossEntropyLoss(), hooks=[hook])
    assert hook.trainer is trainer
    del trainer
    gc.collect()
    with pytest.raises(Exception, match="not attached to a live Trainer"):
        _ = hook.trainer


def test_training_step_may_return_a_dict_and_bad_returns_are_named() -> None:
    class DictStep(Trainer):
        def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
            x, y = batch
            return {"loss": nn.functional.cross_entropy(self.forward(x), y)}

    Trainer_ = DictStep(mlp(), sgd, config=TrainerConfig(progress_bar=False))
    loader = DataLoader(regression_data(), batch_size=8)
    assert len(Trainer_.fit(loader, epochs=1)) == 1

    class NoLoss(Trainer):
        def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
            return {"total": torch.zeros(())}

    with pytest.raises(ConfigError, match=r"'loss' tensor, got dict with keys \['total'\]"):
        NoLoss(mlp(), sgd).fit(loader)


def test_missing_parts_give_errors_that_say_what_to_pass() -> None:
    loader = DataLoader(regression_data(), batch_size=8)
    with pytest.raises(ConfigError, match="needs an optimizer: pass optimizer="):
        Trainer(mlp(), loss_fn=nn.CrossEntropyLoss()).fit(loader)
    with pytest.raises(ConfigError, match="no loss_fn"):
        Trainer(mlp(), sgd).fit(loader)
    with pytest.raises(ConfigError, match=r"must be a torch.nn.Module"):
        Trainer("model")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="plain model"):
        Trainer(nn.parallel.DistributedDataParallel.__new__(nn.parallel.DistributedDataParallel))
    with pytest.raises(ConfigError, match=r"expect \(inputs, targets\) batches"):
        Trainer(mlp(), sgd, nn.CrossEntropyLoss()).fit(
            DataLoader(regression_data().tensors[0], batch_size=8)
        )
    with pytest.raises(ConfigError, match="scheduler_interval='epoch'"):
        Trainer(
            mlp(),
            sgd,
            scheduler=lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o),
            config=TrainerConfig(scheduler_interval="step"),
        )
    with pytest.raises(ConfigError, match="expected a torch Dataset or DataLoader"):
        _handler().train([1, 2, 3])


def test_reduce_on_plateau_gets_the_monitored_metric() -> None:
    handler = NNHandler(
        mlp(),
        lambda p: torch.optim.SGD(p, lr=0.0),  # the loss never improves
        nn.CrossEntropyLoss(),
        lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5),
        config={"trainer": {"scheduler_monitor": "val_loss"}},
    )
    handler.train(regression_data(), regression_data(n=10), epochs=3)
    assert handler.history["lr"] == [0.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match="ReduceLROnPlateau monitors 'val_loss'"):
        NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
        ).train(regression_data())


def test_early_stopping_stops_after_patience_epochs_without_improvement() -> None:
    handler = _handler(
        trainer={"early_stopping": {"monitor": "train_loss", "patience": 2, "min_delta": 1e3}}
    )
    history = handler.train(regression_data(), epochs=10)
    assert len(history) == 3  # improvement from inf, then two epochs without
    with pytest.raises(ConfigError, match=r"monitors 'val_accuracy'.*pass val_data"):
        _handler(trainer={"early_stopping": {"monitor": "val_accuracy"}}).train(regression_data())


@pytest.mark.parametrize(
    ("config", "scheduler", "what"),
    [
        ({"trainer": {"early_stopping": {"monitor": "val_acuracy"}}}, None, "early stopping"),
        ({"checkpoint": {"save_best": True, "monitor": "val_acuracy"}}, None, "save_best"),
        (
            {"trainer": {"scheduler_monitor": "val_acuracy"}},
            lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt),
            "ReduceLROnPlateau",
        ),
    ],
)
def test_a_misspelt_monitor_is_refused_before_the_first_step(
    tmp_path: Path, config: dict[str, Any], scheduler: Any, what: str
) -> None:
    if "checkpoint" in config:
        config["checkpoint"]["dir"] = str(tmp_path)
    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        scheduler,
        config={
            **config,
            "loader": {"batch_size": 8},
            "trainer": {**config.get("trainer", {}), "progress_bar": False},
        },
        metrics={"accuracy": accuracy},
    )
    before = state_of(handler.model)
    with pytest.raises(ConfigError) as error:
        handler.train(regression_data(), regression_data(n=10), epochs=2)
    message = str(error.value)
    assert f"{what} monitors 'val_acuracy', which this run never records." in message
    assert "Did you mean 'val_accuracy'?" in message and "val_loss" in message
    assert handler.trainer.state.global_step == 0 and len(handler.history) == 0
    assert max_difference(state_of(handler.model), before) == 0.0
    handler.close()


def test_monitors_of_a_subclass_that_decides_its_own_metrics_are_checked_after_the_epoch() -> None:
    class OwnMetrics(Trainer):
        def validation_step(self, batch: Any) -> dict[str, Any]:
            return {"loss": 0.0, "custom": 1.0}

    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={"trainer": {"early_stopping": {"monitor": "val_custom"}, "progress_bar": False}},
        trainer_class=OwnMetrics,
    )
    history = handler.train(regression_data(), regression_data(n=10), epochs=1)
    assert history["val_custom"] == [1.0]  # known only once the subclass has run


def test_precision_names_resolve_per_device() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_precision("amp", cpu) == "bf16"  # seed 003's use_amp on CPU
    assert resolve_precision("amp", cuda) == "fp16"
    assert resolve_precision("bf16", cpu) == "bf16"
    with pytest.raises(ConfigError, match=r"precision='fp16' needs a CUDA device.*'bf16'"):
        resolve_precision("fp16", cpu)
    with pytest.raises(ConfigError, match="fp16"):
        _handler(precision="fp16")


def test_bf16_autocast_trains_on_cpu() -> None:
    seen: list[torch.dtype] = []

    class Watch(Trainer):
        def compute_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
            seen.append(outputs.dtype)
            return super().compute_loss(outputs, targets)

    handler = NNHandler(
        mlp(), sgd, nn.CrossEntropyLoss(), config={"precision": "bf16"}, trainer_class=Watch
    )
    history = handler.train(regression_data(), regression_data(n=10), epochs=2)
    assert seen and set(seen) == {torch.bfloat16}
    assert all(math.isfinite(v) for v in history["train_loss"] + history["val_loss"])
    assert next(handler.model.parameters()).dtype == torch.float32  # weights stay fp32


def test_ema_follows_the_formula_with_warmup_update_every_and_buffers() -> None:
    model = mlp(batchnorm=True)
    config = EmaConfig(enabled=True, decay=0.5, warmup=False, update_every=2, buffers="copy")
    ema = ModelEma(model, config)
    start = state_of(ema.module)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
        model[1].running_mean.fill_(3.0)
    ema.update()  # step 1: not an update step with update_every=2
    assert max_difference(state_of(ema.module), start) == 0.0
    ema.update()  # step 2: ema = 0.5 * ema + 0.5 * weights
    for key, value in state_of(ema.module).items():
        source = state_of(model)[key]
        if key.endswith("running_mean"):
            assert torch.equal(value, source)  # buffers copied
        elif value.is_floating_point() and "running" not in key:
            assert torch.allclose(value, 0.5 * start[key] + 0.5 * source)
    assert ema.num_updates == 1

    warm = ModelEma(mlp(), EmaConfig(enabled=True, decay=0.999))  # warm-up on by default
    assert warm.decay() == pytest.approx(0.1)  # (1 + 0) / (10 + 0)
    warm.num_updates = 100_000
    assert warm.decay() == 0.999
    restored = ModelEma(mlp(batchnorm=True), EmaConfig(enabled=True, update_every=2))
    restored.load_state_dict(ema.state_dict())
    assert restored.num_updates == 1
    assert max_difference(state_of(restored.module), state_of(ema.module)) == 0.0


def test_ema_before_start_step_copies_the_weights_and_validation_uses_it() -> None:
    handler = _handler(
        ema={"enabled": True, "decay": 0.99, "start_step": 1000}, loader={"batch_size": 8}
    )
    handler.train(regression_data(), epochs=1)
    assert handler.trainer.ema is not None
    assert max_difference(state_of(handler.trainer.ema.module), state_of(handler.model)) == 0.0
    averaging = _handler(ema={"enabled": True, "decay": 0.9}, loader={"batch_size": 8})
    averaging.train(regression_data(), epochs=1)
    ema_loss = averaging.evaluate(regression_data(n=10))["loss"]
    plain_loss = averaging.evaluate(regression_data(n=10), use_ema=False)["loss"]
    assert ema_loss != plain_loss
    with pytest.raises(ConfigError, match="EMA is off"):
        _handler().evaluate(regression_data(n=10), use_ema=True)


def test_torchmetrics_metrics_are_accepted() -> None:
    torchmetrics = pytest.importorskip("torchmetrics")
    metric = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        metrics={"tm_accuracy": metric, "accuracy": accuracy},
    )
    result = handler.evaluate(regression_data(n=23, seed=1))
    assert result["tm_accuracy"] == pytest.approx(result["accuracy"], abs=1e-6)


def test_history_saves_as_json_and_csv_and_plots(tmp_path: Path) -> None:
    handler = _handler(loader={"batch_size": 8})
    history = handler.train(regression_data(), regression_data(n=10), epochs=2)
    assert History.from_json(history.to_json(tmp_path / "h.json")) == history
    lines = history.to_csv(tmp_path / "h.csv").read_text().splitlines()
    assert lines[0].split(",") == history.keys() and len(lines) == 3
    pytest.importorskip("matplotlib")
    png = history.plot(tmp_path / "curves.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(KeyError, match="has no 'nope'"):
        history["nope"]


def test_tensorboard_logger_writes_event_files(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    logger_hook = TensorBoardLogger(tmp_path / "tb", every_n_steps=1)
    handler = NNHandler(
        mlp(), sgd, nn.CrossEntropyLoss(), hooks=[logger_hook], config={"loader": {"batch_size": 8}}
    )
    handler.train(regression_data(), regression_data(n=10), epochs=2)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {"train_loss_step", "train_loss", "val_loss", "epoch"} <= set(tags)
    assert len(events.Scalars("train_loss_step")) == 10  # 5 steps x 2 epochs
    # Epoch records at the optimizer steps done (one axis with the step losses).
    assert [(e.step, e.value) for e in events.Scalars("epoch")] == [(5, 1.0), (10, 2.0)]
    assert events.Tags()["images"] == ["curves"]


def test_compiled_models_train_and_unwrap(tmp_path: Path) -> None:
    handler = _handler(trainer={"compile": True, "compile_kwargs": {"backend": "eager"}})
    assert type(handler.trainer.model).__name__ == "OptimizedModule"
    history = handler.train(regression_data(), epochs=1)
    assert len(history) == 1
    assert "_orig_mod" not in "".join(handler.model.state_dict())


def test_logging_config_writes_a_per_rank_file(tmp_path: Path) -> None:
    target = tmp_path / "logs" / "rank{rank}.log"
    with NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={"logging": {"enabled": True, "file": str(target)}},
    ) as handler:
        handler.train(regression_data(), epochs=1)
    text = (tmp_path / "logs" / "rank0.log").read_text()
    assert "rank 0" in text and "epoch 1/1: train_loss=" in text


def test_handler_config_accepts_dicts_files_and_names_bad_fields(tmp_path: Path) -> None:
    config = HandlerConfig.from_dict({"precision": "bf16", "trainer": {"epochs": 3}})
    assert config.precision == PrecisionConfig(precision="bf16") and config.trainer.epochs == 3
    (tmp_path / "c.yaml").write_text(
        "trainer:\n  accumulate_grad_batches: 4\nema:\n  enabled: true\n"
    )
    loaded = HandlerConfig.from_file(tmp_path / "c.yaml")
    assert loaded.trainer.accumulate_grad_batches == 4 and loaded.ema.enabled
    (tmp_path / "c.json").write_text(config.model_dump_json())
    assert HandlerConfig.from_file(tmp_path / "c.json") == config
    with pytest.raises(ConfigError, match=r"trainer\.accumulate_grad_batches: Input should be"):
        HandlerConfig.from_dict({"trainer": {"accumulate_grad_batches": 0}})
    with pytest.raises(ConfigError, match=r"ema\.decay_rate: Extra inputs are not permitted"):
        HandlerConfig.from_dict({"ema": {"decay_rate": 0.9}})
    (tmp_path / "bad.yaml").write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml is not valid YAML"):
        HandlerConfig.from_file(tmp_path / "bad.yaml")
    (tmp_path / "x.toml").write_text("")
    with pytest.raises(ConfigError, match=r"must end in \.json, \.yaml or \.yml"):
        HandlerConfig.from_file(tmp_path / "x.toml")
    with pytest.raises(ConfigError, match="cannot read config file"):
        HandlerConfig.from_file(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        HandlerConfig.from_file(tmp_path / "list.json")
    with pytest.raises(ConfigError, match="config must be a HandlerConfig"):
        NNHandler(mlp(), config=42)  # type: ignore[arg-type]


def test_predict_in_one_process_returns_every_output_in_order() -> None:
    handler = _handler(loader={"batch_size": 4})
    data = regression_data(n=10)
    with torch.no_grad():
        expected = handler.model(data.tensors[0])
    assert torch.allclose(handler.predict(data), expected)
    ready = DataLoader(data, batch_size=3)
    assert torch.allclose(handler.predict(ready), expected)


def test_every_epoch_reshuffles_reproducibly_through_set_epoch() -> None:
    def first_batches() -> list[list[float]]:
        seen: list[list[float]] = []

        class Record(Trainer):
            def training_step(self, batch: Any) -> torch.Tensor:
                if self.state.batch_index == 0:
                    seen.append(batch[0][:, 0].tolist())
                return super().training_step(batch)

        handler = NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            trainer_class=Record,
            config={"loader": {"batch_size": 8, "seed": 7}},
        )
        handler.train(regression_data(), epochs=3)
        return seen

    once, again = first_batches(), first_batches()
    assert once == again, "the same seed gives the same order"
    assert once[0] != once[1] != once[2], "each epoch draws a new order"


def test_more_wrong_inputs_are_named_with_their_fix(tmp_path: Path) -> None:
    loader = DataLoader(regression_data(), batch_size=8)
    with pytest.raises(
        ConfigError, match=r"optimizer must be a torch\.optim\.Optimizer or a factory"
    ):
        Trainer(mlp(), optimizer=42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="a scheduler needs an optimizer"):
        Trainer(mlp(), scheduler=lambda opt: None)
    with pytest.raises(ConfigError, match="epochs must be at least 1, got 0"):
        Trainer(mlp(), sgd, nn.CrossEntropyLoss()).fit(loader, epochs=0)
    with pytest.raises(ConfigError, match="nn_handler Hook instances, got str"):
        Trainer(mlp(), hooks=["print"])  # type: ignore[list-item]

    class Stream(torch.utils.data.IterableDataset[Any]):
        def __iter__(self) -> Any:
            return iter(regression_data())

    with pytest.raises(ConfigError, match="accumulation needs a loader with len"):
        Trainer(
            mlp(), sgd, nn.CrossEntropyLoss(), config=TrainerConfig(accumulate_grad_batches=2)
        ).fit(DataLoader(Stream(), batch_size=4))
    (tmp_path / "bad.json").write_text("{trainer: 1")
    with pytest.raises(ConfigError, match=r"bad\.json is not valid JSON"):
        HandlerConfig.from_file(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="no epoch has finished yet"):
        _ = History().last


def test_optional_packages_missing_give_the_install_command(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from nn_handler.digits import digits_datasets

    with pytest.raises(ConfigError, match=r"val_fraction must be in \(0, 1\), got 1.5"):
        digits_datasets(val_fraction=1.5)
    for module in ("matplotlib", "torch.utils.tensorboard", "sklearn"):
        monkeypatch.setitem(sys.modules, module, None)  # import now raises ImportError
    with pytest.raises(ConfigError, match=r"pip install 'nn_handler\[plot\]'"):
        History([{"epoch": 1.0, "train_loss": 0.5}]).plot(tmp_path / "x.png")
    with pytest.raises(ConfigError, match=r"pip install 'nn_handler\[tensorboard\]'"):
        TensorBoardLogger(tmp_path).log_metrics({"a": 1.0}, 1)
    with pytest.raises(ConfigError, match=r"pip install 'nn_handler\[demo\]'"):
        digits_datasets()


def test_digits_read_from_scikit_learns_csv_equal_load_digits_without_importing_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The digits come from the CSV scikit-learn ships, read without importing scikit-learn
    (1.3 s of CPU in every rank); they equal ``load_digits``'s, and ``load_digits`` is used
    when the file is not where scikit-learn keeps it."""
    pytest.importorskip("sklearn")
    import importlib.util

    from sklearn.datasets import load_digits

    from nn_handler import digits

    reference = load_digits()
    pixels, labels = digits._bundled_digits()
    assert (pixels == reference.data).all() and (labels == reference.target).all()
    assert labels.dtype == reference.target.dtype and pixels.shape == (1797, 64)
    train, val = digits.digits_datasets()
    assert len(train) + len(val) == 1797 and train[0][0].shape == (1, 8, 8)
    assert float(train.tensors[0].min()) == 0.0 and float(train.tensors[0].max()) == 1.0

    real = importlib.util.find_spec("sklearn")
    assert real is not None
    moved = importlib.util.spec_from_file_location("sklearn", tmp_path / "__init__.py")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: moved)
    again, again_val = digits.digits_datasets()  # the fallback: load_digits
    assert torch.equal(again.tensors[0], train.tensors[0])
    assert torch.equal(again_val.tensors[1], val.tensors[1])

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: real)
    imported: list[str] = []

    class Watch:
        def find_spec(self, name: str, *_: Any) -> None:
            imported.append(name)

    for name in [m for m in sys.modules if m == "sklearn" or m.startswith("sklearn.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Watch(), *sys.meta_path])
    digits.digits_datasets()
    assert not [name for name in imported if name.startswith("sklearn")], imported


def _schedule_warnings(run: Any) -> list[str]:
    from loguru import logger

    seen: list[str] = []
    logger.enable("nn_handler")
    sink = logger.add(seen.append, level="WARNING", format="{message}")
    try:
        run()
    finally:
        logger.remove(sink)
        logger.disable("nn_handler")
    return [m for m in seen if "LR scheduler" in m]


def test_extending_epochs_past_a_schedule_says_what_happens(tmp_path: Path) -> None:
    def handler(**trainer: Any) -> NNHandler:
        return NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=2),
            config={
                "loader": {"batch_size": 20},
                "trainer": {"progress_bar": False, **trainer},
                "checkpoint": {"dir": str(tmp_path), "resume": "auto"},
            },
        )

    assert _schedule_warnings(lambda: handler().train(regression_data(), epochs=2)) == []
    # The demo's `--resume --epochs 12` on a 10-epoch cosine: warned before training.
    warned = _schedule_warnings(lambda: handler().train(regression_data(), epochs=3))
    assert len(warned) == 1 and "CosineAnnealingLR has T_max=2" in warned[0]
    assert "this run goes to 3 epochs" in warned[0]


def test_a_per_step_schedule_shorter_than_the_run_is_named() -> None:
    run = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        lambda opt: torch.optim.lr_scheduler.LinearLR(opt, total_iters=3),
        config={
            "loader": {"batch_size": 10},
            "trainer": {"progress_bar": False, "scheduler_interval": "step"},
        },
    )
    warned = _schedule_warnings(lambda: run.train(regression_data(), epochs=2))
    assert len(warned) == 1 and "total_iters=3" in warned[0]
    assert "goes to 8 optimizer steps" in warned[0]  # 40 samples / 10, 2 epochs


class _Counter:
    """A torchmetrics-style stateful metric: the number of samples it was updated with."""

    def __init__(self) -> None:
        self.seen = 0

    def update(self, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        self.seen += len(targets)

    def compute(self) -> float:
        return float(self.seen)

    def reset(self) -> None:
        self.seen = 0


class _ExtraValidation(Trainer):
    """An overridden validation_step that adds its own value and keeps metrics= updating."""

    def validation_step(self, batch: Any) -> dict[str, Any]:
        inputs, targets = batch
        outputs = self.forward(inputs)
        loss = self.compute_loss(outputs, targets)
        return {"loss": loss, "doubled": 2 * loss, **self.update_metrics(outputs, targets)}


class _ForgetsMetrics(Trainer):
    def validation_step(self, batch: Any) -> dict[str, Any]:
        inputs, targets = batch
        return {"loss": self.compute_loss(self.forward(inputs), targets)}


def test_metrics_keep_updating_when_validation_step_is_overridden() -> None:
    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={"trainer": {"progress_bar": False}},
        metrics={"accuracy": accuracy, "count": _Counter()},
        trainer_class=_ExtraValidation,
    )
    history = handler.train(regression_data(), regression_data(n=10), epochs=1)
    assert history["val_count"] == [10.0] and 0.0 <= history["val_accuracy"][0] <= 1.0
    assert history["val_doubled"][0] == pytest.approx(2 * history["val_loss"][0])
    handler.close()


def test_an_override_that_forgets_the_metrics_is_told_at_the_first_validation() -> None:
    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={"trainer": {"progress_bar": False}},
        metrics={"count": _Counter()},
        trainer_class=_ForgetsMetrics,
    )
    with pytest.raises(ConfigError, match=r"never called self\.update_metrics.*\['count'\]"):
        handler.evaluate(regression_data(n=10))
    handler.close()


class _TwoLosses(Trainer):
    """training_step returns the loss and two more scalars (a tensor and a float)."""

    def training_step(self, batch: Any) -> dict[str, Any]:
        inputs, targets = batch
        loss = self.compute_loss(self.forward(inputs), targets)
        return {"loss": loss, "doubled": 2 * loss, "size": float(len(targets)), "v": inputs[0]}


def test_every_scalar_training_step_returns_reaches_the_history() -> None:
    handler = NNHandler(
        mlp(),
        torch.optim.SGD(mlp().parameters(), lr=0.0),  # frozen: the losses are fixed
        nn.CrossEntropyLoss(),
        config={"loader": {"batch_size": 16, "shuffle": False}, "trainer": {"progress_bar": False}},
        trainer_class=_TwoLosses,
    )
    history = handler.train(regression_data(), epochs=1)  # batches of 16, 16, 8
    record = history.last
    assert record["train_doubled"] == pytest.approx(2 * record["train_loss"], rel=1e-9)
    assert record["train_size"] == pytest.approx((16 * 16 + 16 * 16 + 8 * 8) / 40)
    assert "train_v" not in record, "a non-scalar value is not logged"
    handler.close()


def test_a_monitor_on_an_extra_training_value_is_accepted() -> None:
    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={"trainer": {"progress_bar": False, "early_stopping": {"monitor": "train_doubled"}}},
        trainer_class=_TwoLosses,
    )
    assert len(handler.train(regression_data(), epochs=1)) == 1
    handler.close()


def test_the_progress_bar_shows_the_running_loss_from_the_first_batch(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A short epoch (5 batches, fewer than log_every_n_steps=50) still shows its loss."""
    from nn_handler.training import progress

    monkeypatch.setattr(progress, "is_terminal", lambda stream: True)
    config = {"loader": {"batch_size": 8}, "trainer": {"progress_bar": True}}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as handler:
        handler.train(regression_data(), epochs=1)
    shown = capsys.readouterr().err
    assert re.search(r"it/s, loss=[0-9.]+, samples_s=", shown), shown  # the bar's postfix


def test_training_without_epochs_says_it_trains_one(lines: list[str]) -> None:
    config = {"loader": {"batch_size": 8}, "trainer": {"progress_bar": False}}
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as handler:
        handler.train(regression_data())
        said = [line for line in lines if line.startswith("no epochs given")]
        assert said == [
            "no epochs given: training 1 epoch (trainer.epochs' default); pass "
            "train(..., epochs=N) or set trainer.epochs"
        ]
        handler.train(regression_data(), epochs=2)  # given: nothing to say
        assert len([line for line in lines if line.startswith("no epochs given")]) == 1
