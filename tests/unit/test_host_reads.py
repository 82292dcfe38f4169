"""How often the loop reads the device from the host, step by step: a steady-state step reads
nothing when the optimizer skips on the device (torch's fused optimizers), and the host reads
the non-finite guard's verdicts only at log steps; a plain optimizer costs the guard's one read
per optimizer step (docs/training.md). On a GPU each such read stops the CPU from queueing the
next kernels; here, on the CPU, they are counted as Python sees them (a TorchFunctionMode
over Tensor.item/tolist/__bool__/__float__/__int__/numpy), per batch.

The CUDA counterpart (torch.cuda.set_sync_debug_mode) is tests/unit/test_gpu_step.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from nn_handler import Hook, NNHandler
from tests.training_helpers import mlp, regression_data

READS = {
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__bool__,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.numpy,
}
BATCHES = 120  # batch size 2: 120 batches an epoch; log steps after batches 50 and 100
LOG_BATCHES = {49, 99}  # the 0-based indices of the batches that end a log step


class HostReads(TorchFunctionMode):
    """Counts host reads by the batch the loop is at. Not counted: the ``step`` tensors of a
    non-fused optimizer, which torch keeps on the host on every device (reading them waits for
    no kernel)."""

    def __init__(self) -> None:
        super().__init__()
        self.by_batch: Counter[int] = Counter()
        self.batch = -1
        self.host_steps: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in READS and args and id(args[0]) not in self.host_steps:
            self.by_batch[self.batch] += 1
        return func(*args, **(kwargs or {}))


class Counting(Hook):
    """Counts from the first batch's ``before_step`` to the end of ``fit``, per batch."""

    def __init__(self) -> None:
        self.reads = HostReads()

    def before_step(self) -> None:
        trainer = self.trainer
        if self.reads.batch < 0:
            self.reads.__enter__()
        self.reads.batch = trainer.state.batch_index
        optimizer = trainer.optimizer
        if optimizer is not None:  # its step tensors exist from the first step on
            states = optimizer.state.values()
            self.reads.host_steps = {id(s["step"]) for s in states if "step" in s}

    def after_train(self) -> None:
        if self.reads.batch >= 0:
            self.reads.__exit__(None, None, None)


def _reads(
    optimizer: Callable[[Any], torch.optim.Optimizer],
    batchnorm: bool = False,
    scheduler: Any = None,
    **config: Any,
) -> Counter[int]:
    """Host reads per batch index over one epoch of 120 batches (the default
    log_every_n_steps, 50; no progress bar, as on every rank but the first)."""
    hook = Counting()
    trainer = {"progress_bar": False, **config.pop("trainer", {})}
    accumulate = trainer.get("accumulate_grad_batches", 1)
    handler = NNHandler(
        mlp(batchnorm=batchnorm),
        optimizer,
        nn.CrossEntropyLoss(),
        scheduler,
        hooks=[hook],
        config={"loader": {"batch_size": 2}, "trainer": trainer, **config},
    )
    handler.train(regression_data(n=2 * BATCHES))
    assert handler.trainer.state.global_step == BATCHES // accumulate
    return hook.reads.by_batch


def _steady(reads: Counter[int]) -> dict[int, int]:
    """The reads of batches 5 to 118 (the first ones build the optimizer's state and count
    the FLOPs; the last one ends the epoch, which reads its loss)."""
    return {batch: reads[batch] for batch in range(5, BATCHES - 1)}


def fused_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9, fused=True)


def fused_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, fused=True)


def plain_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.01, momentum=0.9)


def plain_adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def one_cycle(optimizer: torch.optim.Optimizer, total: int) -> Any:
    return torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.05, total_steps=total)


FUSED_CONFIGURATIONS: dict[str, tuple[Any, dict[str, Any]]] = {
    "fused SGD": (fused_sgd, {}),
    "fused AdamW": (fused_adamw, {}),
    "fused AdamW, EMA and bf16": (fused_adamw, {"ema": {"enabled": True}, "precision": "bf16"}),
    "fused SGD, clipping": (fused_sgd, {"trainer": {"gradient_clip_val": 1.0}}),
    "fused AdamW, accumulation": (fused_adamw, {"trainer": {"accumulate_grad_batches": 2}}),
    "fused SGD, BatchNorm": (fused_sgd, {"batchnorm": True}),
    "fused SGD, a per-step OneCycleLR": (
        fused_sgd,
        {"scheduler": one_cycle, "trainer": {"scheduler_interval": "step"}},
    ),
}


@pytest.mark.parametrize("name", list(FUSED_CONFIGURATIONS))
def test_a_steady_state_step_reads_nothing_with_an_optimizer_that_skips_on_the_device(
    name: str,
) -> None:
    optimizer, config = FUSED_CONFIGURATIONS[name]
    reads = _reads(optimizer, **config)
    steady = _steady(reads)
    between_logs = {b: n for b, n in steady.items() if b not in LOG_BATCHES}
    assert set(between_logs.values()) == {0}, f"{name}: host reads per batch {dict(reads)}"
    # The guard's verdicts of the 50 steps since the last log step: read at once (so the
    # counter does see a read, and the steps between cost none).
    assert [steady[b] for b in sorted(LOG_BATCHES)] == [1, 1], f"{name}: {dict(reads)}"


@pytest.mark.parametrize("optimizer", [plain_sgd, plain_adamw], ids=["SGD", "AdamW"])
def test_a_plain_optimizer_costs_the_guard_one_read_per_optimizer_step(
    optimizer: Callable[[Any], torch.optim.Optimizer],
) -> None:
    for accumulate in (1, 2):
        reads = _reads(optimizer, trainer={"accumulate_grad_batches": accumulate})
        expected = {b: int((b + 1) % accumulate == 0) for b in range(5, BATCHES - 1)}
        assert _steady(reads) == expected, f"accumulate {accumulate}: {dict(reads)}"


def test_raise_and_off_decide_on_the_host_and_not_at_all() -> None:
    # 'raise' stops at the step that was NaN: one read per step, whatever the optimizer.
    raising = _steady(_reads(fused_sgd, trainer={"nonfinite": "raise"}))
    assert set(raising.values()) == {1}, raising
    off = _steady(_reads(plain_sgd, trainer={"nonfinite": "off"}))
    assert set(off.values()) == {0}, off


# ----------------------------------------------------------------- the same decisions
class HostDecided(torch.optim.SGD):
    """torch's fused SGD with its device-side skip hidden: the guard decides on the host."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.05, momentum=0.9, fused=True)
        self._step_supports_amp_scaling = False


class PoisonedBatches(torch.utils.data.Dataset[Any]):
    """regression_data with NaN features in the given batches (of 4, unshuffled)."""

    def __init__(self, batches: set[int], n: int = 80) -> None:
        self.data = regression_data(n=n)
        self.bad = batches

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        features, label = self.data[index]
        if index // 4 in self.bad:
            features = torch.full_like(features, float("nan"))
        return features, label


def _run_with_nan(optimizer: Any, bad: set[int], **trainer: Any) -> NNHandler:
    handler = NNHandler(
        mlp(batchnorm=True),
        optimizer,
        nn.CrossEntropyLoss(),
        lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5),
        config={
            "loader": {"batch_size": 4, "shuffle": False},
            "ema": {"enabled": True},
            "trainer": {
                "progress_bar": False,
                "scheduler_interval": "step",
                "log_every_n_steps": 7,
                **trainer,
            },
        },
    )
    handler.train(PoisonedBatches(bad), epochs=2)
    return handler


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_device_decides_as_the_host_does(accumulate: int) -> None:
    # NaN batches 3 and 11 (steps in the first log window and the second), in both epochs:
    # the weights, BatchNorm statistics, EMA, schedule, counts and losses come out the same,
    # bit for bit, whether the fused optimizer skips on the device or the host decides.
    bad = {3, 11}
    on_device = _run_with_nan(fused_sgd_05, bad, accumulate_grad_batches=accumulate)
    on_host = _run_with_nan(HostDecided, bad, accumulate_grad_batches=accumulate)
    assert on_device.trainer.optimization.guard.on_device
    assert not on_host.trainer.optimization.guard.on_device
    assert on_device.history["skipped_steps"] == on_host.history["skipped_steps"] == [2.0, 2.0]
    assert on_device.history["train_loss"] == on_host.history["train_loss"]
    assert on_device.history["lr"] == on_host.history["lr"]
    for name, (a, b) in {
        "model": (on_device.model, on_host.model),
        "ema": (on_device.trainer.ema.module, on_host.trainer.ema.module),  # type: ignore[union-attr]
    }.items():
        for (key, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
            assert torch.equal(x, y), f"{name}.{key}"
            assert torch.isfinite(x.double()).all(), f"{name}.{key}"


def fused_sgd_05(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)


def test_a_run_that_diverged_stops_at_the_next_log_step_naming_the_step() -> None:
    # Every batch from the fifth on is NaN: the tenth skipped step in a row is optimizer step
    # 14; the device tells at the log step after it (batch 21, log_every_n_steps 7).
    from nn_handler import NonFiniteError

    with pytest.raises(
        NonFiniteError,
        match=r"10 optimizer steps in a row \(the last at epoch 1, "
        r"optimizer step 14\)",
    ) as raised:
        _run_with_nan(fused_sgd_05, set(range(4, 20)))
    assert "max_consecutive_skipped_steps" in str(raised.value)


def test_a_checkpoint_counts_the_skipped_steps_the_device_has_not_told_yet(
    tmp_path: Any,
) -> None:
    # A step checkpoint after a skipped step and before the next log step holds the count.
    handler = NNHandler(
        mlp(),
        fused_sgd_05,
        nn.CrossEntropyLoss(),
        config={
            "loader": {"batch_size": 4, "shuffle": False},
            "trainer": {"progress_bar": False, "log_every_n_steps": 1000},
            "checkpoint": {"dir": str(tmp_path), "every_n_steps": 5, "keep_last": 10},
        },
    )
    handler.train(PoisonedBatches({2}), epochs=1)
    (step_5,) = tmp_path.glob("ckpt-e0000-s00000005.pt")
    saved = torch.load(step_5, weights_only=True)["trainer"]
    assert (saved["global_step"], saved["skipped_steps"]) == (5, 1)


# ----------------------------------------------------------------- what the guard launches
class Operations(TorchDispatchMode):
    """Counts the operations torch dispatches (on a GPU, roughly its kernel launches)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


class CountingOperations(Hook):
    """Operations per batch over batches 10 to 29."""

    def __init__(self) -> None:
        self.operations = Operations()

    def before_step(self) -> None:
        index = self.trainer.state.batch_index
        if index == 10:
            self.operations.__enter__()
        elif index == 30:
            self.operations.__exit__(None, None, None)


def _operations_per_step(model: nn.Module, nonfinite: str) -> float:
    hook = CountingOperations()
    handler = NNHandler(
        model,
        fused_sgd,
        nn.CrossEntropyLoss(),
        hooks=[hook],
        config={
            "loader": {"batch_size": 2},
            "trainer": {"progress_bar": False, "nonfinite": nonfinite, "log_every_n_steps": 100},
            "logging": {"monitor": False},
        },
    )
    handler.train(regression_data(n=80))
    return hook.operations.count / 20


def test_the_guard_adds_a_few_operations_a_step() -> None:
    # On a GPU each operation is a kernel launch, and a small model's step is bound by them:
    # the guard adds 2 (a zeroed flag, the fused check) and, for the buffers, the snapshot's
    # copy and their restore: on a CPU the flag as a bool and a torch.where per buffer (three
    # per BatchNorm layer); on CUDA four kernels for all (tests/unit/test_nonfinite.py).
    def with_norms(layers: int) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(6, 16), *[nn.BatchNorm1d(16) for _ in range(layers)], nn.Linear(16, 3)
        )

    added = {
        layers: _operations_per_step(with_norms(layers), "skip")
        - _operations_per_step(with_norms(layers), "off")
        for layers in (0, 1, 3)
    }
    assert added == {0: 2.0, 1: 2.0 + 2 + 3, 3: 2.0 + 2 + 9}, added


def test_a_divergence_counted_while_a_checkpoint_is_written_is_raised_by_the_next_look() -> None:
    # settle(check=False) (a checkpoint recording the position) counts but must not raise in
    # the middle of a save: the NonFiniteError comes from the loop's next settle, once; and an
    # epoch that raised forgets its unread verdicts.
    from types import SimpleNamespace

    from loguru import logger

    from nn_handler import NonFiniteError
    from nn_handler.config.training import TrainerConfig
    from nn_handler.training.nonfinite_guard import NonFiniteGuard
    from nn_handler.training.state import TrainerState

    param = nn.Parameter(torch.zeros(3))
    param.grad = torch.ones(3)
    optimizer = fused_sgd([param])
    state = TrainerState()
    guard = NonFiniteGuard(TrainerConfig(max_consecutive_skipped_steps=2), state, logger)
    guard.adopt([param], nn.Identity(), optimizer, SimpleNamespace(shards_gradients=False), False)
    assert guard.on_device
    for _ in range(2):
        guard.step_unless(optimizer, torch.ones(()))
        state.global_step += 1
    guard.settle(check=False)
    assert (state.skipped_steps, state.skipped_in_a_row) == (2, 2)
    assert torch.equal(param, torch.zeros(3)), "a skipped step moved the weights"
    with pytest.raises(NonFiniteError, match=r"2 optimizer steps in a row .*optimizer step 2\)"):
        guard.settle()
    guard.settle()  # raised once
    guard.step_unless(optimizer, torch.ones(()))
    guard.discard()
    guard.settle()
    assert state.skipped_steps == 2
