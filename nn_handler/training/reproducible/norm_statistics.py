"""BatchNorm in the reproducible mode: batch statistics per micro-batch, running statistics
from an exact combination of every micro-batch's.

Each micro-batch normalises with its own statistics (its forward is the same on any rank). A
plain forward would also move the running statistics once per micro-batch, in the order the
rank ran them, so the result would depend on the world size. Instead, during a step each
layer's momentum is 1, so after a micro-batch's forward its running statistics hold that
micro-batch's mean and unbiased variance exactly; they travel to every rank in exact slots
(fixed_point.as_slots), and every rank combines them in micro-batch order, in float64, into
the statistics of the whole global batch (law of total variance) and applies the layer's
momentum once, as one forward over the global batch would. ``num_batches_tracked`` grows by
one per step.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase

from nn_handler.errors import ConfigError


class NormStatistics:
    """The running statistics of ``module``'s BatchNorm layers under the mode. Refuses
    layers it cannot keep identical (SyncBatchNorm, instance norms with running statistics)."""

    def __init__(self, module: nn.Module) -> None:
        self.layers: list[tuple[str, _BatchNorm]] = []
        for name, layer in module.named_modules():
            if isinstance(layer, nn.SyncBatchNorm):
                raise ConfigError(
                    f"layer {name!r} is a SyncBatchNorm, whose statistics are a floating-point "
                    f"reduction over ranks: the reproducible mode cannot keep it identical; use "
                    f"BatchNorm (its statistics are combined exactly by the mode)."
                )
            tracked = isinstance(layer, _NormBase) and layer.track_running_stats
            if tracked and not isinstance(layer, _BatchNorm):
                raise ConfigError(
                    f"layer {name!r} ({type(layer).__name__}) keeps running statistics, which "
                    f"the reproducible mode combines only for BatchNorm layers; build it with "
                    f"track_running_stats=False."
                )
            if tracked and isinstance(layer, _BatchNorm) and layer.running_mean is not None:
                self.layers.append((name, layer))
        channels = [layer.num_features for _, layer in self.layers]
        #: Float64 values per micro-batch: every layer's mean, then every layer's variance.
        self.width = 2 * sum(channels)
        self._layer_of_channel = torch.repeat_interleave(
            torch.arange(len(channels)), torch.tensor(channels, dtype=torch.int64)
        )
        self._saved: torch.Tensor | None = None  # the running statistics when the step began
        self._tracked: torch.Tensor | None = None  # and num_batches_tracked
        self._momenta: list[float | None] = []
        self._given: tuple[Any, torch.Tensor] | None = None  # the momenta on the device
        self._counts: list[list[int]] = []
        self._handles: list[Any] = []

    def begin_step(self) -> None:
        """Before the step's first micro-batch: remember the statistics, set momentum 1."""
        if not self.layers:
            return
        means, variances = self._running()
        self._saved = torch.cat(means + variances)
        counters = [layer.num_batches_tracked for _, layer in self.layers]
        present = [t for t in counters if t is not None]
        self._tracked = torch.stack(present) if len(present) == len(counters) else None
        self._momenta = [layer.momentum for _, layer in self.layers]
        self._counts = [[] for _ in self.layers]
        for i, (_, layer) in enumerate(self.layers):
            layer.momentum = 1.0
            self._handles.append(layer.register_forward_pre_hook(self._counter(i)))

    def _counter(self, i: int) -> Any:
        def count(layer: nn.Module, args: tuple[Any, ...]) -> None:
            if layer.training:
                x = args[0]
                self._counts[i].append(x.numel() // max(x.shape[1], 1))

        return count

    def after_micro(self) -> tuple[torch.Tensor, list[int]]:
        """A micro-batch's statistics: per layer its mean, then per layer its unbiased
        variance (one tensor, the layers' dtype), and per layer the elements per channel
        (a layer it did not run in training mode counts 0)."""
        counts: list[int] = []
        for i, (name, _) in enumerate(self.layers):
            seen, self._counts[i] = self._counts[i], []
            if len(seen) > 1:
                raise ConfigError(
                    f"BatchNorm layer {name!r} ran {len(seen)} times in one forward; the "
                    f"reproducible mode needs each BatchNorm layer to run once per forward."
                )
            counts.append(seen[0] if seen else 0)
        if not self.layers:
            return torch.zeros(0, dtype=torch.float64), counts
        means, variances = self._running()
        return torch.cat(means + variances), counts

    def _running(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        pairs = [_running(layer) for _, layer in self.layers]
        return [mean for mean, _ in pairs], [var for _, var in pairs]

    @property
    def in_step(self) -> bool:
        """Whether a step began and has not ended (its statistics are not set yet)."""
        return bool(self._handles)

    def abort(self) -> None:
        """The step failed: the statistics as they were when it began."""
        if self._saved is None:
            self._end()
            return
        self._write(self._saved, self._tracked)

    def end_step(self, stats: torch.Tensor, counts: torch.Tensor) -> None:
        """Every rank alike: set the statistics from every micro-batch's ``stats`` (float64,
        one row per micro-batch of the step, in order: ``after_micro``'s values) and
        ``counts`` (float64, a row's elements per channel per layer; rows of absent
        micro-batches are zeros). No host sync: on a GPU this is a few kernels."""
        if self._saved is None:
            self._end()
            return
        c = self.width // 2
        index = self._layer_of_channel.to(stats.device)
        n = counts[:, index]  # (micro-batches, channels)
        total = n.sum(0)
        mean_i, var_i = stats[:, :c], stats[:, c:]
        some = torch.where(total > 0, total, 1.0)
        mean = (n * mean_i).sum(0) / some
        biased = torch.where(n > 1, var_i * (n - 1) / torch.where(n > 0, n, 1.0), 0.0)
        spread = (n * (biased + (mean_i - mean) ** 2)).sum(0)
        var = torch.where(total > 1, spread / (total - 1), spread / some)
        old = self._saved.to(torch.float64)
        factor = self._factors(stats.device)[index]
        ran = total > 0  # a layer that never ran in training mode this step: unchanged
        moved = torch.cat([(1 - factor) * old[:c] + factor * mean,
                           (1 - factor) * old[c:] + factor * var])  # fmt: skip
        new = torch.where(torch.cat([ran, ran]), moved, old)
        tracked = None
        if self._tracked is not None:
            ran_layer = counts.sum(0) > 0
            tracked = self._tracked + ran_layer.to(self._tracked.dtype).to(self._tracked.device)
        self._write(new, tracked)

    def _factors(self, device: torch.device) -> torch.Tensor:
        """Each layer's weight of the step's statistics: its momentum, or 1 / (steps) for
        ``momentum=None`` (a cumulative average)."""
        given = tuple(m if m is not None else 0.0 for m in self._momenta)
        if self._given is None or self._given[0] != (given, device):  # kept: no copy a step
            self._given = ((given, device), torch.tensor(given, dtype=torch.float64).to(device))
        factors = self._given[1]
        if all(m is not None for m in self._momenta) or self._tracked is None:
            return factors
        cumulative = torch.tensor([m is None for m in self._momenta]).to(device)
        steps = 1 + self._tracked.to(device, torch.float64)
        return torch.where(cumulative, 1 / steps, factors)

    def _write(self, values: torch.Tensor, tracked: torch.Tensor | None) -> None:
        """``values`` (every mean, then every variance) into the running statistics,
        ``tracked`` into num_batches_tracked; the momenta back; the step ends."""
        means, variances = self._running()
        targets = means + variances
        sources = torch.split(values, [t.numel() for t in targets])
        torch._foreach_copy_(targets, list(sources))
        if tracked is not None:
            counters = [layer.num_batches_tracked for _, layer in self.layers]
            torch._foreach_copy_([t for t in counters if t is not None], list(tracked.unbind()))
        self._end()

    def _end(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for (_, layer), momentum in zip(self.layers, self._momenta, strict=False):
            layer.momentum = momentum
        self._saved = None
        self._tracked = None


def _running(layer: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    mean, var = layer.running_mean, layer.running_var
    if mean is None or var is None:  # never: such layers are not kept
        raise ConfigError(f"{type(layer).__name__} has no running statistics.")
    return mean, var


__all__ = ["NormStatistics"]
