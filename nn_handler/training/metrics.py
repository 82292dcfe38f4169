"""Exact distributed metrics: per-key sums and counts on the device, reduced once.

Nothing here synchronises with the host while accumulating; ``WeightedMeans.compute``
makes one all_reduce (plus one small object gather for the key set) per call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol, runtime_checkable

import torch

from nn_handler.distributed.communicator import Communicator

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


class WeightedMeans:
    """Sample-weighted means of named values over every rank, NaN-aware.

    ``update(values, n)`` adds per-batch means weighted by the batch's sample count ``n``; a
    NaN value is left out of its key's sum and count. ``compute(comm)`` returns, on every rank,
    each key's total over all ranks divided by its count (NaN when no rank counted any): the
    mean one process would compute over all samples. Every rank must call ``compute``, also
    a rank that saw no batch.
    """

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}

    def update(self, values: Mapping[str, torch.Tensor | float], n: int) -> None:
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensor = value.detach().to(torch.float64)
            else:  # Python numbers keep their double precision
                tensor = torch.tensor(float(value), dtype=torch.float64)
            valid = ~torch.isnan(tensor)
            weighted = torch.where(valid, tensor * n, 0.0)
            counted = valid.to(torch.float64) * n
            if key in self._sums:
                self._sums[key] += weighted
                self._counts[key] += counted
            else:
                self._sums[key] = weighted
                self._counts[key] = counted

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()

    def local_means(self) -> dict[str, float]:
        """This rank's running mean of every key (host syncs; for display only)."""
        return {key: self.local_mean(key) for key in self._sums}

    def __bool__(self) -> bool:
        return bool(self._sums)

    def state_dict(self) -> dict[str, Any]:
        return {"sums": dict(self._sums), "counts": dict(self._counts)}

    def load_state_dict(self, state: Mapping[str, Any], device: torch.device) -> None:
        self._sums = {k: v.to(device) for k, v in state["sums"].items()}
        self._counts = {k: v.to(device) for k, v in state["counts"].items()}

    def local_mean(self, key: str) -> float:
        """This rank's running mean of ``key`` (a host sync; for display only)."""
        if key not in self._sums:
            return math.nan
        count = float(self._counts[key])
        return float(self._sums[key]) / count if count else math.nan

    def compute(self, comm: Communicator, device: torch.device | None = None) -> dict[str, float]:
        """Every rank gets the exact global mean of every key any rank saw. Every rank must
        call this."""
        keys = sorted(self._sums)
        if comm.world_size > 1:
            union: set[str] = set()
            for rank_keys in comm.all_gather_object(keys):
                union.update(rank_keys)
            keys = sorted(union)
        if not keys:  # the union: empty on every rank alike
            return {}
        where = device or next(iter(self._sums.values()), torch.zeros(())).device
        zero = torch.zeros((), dtype=torch.float64, device=where)
        sums = [self._sums.get(k, zero).to(where) for k in keys]
        counts = [self._counts.get(k, zero).to(where) for k in keys]
        totals = comm.all_reduce(torch.stack(sums + counts)).cpu().tolist()
        means: dict[str, float] = {}
        for i, key in enumerate(keys):
            count = totals[len(keys) + i]
            means[key] = totals[i] / count if count else math.nan
        return means


class RunningLoss:
    """The training loss of one epoch, kept without per-step host synchronisation.

    ``add(loss, n)`` only appends the detached loss tensor; ``end_window(k, skipped)`` closes
    an optimizer step of ``k`` micro-batches: when the step was skipped its losses are left
    out of the mean (on every rank alike, finite or not), and every ``fold_every`` batches the
    pending values are folded into a device sum and count in a few tensor ops. Non-finite
    losses are left out of the mean too; skipped samples still count in ``samples``.
    ``compute(comm)`` reduces sum, count and samples in one all_reduce. ``extras`` holds the
    other scalars ``training_step`` returned (sample-weighted); they are reduced only when some
    rank has any (the first all_reduce says so), in one more exchange.
    """

    def __init__(self, fold_every: int = 50) -> None:
        self.fold_every = fold_every
        self._pending: list[torch.Tensor] = []
        self._sizes: list[int] = []
        self._sum: torch.Tensor | None = None
        self._count: torch.Tensor | None = None
        self.samples = 0
        self.extras = WeightedMeans()

    def add(self, loss: torch.Tensor, n: int) -> None:
        self._pending.append(loss)
        self._sizes.append(n)
        self.samples += n

    def end_window(self, micro_batches: int, skipped: bool) -> None:
        """The last ``micro_batches`` losses made one optimizer step; ``skipped``: it was
        skipped, so they leave the mean. Folds when enough values are pending."""
        if skipped:
            pending = self._pending
            for i in range(max(len(pending) - micro_batches, 0), len(pending)):
                pending[i] = torch.full_like(pending[i], math.nan)
        if len(self._pending) >= self.fold_every:
            self.fold()

    def fold(self) -> None:
        if not self._pending:
            return
        losses = torch.stack(self._pending).to(torch.float64)
        sizes = torch.tensor(self._sizes, dtype=torch.float64, device=losses.device)
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
        self, comm: Communicator, device: torch.device | None = None
    ) -> tuple[float, int, dict[str, float]]:
        """(exact mean loss over every rank's finite batches, samples seen by all ranks, the
        extras' exact means). Every rank must call this."""
        self.fold()
        where = device or (self._sum.device if self._sum is not None else torch.device("cpu"))
        local = torch.zeros(4, dtype=torch.float64, device=where)
        if self._sum is not None and self._count is not None:
            local[0] = self._sum
            local[1] = self._count
        local[2] = self.samples
        local[3] = float(bool(self.extras))
        total, count, samples, with_extras = comm.all_reduce(local).cpu().tolist()
        extras = self.extras.compute(comm, where) if with_extras > 0 else {}
        return (total / count if count else math.nan), int(samples), extras


def compute_stateful(metric: StatefulMetric) -> float:
    """A stateful metric's value as a float (torchmetrics syncs across ranks in compute)."""
    value = metric.compute()
    return float(value.item() if isinstance(value, torch.Tensor) else value)


__all__ = [
    "MetricFn",
    "RunningLoss",
    "StatefulMetric",
    "WeightedMeans",
    "accuracy",
    "compute_stateful",
]
