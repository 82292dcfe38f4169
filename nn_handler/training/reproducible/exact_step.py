"""ExactStep: one optimizer step of the reproducible mode, the same bits at any world size.

For each micro-batch this rank owns (data/fixed_batches.py), in order: the random streams are
seeded from (seed, optimizer step, micro-batch index), never from the rank; forward and
backward run alone (fresh gradients); the gradients are kept, with each tensor's largest
magnitude (times the micro-batch's samples). Then two collectives, on every rank whatever it
owns: a max of those magnitudes (and of a non-finite flag) fixes each tensor's fixed-point
scale; one int64 sum carries the quantised gradients (fixed_point.py) and, in slots only the
owner fills, each micro-batch's samples, loss and BatchNorm statistics. Every rank then holds
the same gradient (the sample-weighted mean over the global batch), loss and statistics, and
the optimizer steps as usual (Optimization.step). Other buffers must not change in a training
forward: the first step checks it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

from nn_handler.config.training import ReproducibleConfig
from nn_handler.data.fixed_batches import StepBatch
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError
from nn_handler.training.reproducible import fixed_point
from nn_handler.training.reproducible.norm_statistics import NormStatistics

#: Slot columns per micro-batch before the BatchNorm statistics: samples, loss.
_HEAD = 2


def micro_seed(seed: int, step: int, index: int) -> int:
    """The seed of micro-batch ``index`` of optimizer step ``step`` (63 bits, well mixed)."""
    state = np.random.SeedSequence([seed, step, index, 0x5EED]).generate_state(1, np.uint64)
    return int(state[0]) & (2**63 - 1)


class ExactStep:
    """The reproducible mode's step for ``module`` (the plain module the optimizer trains).

    Attributes:
        bytes_per_step: what the step's reductions send per rank (the int64 sum and the max),
            known after the first step.
    """

    def __init__(
        self, config: ReproducibleConfig, module: nn.Module, comm: Communicator,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.config = config
        self.comm = comm
        self.device = device
        self.module = module
        self.norms = NormStatistics(module)
        self.params: list[nn.Parameter] = []
        self.bytes_per_step = 0
        self._checked = False
        self._numels = torch.zeros(0, dtype=torch.int64)
        self._dtype = torch.float32

    def adopt(self, params: list[nn.Parameter]) -> None:
        """The parameters that train (after ``configure_optimizers``)."""
        self.params = params
        self._numels = torch.tensor([p.numel() for p in params], dtype=torch.int64)
        dtypes = {p.dtype for p in params}
        if any(not d.is_floating_point for d in dtypes):
            raise ConfigError("the reproducible mode trains floating-point parameters only.")
        self._dtype = torch.float64 if torch.float64 in dtypes else torch.float32

    def run(
        self, step: StepBatch, forward_backward: Callable[[Any], torch.Tensor], global_step: int
    ) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of ``step``, then the exact
        reduction: every parameter's ``.grad`` is the step's gradient, the same on every
        rank. Returns the step's loss (float64, sample-weighted over the global batch).
        Every rank must call this for every step, with or without micro-batches."""
        params, total = self.params, int(self._numels.sum())
        rows = torch.zeros(
            (self.config.micro_batches, _HEAD + self.norms.width),
            dtype=torch.float64,
            device=self.device,
        )
        grads = torch.empty((len(step.micro), total), dtype=self._dtype, device=self.device)
        maxima = torch.zeros(len(params), dtype=torch.float64, device=self.device)
        others = None if self._checked else _other_buffers(self.module, self.norms)
        self.norms.begin_step()
        try:
            for i, micro in enumerate(step.micro):
                for p in params:
                    p.grad = None
                with _seeded(self.device, micro_seed(self.config.seed, global_step, micro.index)):
                    loss = forward_backward(micro.batch)
                parts = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
                if parts:
                    torch.cat([g.reshape(-1).to(self._dtype) for g in parts], out=grads[i])
                    largest = torch.stack(torch._foreach_norm(parts, math.inf)).double()
                    maxima = torch.maximum(maxima, largest * micro.size)
                row = rows[micro.index]
                row[0] = micro.size
                row[1] = loss.detach().double().reshape(())
                row[_HEAD:] = self.norms.after_micro().to(self.device)
        except BaseException:
            self.norms.end_step(torch.zeros_like(rows))  # hooks off, statistics back
            raise
        if others is not None:
            _check_unchanged(self.module, others)
            self._checked = True
        return self._reduce(step, grads, maxima, rows)

    def _reduce(
        self, step: StepBatch, grads: torch.Tensor, maxima: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """The two collectives, then the gradients, statistics and loss from their sums."""
        comm, params = self.comm, self.params
        finite = bool(torch.isfinite(maxima).all())
        head = torch.cat([torch.where(torch.isfinite(maxima), maxima, 0.0),
                          maxima.new_tensor([0.0 if finite else 1.0])])  # fmt: skip
        comm.all_reduce_(head, "max")
        nonfinite = bool(head[-1] > 0)
        scale = fixed_point.scales(head[:-1], self.config.micro_batches)
        per_element = torch.repeat_interleave(scale, self._numels.to(scale.device))
        summed = torch.zeros(per_element.numel(), dtype=torch.int64, device=self.device)
        if not nonfinite:
            for i, micro in enumerate(step.micro):
                summed += fixed_point.quantize(grads[i], micro.size, per_element)
        buffer = torch.cat([summed, fixed_point.as_slots(rows).reshape(-1)])
        comm.all_reduce_(buffer, "sum")
        self.bytes_per_step = head.numel() * 8 + buffer.numel() * 8
        rows = fixed_point.from_slots(buffer[summed.numel() :]).reshape(rows.shape)
        samples = [int(n) for n in rows[:, 0].tolist()]
        count = sum(samples)
        if not nonfinite:
            gradient = fixed_point.dequantize(buffer[: summed.numel()], per_element, count)
        else:  # a non-finite gradient on some rank: every rank's step sees NaN (and skips)
            gradient = torch.full_like(per_element, math.nan)
        for p, piece in zip(params, _pieces(gradient, self._numels), strict=True):
            p.grad = piece.view_as(p).to(p.dtype)
        self.norms.end_step(rows[:, _HEAD:])
        losses = rows[:, 1].tolist()
        loss = math.fsum(n * losses[j] for j, n in enumerate(samples) if n) / max(count, 1)
        return torch.tensor(loss, dtype=torch.float64, device=self.device)


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """The global random streams forked and seeded with ``seed`` for one micro-batch (the
    streams outside are left as they were)."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type=device.type):
        torch.manual_seed(seed)
        yield


def _pieces(flat: torch.Tensor, numels: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.split(flat, [int(n) for n in numels.tolist()]))


def _other_buffers(module: nn.Module, norms: NormStatistics) -> dict[str, torch.Tensor]:
    """Every buffer but the BatchNorm statistics the mode combines itself, copied."""
    managed = {id(layer) for _, layer in norms.layers}
    found: dict[str, torch.Tensor] = {}
    for name, owner in module.named_modules():
        if id(owner) in managed:
            continue
        for key, buffer in owner.named_buffers(recurse=False):
            if buffer is not None:
                found[f"{name}.{key}" if name else key] = buffer.detach().clone()
    return found


def _check_unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = dict(module.named_buffers())
    for name, saved in before.items():
        current = now.get(name)
        if current is not None and not torch.equal(current, saved):
            raise ConfigError(
                f"the buffer {name!r} changed in a training forward; the reproducible mode "
                f"keeps only BatchNorm running statistics identical across world sizes. Make "
                f"it a constant (or compute it outside the forward), or train without "
                f"TrainerConfig.reproducible."
            )


__all__ = ["ExactStep", "micro_seed"]
