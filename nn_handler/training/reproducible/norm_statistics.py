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
        #: Float64 values per micro-batch: each layer's mean, variance and element count.
        self.width = sum(2 * layer.num_features + 1 for _, layer in self.layers)
        self._saved: list[tuple[Any, ...]] = []
        self._counts: list[list[int]] = []
        self._handles: list[Any] = []

    def begin_step(self) -> None:
        """Before the step's first micro-batch: remember the statistics, set momentum 1."""
        self._saved = []
        self._counts = [[] for _ in self.layers]
        for i, (_, layer) in enumerate(self.layers):
            running_mean, running_var = _running(layer)
            tracked = layer.num_batches_tracked
            self._saved.append(
                (
                    running_mean.clone(),
                    running_var.clone(),
                    None if tracked is None else tracked.clone(),
                    layer.momentum,
                )
            )
            layer.momentum = 1.0
            self._handles.append(layer.register_forward_pre_hook(self._counter(i)))

    def _counter(self, i: int) -> Any:
        def count(layer: nn.Module, args: tuple[Any, ...]) -> None:
            if layer.training:
                x = args[0]
                self._counts[i].append(x.numel() // max(x.shape[1], 1))

        return count

    def after_micro(self) -> torch.Tensor:
        """A micro-batch's statistics (float64: per layer its mean, unbiased variance and
        elements per channel; a layer it did not run in training mode counts 0)."""
        parts: list[torch.Tensor] = []
        for i, (name, layer) in enumerate(self.layers):
            running_mean, running_var = _running(layer)
            counts, self._counts[i] = self._counts[i], []
            if len(counts) > 1:
                raise ConfigError(
                    f"BatchNorm layer {name!r} ran {len(counts)} times in one forward; the "
                    f"reproducible mode needs each BatchNorm layer to run once per forward."
                )
            n = counts[0] if counts else 0
            mean = running_mean.to(torch.float64)
            var = running_var.to(torch.float64)
            parts += [mean, var, torch.tensor([float(n)], dtype=torch.float64, device=mean.device)]
        if not parts:
            return torch.zeros(0, dtype=torch.float64)
        return torch.cat(parts)

    @property
    def in_step(self) -> bool:
        """Whether a step began and has not ended (its statistics are not set yet)."""
        return bool(self._handles)

    def end_step(self, rows: torch.Tensor) -> None:
        """Every rank alike: set the statistics from every micro-batch's ``rows`` (one row per
        micro-batch of the step, in order; rows of absent micro-batches are zeros)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        offset = 0
        for (_, layer), saved in zip(self.layers, self._saved, strict=True):
            mean0, var0, tracked0, momentum = saved
            c = layer.num_features
            block = rows[:, offset : offset + 2 * c + 1]
            offset += 2 * c + 1
            layer.momentum = momentum
            self._combine(layer, block, mean0, var0, tracked0, momentum)
        self._saved = []

    @staticmethod
    def _combine(
        layer: _BatchNorm,
        block: torch.Tensor,
        mean0: torch.Tensor,
        var0: torch.Tensor,
        tracked0: torch.Tensor | None,
        momentum: float | None,
    ) -> None:
        running_mean, running_var = _running(layer)
        c = layer.num_features
        counts = [float(n) for n in block[:, 2 * c].tolist()]
        present = [j for j, n in enumerate(counts) if n > 0]
        if not present:  # the layer never ran in training mode this step: unchanged
            running_mean.copy_(mean0)
            running_var.copy_(var0)
            if tracked0 is not None and layer.num_batches_tracked is not None:
                layer.num_batches_tracked.copy_(tracked0)
            return
        total = sum(counts[j] for j in present)
        mean = torch.zeros(c, dtype=torch.float64, device=block.device)
        for j in present:
            mean += counts[j] * block[j, :c]
        mean /= total
        spread = torch.zeros_like(mean)
        for j in present:
            n = counts[j]
            biased = block[j, c : 2 * c] * ((n - 1) / n) if n > 1 else torch.zeros_like(mean)
            spread += n * (biased + (block[j, :c] - mean) ** 2)
        var = spread / total * (total / (total - 1) if total > 1 else 1.0)
        if tracked0 is not None and layer.num_batches_tracked is not None:
            layer.num_batches_tracked.copy_(tracked0 + 1)
        steps = 1 + (int(tracked0) if tracked0 is not None else 0)
        factor = momentum if momentum is not None else 1.0 / steps  # None: cumulative average
        old_mean, old_var = mean0.to(torch.float64), var0.to(torch.float64)
        running_mean.copy_((1 - factor) * old_mean + factor * mean)
        running_var.copy_((1 - factor) * old_var + factor * var)


def _running(layer: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    mean, var = layer.running_mean, layer.running_var
    if mean is None or var is None:  # never: such layers are not kept
        raise ConfigError(f"{type(layer).__name__} has no running statistics.")
    return mean, var


__all__ = ["NormStatistics"]
