"""Exact distributed metrics: per-key sums and counts on the device, reduced once.

Nothing here synchronises with the host while accumulating; an epoch's training loss and its
extra values are reduced in one all_reduce (weighted_means.py: ``WeightedMeans.reduce``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from nn_handler.distributed.communicator import Communicator
from nn_handler.training.weighted_means import MetricKeys, WeightedMeans

MetricFn = Callable[[Any, Any], torch.Tensor | float]


@runtime_checkable
class StatefulMetric(Protocol):
    """A torchmetrics-style metric: ``update(outputs, targets)``, ``compute()``, ``reset()``.

    torchmetrics Metric objects synchronise themselves across ranks in ``compute``; with the
    exact-evaluation loader (no padded samples) their result is exact.
    """

    def update(self, *args: Any, **kwargs: Any) -> None: ...

    def compute(self) -> Any: ...

    def reset(self) -> None: ...


def accuracy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Top-1 accuracy of class scores ``outputs`` (N, C) against labels ``targets`` (N,)."""
    return (outputs.argmax(dim=1) == targets).float().mean()


class RunningLoss:
    """The training loss of one epoch, kept without per-step host synchronisation.

    ``add(loss, n)`` only appends the detached loss tensor; ``end_window(k, skipped)`` closes
    an optimizer step of ``k`` micro-batches: when the step was skipped its losses are left
    out of the mean (on every rank alike, finite or not; ``skipped`` may be a device flag,
    applied when the values are folded, with no host read), and every ``fold_every`` batches
    the pending values are folded into a device sum and count in a few tensor ops. Non-finite
    losses are left out of the mean too; skipped samples still count in ``samples``.
    ``compute(comm)`` reduces sum, count and samples in one all_reduce. ``extras`` holds the
    other scalars ``training_step`` returned (sample-weighted); they are reduced only when some
    rank has any (the first all_reduce says so), in one more exchange.
    """

    def __init__(self, fold_every: int = 50) -> None:
        self.fold_every = fold_every
        self._pending: list[torch.Tensor] = []
        self._sizes: list[int] = []
        self._flags: list[tuple[int, int, torch.Tensor]] = []  # pending[start:end] skipped if set
        self._sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        self.samples = 0
        self.extras = WeightedMeans()

    def add(self, loss: torch.Tensor, n: int) -> None:
        self._pending.append(loss)
        self._sizes.append(n)
        self.samples += n

    def end_window(self, micro_batches: int, skipped: bool | torch.Tensor) -> None:
        """The last ``micro_batches`` losses made one optimizer step; ``skipped``: it was
        skipped (True, or a device flag that is nonzero), so they leave the mean. Folds when
        enough values are pending."""
        pending = self._pending
        start = max(len(pending) - micro_batches, 0)
        if isinstance(skipped, torch.Tensor):
            self._flags.append((start, len(pending), skipped))
        elif skipped:
            for i in range(start, len(pending)):
                pending[i] = torch.full_like(pending[i], math.nan)
        if len(self._pending) >= self.fold_every:
            self.fold()

    def _apply_flags(self) -> None:
        """The device flags of skipped windows made NaN losses (no host read)."""
        if not self._flags:
            return
        pending, nan = self._pending, math.nan
        for start, end, flag in self._flags:
            skipped = flag.reshape(()).bool()
            for i in range(start, end):
                pending[i] = torch.where(skipped, nan, pending[i])
        self._flags.clear()

    def fold(self) -> None:
        if not self._pending:
            return
        losses = torch.stack(self._pending).to(torch.float64)
        if self._flags:  # the skipped windows' losses leave the mean: one mask, no host read
            zero = self._flags[0][2].new_zeros(())
            marks = [zero] * len(self._pending)
            for start, end, flag in self._flags:
                marks[start:end] = [flag.reshape(())] * (end - start)
            losses = losses.masked_fill(torch.stack(marks).to(losses.device) > 0, math.nan)
            self._flags.clear()
        sizes = torch.tensor(self._sizes, dtype=torch.float64)  # copied without a host wait
        sizes = sizes.to(losses.device, non_blocking=True)
        finite = torch.isfinite(losses)
        total = torch.where(finite, losses * sizes, 0.0).sum()
        count = (finite * sizes).sum()
        self._sum = total if self._sum is None else self._sum + total
        self._count = count if self._count is None else self._count + count
        self._pending.clear()
        self._sizes.clear()

    def local_mean(self) -> float:
        """This rank's mean so far (a host sync: for the rank-0 progress bar only)."""
        self.fold()
        if self._sum is None or self._count is None or not float(self._count):
            return math.nan
        return float(self._sum / self._count)

    def state_dict(self) -> dict[str, Any]:
        """The exact partial state (pending values unfolded, so a resumed epoch sums alike)."""
        self._apply_flags()
        return {
            "pending": [t.detach() for t in self._pending],
            "sizes": list(self._sizes),
            "sum": self._sum,
            "count": self._count,
            "samples": self.samples,
            "extras": self.extras.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device) -> None:
        self._pending = [t.to(device) for t in state["pending"]]
        self._sizes = [int(n) for n in state["sizes"]]
        self._sum = None if state["sum"] is None else state["sum"].to(device)
        self._count = None if state["count"] is None else state["count"].to(device)
        self.samples = int(state["samples"])
        self.extras = WeightedMeans()
        if state.get("extras"):
            self.extras.load_state_dict(state["extras"], device)

    def compute(
        self, comm: Communicator, device: torch.device | None = None, keys: MetricKeys | None = None
    ) -> tuple[float, int, dict[str, float]]:
        """(exact mean loss over every rank's finite batches, samples seen by all ranks, the
        extras' exact means), in one all_reduce when the extras' keys are those ``keys``
        remembers. Every rank must call this."""
        self.fold()
        where = device or (self._sum.device if self._sum is not None else torch.device("cpu"))
        zero = torch.zeros((), dtype=torch.float64, device=where)
        local: list[torch.Tensor | float] = [
            self._sum if self._sum is not None else zero,
            self._count if self._count is not None else zero,
            float(self.samples),
        ]
        extras, (total, count, samples) = self.extras.reduce(comm, where, keys, local)
        return (total / count if count else math.nan), int(samples), extras


def compute_stateful(metric: StatefulMetric) -> float:
    """A stateful metric's value as a float (torchmetrics syncs across ranks in compute)."""
    value = metric.compute()
    return float(value.item() if isinstance(value, torch.Tensor) else value)


__all__ = [
    "MetricFn",
    "MetricKeys",
    "RunningLoss",
    "StatefulMetric",
    "WeightedMeans",
    "accuracy",
    "compute_stateful",
]
