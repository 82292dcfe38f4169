"""NNHandler and Trainer in real 2-rank gloo groups: DDP equivalence with one process, every
feature together, the NaN guard, subclasses and hooks, exact evaluation and prediction.

One spawned group runs every check (the group is the expensive part); the single-process
references are computed in the test process with the same code.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nn_handler import (
    ConfigError,
    DistributedContext,
    HandlerConfig,
    Hook,
    NNHandler,
    NonFiniteError,
    RankFailedError,
    Trainer,
    UnevenDataError,
    accuracy,
)
from nn_handler.distributed.communicator import torch_backend
from nn_handler.distributed.faults.watchdog import WATCHDOGS
from tests.harness import run_group
from tests.resume_helpers import TIMING_KEYS
from tests.training_helpers import max_difference, mlp, regression_data, sgd, state_of

pytestmark = pytest.mark.distributed

# Per-rank batch 4 on 2 ranks against batch 8 in one process; 40 samples = 5 batches per
# epoch per rank, so accumulation over 2 leaves a final window of 1 that must still sync.
EQUIVALENCE = {
    "loader": {"batch_size": 4, "shuffle": True, "seed": 3},
    "trainer": {"accumulate_grad_batches": 2, "progress_bar": False},
}


def _config(base: dict[str, Any], world_size: int, **trainer: Any) -> HandlerConfig:
    data = {key: dict(value) for key, value in base.items()}
    data["loader"]["batch_size"] = base["loader"]["batch_size"] * (2 // world_size)
    data["trainer"].update(trainer)
    return HandlerConfig.from_dict(data)


def equivalence_run(world_size: int, batchnorm: bool, context: Any = None) -> dict[str, Any]:
    config = _config(EQUIVALENCE, world_size, sync_batchnorm=batchnorm)
    handler = NNHandler(
        mlp(batchnorm=batchnorm), sgd, nn.CrossEntropyLoss(), config=config, context=context
    )
    handler.train(regression_data(), epochs=2)
    return state_of(handler.model)


class NaNOnRankOne(Trainer):
    """Rank 1 alone produces a NaN loss on its third batch of the first epoch."""

    def training_step(self, batch: Any) -> torch.Tensor:
        loss = super().training_step(batch)
        assert isinstance(loss, torch.Tensor)
        if self.comm.rank == 1 and self.state.epoch == 0 and self.state.batch_index == 2:
            return loss * float("nan")
        return loss


class TwoHeads(nn.Module):
    """A model with two outputs: class scores and a reconstruction."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(6, 16)
        self.classes = nn.Linear(16, 3)
        self.reconstruction = nn.Linear(16, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.tanh(self.body(x))
        return self.classes(hidden), self.reconstruction(hidden)


class TwoLossTrainer(Trainer):
    """The documented subclass: cross-entropy on one output plus reconstruction on the other."""

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        scores, rebuilt = self.forward(x)
        classification = nn.functional.cross_entropy(scores, y)
        reconstruction = nn.functional.mse_loss(rebuilt, x)
        return {"loss": classification + 0.5 * reconstruction, "ce": classification}

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        scores, rebuilt = self.forward(x)
        return {
            "loss": nn.functional.cross_entropy(scores, y),
            "reconstruction": nn.functional.mse_loss(rebuilt, x),
            "accuracy": accuracy(scores, y),
        }


class EventRecorder(Hook):
    def __init__(self) -> None:
        self.events: list[str] = []

    def before_train(self) -> None:
        self.events.append(f"before_train@{self.trainer.comm.rank}")

    def after_step(self) -> None:
        if self.trainer.state.step_synced:
            self.events.append(f"step{self.trainer.state.global_step}")

    def after_validation(self, metrics: dict[str, float]) -> None:
        self.events.append(f"val:{sorted(metrics)}")

    def after_train(self) -> None:
        self.events.append("after_train")


def _all_checks(rank: int, world_size: int) -> dict[str, Any]:
    context = DistributedContext().setup()
    out: dict[str, Any] = {}
    out["plain"] = equivalence_run(world_size, batchnorm=False, context=context)
    out["syncbn"] = equivalence_run(world_size, batchnorm=True, context=context)

    # Every feature together.
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 4},
            "precision": "bf16",
            "ema": {"enabled": True, "decay": 0.9, "warmup": True},
            "trainer": {
                "accumulate_grad_batches": 3,
                "gradient_clip_val": 0.5,
                "sync_batchnorm": True,
                "scheduler_interval": "step",
                "early_stopping": {"monitor": "val_loss", "patience": 2, "min_delta": 10.0},
                "progress_bar": rank == 0,
            },
        }
    )
    handler = NNHandler(
        mlp(batchnorm=True),
        lambda p: torch.optim.AdamW(p, lr=1e-2),
        nn.CrossEntropyLoss(),
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
        config=config,
        metrics={"accuracy": accuracy},
        context=context,
    )
    history = handler.train(regression_data(), regression_data(n=23, seed=1), epochs=6)
    assert handler.trainer.ema is not None
    out["features"] = {
        "records": history.records,
        "model": state_of(handler.model),
        "ema": state_of(handler.trainer.ema.module),
        "lr": handler.trainer.optimizer.param_groups[0]["lr"] if handler.trainer.optimizer else 0,
        "synced_bn": type(handler.model[1]).__name__,
    }

    # A NaN on rank 1 only: skipped on every rank, or raised on every rank.
    nan_config = HandlerConfig.from_dict({"loader": {"batch_size": 4}, "trainer": {"epochs": 2}})
    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config=nan_config,
        trainer_class=NaNOnRankOne,
        context=context,
    )
    history = handler.train(regression_data())
    out["nan_skip"] = {"skipped": history["skipped_steps"], "model": state_of(handler.model)}
    # The same with torch's fused SGD, which skips on the device (no host read: the flags are
    # read at the epoch's end), and with its device-side skip hidden (the host decides): the
    # same counts, the same bits for the weights and SyncBatchNorm's statistics on both ranks.
    synced = nan_config.model_copy(
        update={"trainer": nan_config.trainer.model_copy(update={"sync_batchnorm": True})}
    )
    for name, hide in (("nan_skip_on_device", False), ("nan_skip_on_host", True)):

        def fused(params: Any, hide: bool = hide) -> torch.optim.Optimizer:
            optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True)
            optimizer._step_supports_amp_scaling = not hide  # type: ignore[attr-defined]
            return optimizer

        torch.manual_seed(0)
        handler = NNHandler(
            mlp(batchnorm=True),
            fused,
            nn.CrossEntropyLoss(),
            config=synced,
            trainer_class=NaNOnRankOne,
            context=context,
        )
        history = handler.train(regression_data())
        out[name] = {
            "decided_on_device": handler.trainer.optimization.guard.on_device,
            "skipped": history["skipped_steps"],
            "train_loss": history["train_loss"],
            "model": state_of(handler.model),
        }
    raise_config = nan_config.model_copy(
        update={"trainer": nan_config.trainer.model_copy(update={"nonfinite": "raise"})}
    )
    handler = NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config=raise_config,
        trainer_class=NaNOnRankOne,
        context=context,
    )
    try:
        handler.train(regression_data())
        out["nan_raise"] = "no error"
    except NonFiniteError as error:
        out["nan_raise"] = str(error)
        out["nan_raise_steps"] = handler.trainer.state.global_step

    # A subclass with a two-output loss and a custom hook.
    recorder = EventRecorder()
    handler = NNHandler(
        TwoHeads(),
        sgd,
        config={"loader": {"batch_size": 5}, "trainer": {"progress_bar": False}},
        trainer_class=TwoLossTrainer,
        hooks=[recorder],
        context=context,
    )
    history = handler.train(regression_data(), regression_data(n=11, seed=2), epochs=2)
    out["subclass"] = {"events": recorder.events, "keys": history.keys()}

    # Exact evaluation and prediction over 23 samples (ranks hold 12 and 11).
    handler = NNHandler(
        mlp(seed=5),
        sgd,
        nn.CrossEntropyLoss(),
        config={"loader": {"batch_size": 5}},
        metrics={"accuracy": accuracy},
        context=context,
    )
    val = regression_data(n=23, seed=1)
    out["evaluate"] = handler.evaluate(val)
    out["predict"] = handler.predict(val)
    try:
        handler.predict(torch.utils.data.DataLoader(val, batch_size=5))
    except ConfigError as error:
        out["predict_plain_loader"] = str(error)

    out["reductions"] = _reduction_checks(context, val, rank)

    # Failures on one rank outside the step reach every rank instead of hanging the others.
    class FailsOnRankZero(Hook):
        def after_epoch(self) -> None:
            if self.trainer.comm.rank == 0:
                raise OSError("disk full while logging")

    class ValidationFailsOnRankOne(Trainer):
        def validation_step(self, batch: Any) -> Any:
            if self.comm.rank == 1:
                raise ValueError("bad validation batch")
            return super().validation_step(batch)

    class AfterValidationFailsOnRankOne(Hook):
        def __init__(self) -> None:
            self.after_epoch_calls = 0

        def after_validation(self, metrics: dict[str, float]) -> None:
            if self.trainer.comm.rank == 1:
                raise KeyError("no such tracker run")

        def after_epoch(self) -> None:
            self.after_epoch_calls += 1

    after_validation = AfterValidationFailsOnRankOne()
    failures = {
        "hook": dict(hooks=[FailsOnRankZero()]),
        "validation": dict(trainer_class=ValidationFailsOnRankOne),
        "after_validation": dict(hooks=[after_validation]),
    }
    for name, extra in failures.items():
        handler = NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            config={"loader": {"batch_size": 5}},
            context=context,
            **extra,  # type: ignore[arg-type]
        )
        try:
            handler.train(regression_data(), val, epochs=2)
            out[f"fail_{name}"] = "no error"
        except RankFailedError as error:
            out[f"fail_{name}"] = (error.failed_ranks, str(error))
    out["after_epoch_calls"] = after_validation.after_epoch_calls
    out.update(_several_validation_sets(context))
    out.update(_lr_finder(context))
    out.update(_time_limit(context, rank))
    context.teardown()
    return out


class _LateClock:
    """time.monotonic for rank 1 only: after its first reading (the fit's start), two hours
    later: its limit has passed at the first check, rank 0's has not."""

    def __init__(self) -> None:
        import time

        self.real, self.readings = time.monotonic, 0

    def monotonic(self) -> float:
        self.readings += 1
        return self.real() + (7200.0 if self.readings > 1 else 0.0)


def _time_limit(context: Any, rank: int) -> dict[str, Any]:
    """max_time (an hour) passed on rank 1 alone: both ranks stop at the first check step."""
    import time

    from nn_handler.training import time_limit

    trainer = {"progress_bar": False, "max_time": 3600, "log_every_n_steps": 2}
    config = {"loader": {"batch_size": 4}, "trainer": trainer}
    time_limit.time = _LateClock() if rank == 1 else time  # type: ignore[assignment]
    try:
        with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, context=context) as h:
            h.train(regression_data(), epochs=2)  # 5 steps per epoch at 2 ranks
            return {"time_stop": (h.trainer.state.global_step, h.history.last["partial_batches"])}
    finally:
        time_limit.time = time


def _lr_finder(context: Any) -> dict[str, Any]:
    """The LR finder under DDP: the curve (the same on both ranks: the losses averaged), and
    the weights and Adam's state after it, bit for bit those before."""
    from tests.unit.test_day_one_features import _optimizer_state, _same

    config = {"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}}
    adam = torch.optim.Adam
    with NNHandler(mlp(seed=5), adam, nn.CrossEntropyLoss(), config=config, context=context) as h:
        h.train(regression_data(), epochs=1)
        weights, optimizer = state_of(h.model), _optimizer_state(h)
        found = h.lr_find(regression_data(n=48, seed=3), min_lr=1e-4, max_lr=1.0, num_training=16)
        untouched = _same(state_of(h.model), weights) and _same(_optimizer_state(h), optimizer)
    return {"lr_curve": (found.lrs, found.losses), "lr_untouched": untouched}


SETS = {"a": regression_data(n=7, seed=1), "b": regression_data(n=12, seed=2)}


def _several_validation_sets(context: Any) -> dict[str, Any]:
    """Two validation sets by name (7 samples: the ranks run different batches), then as a
    list; early stopping watches one of them. Each set's record keys, and each set evaluated
    alone with the same weights."""
    out: dict[str, Any] = {}
    trainer = {"progress_bar": False, "early_stopping": {"monitor": "val_loss/b", "patience": 9}}
    with NNHandler(
        mlp(seed=5),
        sgd,
        nn.CrossEntropyLoss(),
        config={"loader": {"batch_size": 4}, "trainer": trainer},
        context=context,
        metrics={"accuracy": accuracy},
    ) as h:
        h.train(regression_data(), SETS, epochs=1)
        out["sets_record"] = h.history.last
        out["sets_alone"] = {name: h.evaluate(data) for name, data in SETS.items()}
        with pytest.raises(ConfigError, match=r"monitors 'val_loss/b'.*val_loss/dataloader_idx_1"):
            h.train(regression_data(), list(SETS.values()), epochs=2)  # the names changed
    return out


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "gather")


@contextlib.contextmanager
def _counting_collectives() -> Iterator[collections.Counter[str]]:
    """Count the torch.distributed collectives issued from Python (DDP's gradient buckets
    go through its C++ reducer and are not counted)."""
    counts: collections.Counter[str] = collections.Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return originals[name](*args, **kwargs)

        return call

    gather = torch_backend._all_gather_single  # bound when the backend was imported

    def counting_gather(*args: Any, **kwargs: Any) -> Any:
        counts["all_gather"] += 1
        return gather(*args, **kwargs)

    for name in COLLECTIVES:
        setattr(dist, name, counting(name))
    torch_backend._all_gather_single = counting_gather
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        torch_backend._all_gather_single = gather


class ExtraKeyOnRankOne(Trainer):
    """From its second validation on, rank 1 alone reports one more value."""

    def validation_step(self, batch: Any) -> Any:
        values = dict(super().validation_step(batch))
        if self.comm.rank == 1 and self.state.epoch >= 1:
            values["only_rank_one"] = torch.tensor(2.0)
        return values


def _reduction_checks(context: Any, val: Any, rank: int) -> dict[str, Any]:
    """How many collectives evaluation and an epoch's end take in a real group, and the
    metrics when the ranks' key sets differ."""
    out: dict[str, Any] = {}

    def classifier(**extra: Any) -> NNHandler:
        return NNHandler(
            mlp(seed=5),
            sgd,
            nn.CrossEntropyLoss(),
            # Without the throughput monitor: it times DDP's reductions through a Python
            # communication hook, whose dist.all_reduce calls this count would see (its own
            # collective per epoch is pinned in test_strategy.py).
            config={
                "loader": {"batch_size": 5},
                "trainer": {"progress_bar": False},
                "logging": {"monitor": False},
            },
            metrics={"accuracy": accuracy},
            context=context,
            **extra,
        )

    handler = classifier(trainer_class=ExtraKeyOnRankOne)
    for call in ("cold", "warm"):
        with _counting_collectives() as counts:
            out[f"evaluate_{call}"] = handler.evaluate(val)
        out[f"evaluate_{call}_collectives"] = dict(counts)
    train = regression_data()
    per_epochs = {}
    ledger = WATCHDOGS.ledger()  # the stall watchdog is on: the counts hold with it
    out["watched"] = ledger is not None and handler.communicator.watching
    numbered = {}
    # train() continues a run: the first call trains epoch 1, the second epochs 2 and 3, so
    # their difference is what one epoch costs.
    for epochs in (1, 3):
        before = ledger.seq if ledger is not None else 0
        with _counting_collectives() as counts:
            handler.train(train, epochs=epochs)
        per_epochs[epochs] = counts
        numbered[epochs] = (ledger.seq if ledger is not None else 0) - before
    out["epoch_collectives"] = dict(per_epochs[3] - per_epochs[1])
    out["epoch_records"] = numbered[3] - numbered[1]
    handler.trainer.state.epoch = 1  # rank 1 now reports a key rank 0 never saw
    out["evaluate_new_key"] = handler.evaluate(val)
    # One sample on two ranks: rank 1 has no validation batch at all, twice.
    one = torch.utils.data.TensorDataset(val.tensors[0][:1], val.tensors[1][:1])
    out["evaluate_one_sample"] = [handler.evaluate(one) for _ in range(2)]
    # train_epoch called alone (not through fit) exchanges the loaders' lengths itself.
    uneven = torch.utils.data.DataLoader(regression_data(n=8 + 4 * rank), batch_size=4)
    try:
        handler.trainer.train_epoch(uneven, 1)
        out["uneven_alone"] = "no error"
    except UnevenDataError as error:
        out["uneven_alone"] = str(error)
    handler.close()
    # A fresh trainer's first validation, rank 1 without a batch: the key hashes differ, so
    # the names are gathered (the one object gather).
    fresh = classifier()
    with _counting_collectives() as counts:
        out["evaluate_one_sample_first"] = fresh.evaluate(one)
    out["evaluate_one_sample_first_collectives"] = dict(counts)
    fresh.close()
    return out


def _without_timing(records: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in record.items() if k not in TIMING_KEYS} for record in records]


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_group(_all_checks, 2, init="env", timeout=150)


def test_two_ranks_with_batch_b_match_one_process_with_batch_2b(
    results: list[dict[str, Any]],
) -> None:
    reference = equivalence_run(1, batchnorm=False)
    for rank in (0, 1):
        assert max_difference(results[rank]["plain"], reference) < 1e-5, f"rank {rank}"


def test_synchronised_batchnorm_on_cpu_matches_one_process_with_the_whole_batch(
    results: list[dict[str, Any]],
) -> None:
    reference = equivalence_run(1, batchnorm=True)  # running stats included
    assert "1.running_mean" in reference
    for rank in (0, 1):
        assert max_difference(results[rank]["syncbn"], reference) < 1e-5, f"rank {rank}"


def test_every_feature_together_keeps_the_ranks_identical(
    results: list[dict[str, Any]],
) -> None:
    zero, one = results[0]["features"], results[1]["features"]
    assert _without_timing(zero["records"]) == _without_timing(one["records"])
    # min_delta=10 never counts as improvement after the first epoch: stop after 1 + 2.
    assert len(zero["records"]) == 3
    assert max_difference(zero["model"], one["model"]) == 0.0
    assert max_difference(zero["ema"], one["ema"]) == 0.0, "EMA diverged across ranks"
    assert max_difference(zero["ema"], zero["model"]) > 0.0, "EMA is not averaging"
    assert all(torch.isfinite(v.double()).all() for v in zero["model"].values())
    assert zero["synced_bn"] == "SyncBatchNorm"
    # 20 samples per rank / batch 4 = 5 batches, windows 3+2 = 2 steps per epoch, 6 steps:
    # StepLR(step_size=2, gamma=0.5) halved the rate 3 times.
    assert zero["lr"] == pytest.approx(1e-2 / 8)
    assert {"train_loss", "val_loss", "val_accuracy", "lr"} <= zero["records"][0].keys()


def test_a_nan_on_one_rank_is_skipped_by_every_rank(results: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        assert results[rank]["nan_skip"]["skipped"] == [1.0, 0.0], f"rank {rank}"
    zero, one = results[0]["nan_skip"]["model"], results[1]["nan_skip"]["model"]
    assert max_difference(zero, one) == 0.0
    assert all(torch.isfinite(v).all() for v in zero.values())


def test_a_fused_optimizer_skips_the_nan_step_on_the_device_as_the_host_would(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        device, host = results[rank]["nan_skip_on_device"], results[rank]["nan_skip_on_host"]
        assert device["decided_on_device"] and not host["decided_on_device"], f"rank {rank}"
        assert device["skipped"] == host["skipped"] == [1.0, 0.0], f"rank {rank}"
        assert device["train_loss"] == host["train_loss"], f"rank {rank}"
        assert max_difference(device["model"], host["model"]) == 0.0, f"rank {rank}"
    zero, one = (results[rank]["nan_skip_on_device"]["model"] for rank in (0, 1))
    assert max_difference(zero, one) == 0.0
    assert all(torch.isfinite(v.double()).all() for v in zero.values())


def test_a_nan_on_one_rank_raises_on_every_rank_when_configured(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        assert "NaN/inf" in results[rank]["nan_raise"], f"rank {rank}"
        assert results[rank]["nan_raise_steps"] == 2  # stopped at the third step, on both


def test_a_subclass_and_a_custom_hook_run_on_both_ranks(results: list[dict[str, Any]]) -> None:
    for rank in (0, 1):
        events = results[rank]["subclass"]["events"]
        assert events[0] == f"before_train@{rank}" and events[-1] == "after_train"
        # 20 samples per rank, batch 5: 4 steps per epoch.
        assert [e for e in events if e.startswith("step")] == [f"step{i}" for i in range(1, 9)]
        assert events.count("val:['accuracy', 'loss', 'reconstruction']") == 2
        assert "val_reconstruction" in results[rank]["subclass"]["keys"]


def test_evaluation_and_prediction_are_exact_and_in_dataset_order(
    results: list[dict[str, Any]],
) -> None:
    model = mlp(seed=5)
    val = regression_data(n=23, seed=1)
    x, y = val.tensors
    with torch.no_grad():
        logits = model(x)
    expected_loss = float(nn.functional.cross_entropy(logits, y))
    expected_accuracy = float(accuracy(logits, y))
    for rank in (0, 1):
        metrics = results[rank]["evaluate"]
        assert metrics["loss"] == pytest.approx(expected_loss, abs=1e-6)
        assert metrics["accuracy"] == pytest.approx(expected_accuracy, abs=1e-6)
        assert torch.allclose(results[rank]["predict"], logits, atol=1e-6)


def test_max_time_passed_on_one_rank_stops_both_at_the_same_step(
    results: list[dict[str, Any]],
) -> None:
    assert results[0]["time_stop"] == results[1]["time_stop"] == (2, 2.0)


def test_the_lr_finder_at_two_ranks_agrees_and_puts_everything_back(
    results: list[dict[str, Any]],
) -> None:
    assert results[0]["lr_untouched"] and results[1]["lr_untouched"]
    assert results[0]["lr_curve"] == results[1]["lr_curve"]
    assert len(results[0]["lr_curve"][0]) >= 2


def test_several_validation_sets_are_each_exact_and_named(results: list[dict[str, Any]]) -> None:
    for seen in results:
        record, alone = seen["sets_record"], seen["sets_alone"]
        for name in SETS:
            assert record[f"val_loss/{name}"] == alone[name]["loss"]
            assert record[f"val_accuracy/{name}"] == alone[name]["accuracy"]
        assert "val_loss" not in record
    assert results[0]["sets_record"]["val_loss/a"] == results[1]["sets_record"]["val_loss/a"]


def test_a_hook_or_validation_failing_on_one_rank_fails_every_rank(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        failed, text = results[rank]["fail_hook"]
        assert failed == [0] and "after_epoch hooks" in text and "disk full" in text
        failed, text = results[rank]["fail_validation"]
        assert failed == [1] and "validation loop" in text and "bad validation batch" in text
        # An after_validation hook inside fit agrees with the after_epoch hooks, in one
        # exchange: rank 1's failure stops both ranks after the first epoch; rank 1 skips its
        # after_epoch hooks, rank 0 ran its own before learning of it.
        failed, text = results[rank]["fail_after_validation"]
        assert failed == [1] and "after_validation hooks" in text and "no such tracker" in text
        assert results[rank]["after_epoch_calls"] == (1 if rank == 0 else 0)


def test_predict_with_several_ranks_asks_for_an_evaluation_loader(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        assert "LoaderFactory.eval_loader" in results[rank]["predict_plain_loader"]


def test_validation_and_an_epoch_take_a_fixed_number_of_collectives(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        checks = results[rank]["reductions"]
        # The first validation agrees on its keys by hashing them (one more small all_reduce);
        # later ones send metrics and the failure flag in one all_reduce, and the
        # after_validation hooks' agreement is one tiny all_gather.
        assert checks["evaluate_cold_collectives"] == {"all_reduce": 2, "all_gather": 1}
        assert checks["evaluate_warm_collectives"] == {"all_reduce": 1, "all_gather": 1}
        # An epoch: the before_epoch hooks' agreement carrying the loaders' lengths (one tiny
        # all_gather), the train loss (one all_reduce), the after_epoch hooks' agreement
        # carrying rank 0's stop decision (one all_gather).
        assert checks["epoch_collectives"] == {"all_gather": 2, "all_reduce": 1}
        assert checks["evaluate_cold"] == checks["evaluate_warm"]
        # ... with the stall watchdog on, which adds none (it talks through the store). It
        # numbers them all: per epoch the three above and the 4 training steps (DDP's
        # reductions, one record per step).
        assert checks["watched"]
        assert checks["epoch_records"] == 3 + 4, checks["epoch_records"]


def test_metrics_are_exact_when_the_ranks_report_different_keys(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        checks = results[rank]["reductions"]
        new = checks["evaluate_new_key"]
        assert sorted(new) == ["accuracy", "loss", "only_rank_one"]
        assert new["only_rank_one"] == 2.0  # rank 1's samples only
        assert new == results[0]["reductions"]["evaluate_new_key"]
        # A rank without any batch: the metrics are rank 0's, the same on both ranks.
        trained = checks["evaluate_one_sample"]
        assert trained[0] == trained[1] and sorted(trained[0]) == ["accuracy", "loss"]
        assert trained[0] == results[0]["reductions"]["evaluate_one_sample"][0]
        # A fresh trainer, whose first validation had to gather the names: exact all the same.
        model = mlp(seed=5)
        x, y = regression_data(n=23, seed=1).tensors
        with torch.no_grad():
            logits = model(x[:1])
        first_metrics = checks["evaluate_one_sample_first"]
        assert sorted(first_metrics) == ["accuracy", "loss"]
        assert first_metrics["loss"] == pytest.approx(
            float(nn.functional.cross_entropy(logits, y[:1])), abs=1e-6
        )
        assert first_metrics["accuracy"] == float(accuracy(logits, y[:1]))
        first = checks["evaluate_one_sample_first_collectives"]
        assert first["all_reduce"] == 2 and first["all_gather"] > 1  # hash, names, values
        assert "rank 0: 2, rank 1: 3" in checks["uneven_alone"]
