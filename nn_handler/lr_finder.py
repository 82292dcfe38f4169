"""The learning-rate finder (Lightning's ``Tuner.lr_find``), a layer above the Trainer whose
step it drives: a short run whose rate grows exponentially from ``min_lr`` to ``max_lr``, one
optimizer step per rate through the Trainer's own step (DDP, FSDP, AMP; accumulation off),
the loss smoothed as Lightning does, a suggested rate (the steepest descent of the curve) and
a plot. Afterwards the model, the optimizer, the GradScaler, the reproducible mode's scales,
the loop state and the random generators are put back on every rank exactly as they were; the
scheduler and the EMA are not touched."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Iterator
from copy import deepcopy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nn_handler.checkpoint.rng import capture_rng, restore_rng
from nn_handler.errors import ConfigError

if TYPE_CHECKING:
    from nn_handler.training.trainer import Trainer

#: The smoothing of the recorded loss (an exponential moving average, bias-corrected).
BETA = 0.98


@dataclass(frozen=True)
class LRFinderResult:
    """The rates tried and the smoothed losses at them (the same on every rank)."""

    lrs: list[float]
    losses: list[float]

    def suggestion(self, skip_begin: int = 10, skip_end: int = 1) -> float | None:
        """The rate where the smoothed loss falls fastest (its most negative slope against
        log10 of the rate), leaving out the first ``skip_begin`` and the last ``skip_end``
        points; None when too few points remain."""
        lrs, losses = self.lrs[skip_begin:-skip_end], self.losses[skip_begin:-skip_end]
        finite = [(lr, loss) for lr, loss in zip(lrs, losses, strict=True) if math.isfinite(loss)]
        if len(finite) < 2:
            return None
        slopes = [
            (b[1] - a[1]) / (math.log10(b[0]) - math.log10(a[0]))
            for a, b in itertools.pairwise(finite)
        ]
        best = min(range(len(slopes)), key=slopes.__getitem__)
        return finite[best][0]

    def plot(self, path: str | Path) -> Path:
        """A PNG of the loss against the rate (log scale), the suggestion marked."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axis = plt.subplots(figsize=(6, 4))
        axis.plot(self.lrs, self.losses)
        axis.set_xscale("log")
        axis.set_xlabel("learning rate")
        axis.set_ylabel("loss (smoothed)")
        suggested = self.suggestion()
        if suggested is not None:
            axis.axvline(suggested, color="red", linestyle="--", label=f"{suggested:.3g}")
            axis.legend()
        target = Path(path)
        figure.savefig(target, dpi=100)
        plt.close(figure)
        return target


def find_lr(
    trainer: Trainer,
    loader: Iterable[Any],
    min_lr: float = 1e-8,
    max_lr: float = 1.0,
    num_training: int = 100,
    early_stop_threshold: float | None = 4.0,
) -> LRFinderResult:
    """Try ``num_training`` rates from ``min_lr`` to ``max_lr`` (geometrically), one optimizer
    step each on ``loader``'s batches (from its start, again if it ends), stopping once the
    smoothed loss passes ``early_stop_threshold`` times its best (None: never) or is not
    finite; then put everything back. Every rank must call this (one all_reduce per step
    averages the loss)."""
    _check(trainer, min_lr, max_lr, num_training)
    optimizer = trainer.optimization.require_optimizer()
    saved = _Saved.of(trainer, optimizer)
    optimization = trainer.optimization
    schedulers, optimization.schedulers[:] = list(optimization.schedulers), []
    ema, optimization.ema = optimization.ema, None
    lrs: list[float] = []
    losses: list[float] = []
    try:
        trainer.model.train()
        average, best = 0.0, math.inf
        batches = _cycled(loader)
        for index in range(num_training):
            lr = min_lr * (max_lr / min_lr) ** (index / max(num_training - 1, 1))
            for group in optimizer.param_groups:
                group["lr"] = lr
            loss = trainer.run_step(next(batches))
            value = float(trainer.comm.all_reduce(float(loss), op="mean"))
            average = BETA * average + (1 - BETA) * value
            smoothed = average / (1 - BETA ** (index + 1))
            lrs.append(lr)
            losses.append(smoothed)
            if not math.isfinite(smoothed):
                break
            best = min(best, smoothed)
            if early_stop_threshold is not None and smoothed > early_stop_threshold * best:
                break
        optimization.settle(check=False)
    finally:
        optimization.schedulers[:] = schedulers
        optimization.ema = ema
        saved.restore(trainer, optimizer)
    return LRFinderResult(lrs, losses)


def _check(trainer: Trainer, min_lr: float, max_lr: float, num_training: int) -> None:
    if not 0 < min_lr < max_lr:
        raise ConfigError(f"lr_find needs 0 < min_lr < max_lr, got {min_lr} and {max_lr}.")
    if num_training < 2:
        raise ConfigError(f"lr_find needs num_training >= 2 steps, got {num_training}.")
    if not trainer.automatic_optimization or len(trainer.optimizers()) != 1:
        raise ConfigError(
            "lr_find tries rates for one optimizer stepped by the loop; with manual "
            "optimization set the rates yourself."
        )
    if trainer.config.fault_tolerance is not None:
        raise ConfigError(
            "lr_find runs no fault-tolerant steps: find the rate in one process without "
            "trainer.fault_tolerance (the reproducible mode gives the same curve at any "
            "number of members), then put it in the optimizer."
        )


def _cycled(loader: Iterable[Any]) -> Iterator[Any]:
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise ConfigError("lr_find got an empty training loader.")


@dataclass
class _Saved:
    """What a step changes, as it was: restored in place on every rank."""

    tensors: list[tuple[torch.Tensor, torch.Tensor]]
    optimizer: dict[str, Any]
    scaler: dict[str, Any]
    mode: list[tuple[Any, Any]]
    state: dict[str, Any]
    rng: dict[str, Any]

    @classmethod
    def of(cls, trainer: Trainer, optimizer: torch.optim.Optimizer) -> _Saved:
        module = trainer.module
        live = [*module.parameters(), *module.buffers()]
        state = {f.name: getattr(trainer.state, f.name) for f in dataclasses.fields(trainer.state)}
        return cls(
            tensors=[(t, t.detach().clone()) for t in live],
            optimizer=deepcopy(optimizer.state_dict()),
            scaler=trainer.precision.state_dict(),
            mode=[(part, deepcopy(part.save())) for part in trainer.mode.parts()],
            state=state,
            rng=capture_rng(),
        )

    def restore(self, trainer: Trainer, optimizer: torch.optim.Optimizer) -> None:
        with torch.no_grad():
            for live, copy in self.tensors:
                live.copy_(copy)
        optimizer.load_state_dict(self.optimizer)
        optimizer.zero_grad(set_to_none=True)
        trainer.precision.load_state_dict(self.scaler)
        for part, value in self.mode:
            part.load(value, "the state before lr_find")
        for name, value in self.state.items():
            setattr(trainer.state, name, value)
        restore_rng(self.rng)


__all__ = ["LRFinderResult", "find_lr"]
