"""FloatStep: the reproducible mode's step with its gradients summed in floating point
(``reproducible.reduction: float``).

Everything but the sum is ExactStep's: the fixed batches (a step's samples, the same whatever
the number of ranks or members), the micro-batch seeds, the BatchNorm statistics per
micro-batch and the slots that carry them. The gradients of this rank's micro-batches are
weighted by their samples and added, then one float64 all_reduce carries them with the slots:
no scales, no second sum, the cost of DDP's reduction. A float sum's order depends on the
number of ranks, so the weights match a run at another world size (or a fault-tolerant run
that lost a member) to float tolerance, not bitwise; every rank still holds the same bits.
"""

from __future__ import annotations

import torch

from nn_handler.data.fixed_batches import StepBatch
from nn_handler.training.reproducible.exact_step import ExactStep


class FloatStep(ExactStep):
    """ExactStep with a floating-point sum (see the module docstring)."""

    def _keep_maxima(self, row: torch.Tensor, parts: list[torch.Tensor], samples: int) -> None:
        """No scales: the per-tensor maxima are not needed (their slots stay zero)."""

    def _reduce(self, step: StepBatch, grads: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One float64 sum of the sample-weighted gradients and the slots; NaN or inf in a
        gradient reaches every rank's sum (the non-finite policy then skips the step)."""
        size = grads.shape[1]
        buffer = self._work.get("float_sum", (size + rows.numel(),), torch.float64)
        total = buffer[:size]
        total.zero_()
        for i, micro in enumerate(step.micro):
            total.add_(grads[i], alpha=micro.size)
        buffer[size:] = rows.reshape(-1)
        self.comm.all_reduce_(buffer, "sum")
        self.collectives += 1
        self.bytes_per_step = buffer.numel() * 8
        rows = buffer[size:].reshape(rows.shape)
        head = rows[:, : self._stats].tolist()  # one host read: samples, counts, losses
        count = max(sum(int(row[0]) for row in head), 1)
        return self._apply(total.div_(count), rows, head)


__all__ = ["FloatStep"]
