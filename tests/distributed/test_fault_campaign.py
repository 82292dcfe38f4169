"""What a fault-injection campaign broke, each pinned in one real 2-rank gloo group.

One spawned group runs every check in turn (the group is the expensive part) and the checks
that end in an agreed error leave the group usable for the next: a NaN batch must not poison
BatchNorm statistics, a run of NaN steps must stop, skipped steps must not count in the loss,
NNHandler.load must not rotate away the run it loaded from, uneven user loaders must raise
(not abort), predict must work with a rank that holds no sample, and an object that fails to
unpickle on one receiver must raise on every rank.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from nn_handler import (
    CheckpointError,
    DistributedContext,
    HandlerConfig,
    Hook,
    NNHandler,
    NonFiniteError,
    RankFailedError,
    Trainer,
    UnevenDataError,
)
from nn_handler.checkpoint import load_file
from tests.harness import run_group
from tests.tamper import record_spans
from tests.training_helpers import mlp, regression_data, sgd

pytestmark = pytest.mark.distributed

NAN_BATCH = 1  # the batch (of the first epoch) whose inputs are NaN on rank 0


class NaNInputsOnRankZero(Trainer):
    """Rank 0's inputs are NaN on batch NAN_BATCH of the first epoch (a corrupt sample)."""

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        inputs, targets = super().split_batch(batch)
        state = self.state
        if self.comm.rank == 0 and state.epoch == 0 and state.batch_index == NAN_BATCH:
            inputs = inputs * float("nan")
        return inputs, targets


class BuffersAroundStep(Hook):
    """The buffers just before and just after batch NAN_BATCH of the first epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.before: dict[str, torch.Tensor] = {}
        self.after: dict[str, torch.Tensor] = {}

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.trainer.module.named_buffers()}

    def before_step(self) -> None:
        if self.trainer.state.epoch == 0 and self.trainer.state.batch_index == NAN_BATCH:
            self.before = self._buffers()

    def after_step(self) -> None:
        if self.trainer.state.epoch == 0 and self.trainer.state.batch_index == NAN_BATCH:
            self.after = self._buffers()


def _batchnorm_check(context: Any, sync: bool) -> dict[str, Any]:
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 4, "shuffle": False},
            "trainer": {"sync_batchnorm": sync, "progress_bar": False},
        }
    )
    hook = BuffersAroundStep()
    with NNHandler(
        mlp(batchnorm=True),
        sgd,
        nn.CrossEntropyLoss(),
        config=config,
        context=context,
        hooks=[hook],
        trainer_class=NaNInputsOnRankZero,
    ) as handler:
        history = handler.train(regression_data(), regression_data(n=10, seed=1), epochs=2)
        buffers = dict(handler.model.named_buffers())
        return {
            "skipped": history["skipped_steps"],
            "unchanged": all(torch.equal(hook.before[k], hook.after[k]) for k in hook.before),
            "finite": all(bool(torch.isfinite(b.float()).all()) for b in buffers.values()),
            "val_loss": history["val_loss"],
        }


class NaNOnRankOne(Trainer):
    """Rank 1's loss is NaN on every batch whose index is in ``bad`` (all when None)."""

    bad: ClassVar[set[int] | None] = None

    def training_step(self, batch: Any) -> torch.Tensor:
        loss = super().training_step(batch)
        assert isinstance(loss, torch.Tensor)
        index = self.state.batch_index
        if self.comm.rank == 1 and (self.bad is None or index in self.bad):
            return loss * float("nan")
        return loss


class Losses(Hook):
    def __init__(self) -> None:
        super().__init__()
        self.losses: list[float] = []

    def after_step(self) -> None:
        assert self.trainer.state.last_loss is not None
        self.losses.append(float(self.trainer.state.last_loss))


def _skipped_loss_check(context: Any) -> dict[str, Any]:
    """Odd batches NaN on rank 1: skipped on both ranks, and out of the reported loss."""

    class OddBatches(NaNOnRankOne):
        bad: ClassVar[set[int] | None] = {1, 3}

    hook = Losses()
    config = {"loader": {"batch_size": 4, "shuffle": False}, "trainer": {"progress_bar": False}}
    with NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config=config,
        context=context,
        hooks=[hook],
        trainer_class=OddBatches,
    ) as handler:
        history = handler.train(regression_data(), epochs=1)
        gathered = handler.communicator.all_gather_object(hook.losses)
    kept = [loss for losses in gathered for i, loss in enumerate(losses) if i not in {1, 3}]
    return {
        "skipped": history["skipped_steps"],
        "train_loss": history["train_loss"][0],
        "expected": sum(kept) / len(kept),
    }


def _diverged_check(context: Any) -> dict[str, Any]:
    """NaN on every step of rank 1: every rank raises after max_consecutive_skipped_steps."""
    config = {
        "loader": {"batch_size": 2},
        "trainer": {"progress_bar": False, "max_consecutive_skipped_steps": 3},
    }
    with NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config=config,
        context=context,
        trainer_class=NaNOnRankOne,
    ) as handler:
        try:
            handler.train(regression_data(), epochs=3)
        except NonFiniteError as error:
            return {"error": str(error), "step": handler.trainer.state.global_step}
        return {"error": None}


def _digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.iterdir())
        if p.is_file()
    }


def _load_rotation_check(rank: int, folder: Path, context: Any) -> dict[str, Any]:
    """A handler loaded from a run's checkpoint trains without touching that run's files."""
    config = {
        "loader": {"batch_size": 4},
        "trainer": {"progress_bar": False},
        "checkpoint": {"dir": str(folder), "keep_last": 1, "save_best": True},
    }
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, context=context) as h:
        h.train(regression_data(), regression_data(n=8, seed=1), epochs=2)
    dist.barrier()
    before = _digest(folder)
    latest = folder / "ckpt-e0002-s00000010.pt"
    with NNHandler.load(latest, mlp(seed=3), sgd, nn.CrossEntropyLoss(), context=context) as h:
        h.train(regression_data(), epochs=4)
        steps = h.trainer.state.global_step
    dist.barrier()
    return {"before": before, "after": _digest(folder), "steps": steps}


def flip_tensor_byte(path: Path, record_suffix: str = "data/0") -> None:
    """Flip one byte inside a tensor record of a torch zip file (its CRC-32 no longer holds)."""
    spans = record_spans(path)
    start, size = next(span for name, span in spans.items() if name.endswith(record_suffix))
    data = bytearray(path.read_bytes())
    data[start + size // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_checkpoint_check(rank: int, folder: Path, context: Any) -> dict[str, Any]:
    """The newest checkpoint's tensor bytes flip on disk: loading it names the entry, and
    resume('latest') falls back to the previous one on every rank."""
    config = {
        "loader": {"batch_size": 4},
        "trainer": {"progress_bar": False},
        "checkpoint": {"dir": str(folder), "keep_last": 2, "resume": "never"},
    }
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, context=context) as h:
        h.train(regression_data(), epochs=2)
    newest = folder / "ckpt-e0002-s00000010.pt"
    if rank == 0:
        flip_tensor_byte(newest)
    dist.barrier()
    out: dict[str, Any] = {}
    try:
        load_file(newest)
        out["load"] = "no error"
    except CheckpointError as error:
        out["load"] = str(error)
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, context=context) as h:
        out["resumed_from"] = Path(str(h.resume("latest"))).name
        out["epoch"] = h.trainer.state.epoch
    return out


def _uneven_loaders_check(rank: int, context: Any) -> str:
    data = regression_data(n=40 if rank == 0 else 8)
    loader = DataLoader(data, batch_size=4)
    with NNHandler(
        mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": {"progress_bar": False}},
        context=context,
    ) as handler:  # fmt: skip
        try:
            handler.train(loader, epochs=1)
        except UnevenDataError as error:
            return str(error)
    return "no error"


def _predict_with_an_empty_rank(context: Any) -> tuple[int, ...]:
    with NNHandler(mlp(), context=context) as handler:
        return tuple(handler.predict(regression_data(n=1)).shape)


def _explode_on_rank_zero(value: int) -> int:
    if dist.get_rank() == 0:
        raise ValueError("this object cannot be rebuilt on rank 0")
    return value


class RankZeroCannotUnpickle:
    def __reduce__(self) -> tuple[Any, ...]:
        return (_explode_on_rank_zero, (7,))


def _unpickling_checks(rank: int, context: Any) -> dict[str, Any]:
    comm = context.communicator
    payload = RankZeroCannotUnpickle() if rank == 1 else 1
    out: dict[str, Any] = {}
    calls = {
        "all_gather_object": lambda: comm.all_gather_object(payload),
        "gather_object": lambda: comm.gather_object(payload, dst=0),
        "broadcast_object": lambda: comm.broadcast_object(payload, src=1),
    }
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except RankFailedError as error:
            out[name] = (error.failed_ranks, str(error))
    out["usable_after"] = float(comm.all_reduce(torch.ones(1))[0])
    return out


def _all_checks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    context = DistributedContext().setup()
    out: dict[str, Any] = {}
    out["bn_sync"] = _batchnorm_check(context, sync=True)
    out["bn_local"] = _batchnorm_check(context, sync=False)
    out["skipped_loss"] = _skipped_loss_check(context)
    out["diverged"] = _diverged_check(context)
    out["load"] = _load_rotation_check(rank, Path(folder) / "load", context)
    out["corrupt"] = _corrupt_checkpoint_check(rank, Path(folder) / "corrupt", context)
    out["uneven"] = _uneven_loaders_check(rank, context)
    out["predict_shape"] = _predict_with_an_empty_rank(context)
    out["unpickling"] = _unpickling_checks(rank, context)
    context.teardown()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("campaign")
    return run_group(_all_checks, 2, args=(str(folder),), init="env", timeout=150)


@pytest.mark.parametrize("mode", ["bn_sync", "bn_local"])
def test_a_nan_batch_leaves_batchnorm_statistics_as_they_were(
    results: list[dict[str, Any]], mode: str
) -> None:
    for rank in (0, 1):
        check = results[rank][mode]
        assert check["skipped"] == [1.0, 0.0], f"rank {rank}"
        assert check["unchanged"], f"rank {rank}: the skipped step changed the buffers"
        assert check["finite"], f"rank {rank}: NaN running statistics"
        assert all(v == v for v in check["val_loss"]), f"rank {rank}: NaN validation"


def test_skipped_steps_are_counted_and_left_out_of_the_train_loss(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        check = results[rank]["skipped_loss"]
        assert check["skipped"] == [2.0], f"rank {rank}"
        assert check["train_loss"] == pytest.approx(check["expected"], rel=1e-6), f"rank {rank}"


def test_nan_on_every_step_raises_on_every_rank_after_the_bound(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        check = results[rank]["diverged"]
        assert check["error"] is not None, f"rank {rank}: a diverged run went on silently"
        assert "3 optimizer steps in a row" in check["error"]
        assert "max_consecutive_skipped_steps" in check["error"]
        assert check["step"] == 2, f"rank {rank}"  # raised within the third step, as "raise"


def test_a_loaded_handler_leaves_the_original_runs_checkpoints_alone(
    results: list[dict[str, Any]],
) -> None:
    check = results[0]["load"]
    assert "ckpt-e0002-s00000010.pt" in check["before"] and "best.pt" in check["before"]
    assert check["after"] == check["before"]
    assert results[0]["load"]["steps"] == results[1]["load"]["steps"] == 20


def test_a_checkpoint_with_flipped_bytes_is_refused_and_latest_falls_back(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        check = results[rank]["corrupt"]
        assert "ckpt-e0002-s00000010.pt is corrupt" in check["load"], check["load"]
        assert "entry 'model." in check["load"] and "CRC-32" in check["load"]
        assert check["resumed_from"] == "ckpt-e0001-s00000005.pt", f"rank {rank}"
        assert check["epoch"] == 1


def test_uneven_user_loaders_raise_on_every_rank_naming_each_length(
    results: list[dict[str, Any]],
) -> None:
    for rank in (0, 1):
        message = results[rank]["uneven"]
        assert "rank 0: 10, rank 1: 2" in message, message
        assert "DistributedSampler" in message


def test_predict_with_a_rank_that_holds_no_sample(results: list[dict[str, Any]]) -> None:
    assert results[0]["predict_shape"] == results[1]["predict_shape"] == (1, 3)


@pytest.mark.parametrize("call", ["all_gather_object", "gather_object", "broadcast_object"])
def test_an_object_that_fails_to_unpickle_on_one_rank_raises_on_every_rank(
    results: list[dict[str, Any]], call: str
) -> None:
    for rank in (0, 1):
        outcome = results[rank]["unpickling"][call]
        assert outcome != "no error", f"rank {rank}: {call} did not raise"
        failed, message = outcome
        assert failed == [0], message
        assert "cannot be rebuilt on rank 0" in message
        assert results[rank]["unpickling"]["usable_after"] == 2.0
