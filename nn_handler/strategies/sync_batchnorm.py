"""Synchronised BatchNorm on every device.

On CUDA this is torch's ``nn.SyncBatchNorm``. torch refuses it on CPU (the module and DDP both
reject CPU tensors), so gloo runs get ``SyncBatchNorm`` instead: a BatchNorm whose
training statistics come from one differentiable all_reduce
(``torch.distributed.nn.functional.all_reduce``) of the per-channel sum, sum of squares and
count over all ranks, so gradients flow through the global statistics as they do in torch's
CUDA kernel. Its state dict is a BatchNorm's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.nn.functional import all_reduce as differentiable_all_reduce
from torch.nn.modules.batchnorm import _BatchNorm


class SyncBatchNorm(_BatchNorm):
    """BatchNorm over the batch of every rank, for CPU tensors (over gloo)."""

    process_group: Any = None

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self._needs_sync():
            output: torch.Tensor = super().forward(input)
            return output
        return self._synchronised_forward(input)

    def _needs_sync(self) -> bool:
        return (
            self.training
            and dist.is_available()
            and dist.is_initialized()
            and dist.get_world_size(self.process_group) > 1
        )

    def _synchronised_forward(self, input: torch.Tensor) -> torch.Tensor:
        channels = input.shape[1]
        dims = [0, *range(2, input.dim())]
        x = input.float()
        count = torch.tensor([x.numel() / channels], dtype=torch.float64, device=x.device)
        local = torch.cat([x.sum(dims).double(), (x * x).sum(dims).double(), count])
        group = self.process_group or dist.group.WORLD
        total: torch.Tensor = differentiable_all_reduce(  # type: ignore[no-untyped-call]
            local, group=group
        )
        n = total[-1]
        mean = total[:channels] / n
        var = (total[channels : 2 * channels] / n - mean * mean).clamp_min(0)
        self._update_running_stats(mean.detach(), var.detach(), float(n.detach()))
        shape = [1, channels] + [1] * (input.dim() - 2)
        scale = torch.rsqrt(var + self.eps).float()
        out = (x - mean.float().view(shape)) * scale.view(shape)
        if self.affine:
            out = out * self.weight.view(shape) + self.bias.view(shape)
        return out.to(input.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, var: torch.Tensor, n: float) -> None:
        if not self.track_running_stats or self.running_mean is None or self.running_var is None:
            return
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.momentum is None:  # cumulative moving average
            factor = 1.0 / float(self.num_batches_tracked or 1)
        else:
            factor = self.momentum
        unbiased = var * (n / max(n - 1.0, 1.0))
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), factor)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), factor)


def convert_sync_batchnorm(
    module: nn.Module, device: torch.device, process_group: Any = None
) -> nn.Module:
    """Synchronise every BatchNorm*d in ``module``: torch's nn.SyncBatchNorm on CUDA, this
    module's ``SyncBatchNorm`` elsewhere (same parameters, buffers and state dict)."""
    if device.type == "cuda":
        converted: nn.Module = nn.SyncBatchNorm.convert_sync_batchnorm(  # type: ignore[no-untyped-call]
            module, process_group
        )
        return converted
    for child in module.modules():  # includes ``module`` itself
        if isinstance(child, _BatchNorm) and not isinstance(child, nn.SyncBatchNorm):
            # Same state, a synchronised forward: swapping the class keeps every tensor as is.
            child.__class__ = SyncBatchNorm
            child.process_group = process_group
    return module


__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]
