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

from nn_handler.training.reproducible.exact_step import ExactStep, StepPasses


class FloatStep(ExactStep):
    """ExactStep with a floating-point sum (see the module docstring)."""

    carries_sums = False  # a float sum's bits depend on its order: a redo is done whole

    def _keep_maxima(self, row: torch.Tensor, parts: list[torch.Tensor], samples: int) -> None:
        """No scales: the per-tensor maxima are not needed (their slots stay zero)."""

    def _buffer(self, size: int) -> torch.Tensor:
        """The step's float64 sum: the weighted gradients, then the slots."""
        return self._work.get("float_sum", (size,), torch.float64)

    def _accumulating(self) -> bool:
        return True  # no scales to agree on

    def _accumulate(
        self, parts: list[torch.Tensor], samples: int, accumulator: torch.Tensor, first: bool
    ) -> None:
        """One micro-batch's gradient (each parameter's) weighted by its samples, added in
        float64."""
        if not parts:
            return
        views = torch.split(accumulator, [p.numel() for p in parts])
        flat = [p.reshape(-1) for p in parts]
        if first:
            torch._foreach_copy_(views, flat)
            torch._foreach_mul_(views, float(samples))
        else:
            torch._foreach_add_(views, flat, alpha=samples)

    def _reduce(self, passes: StepPasses, buffer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One float64 sum of the sample-weighted gradients and the slots; NaN or inf in a
        gradient reaches every rank's sum (the non-finite policy then skips the step)."""
        size = buffer.numel() - rows.numel()
        buffer[size:] = rows.reshape(-1)
        self.comm.all_reduce_(buffer, "sum")
        self.collectives += 1
        self.bytes_per_step = buffer.numel() * 8
        rows = buffer[size:].reshape(rows.shape)
        head = rows[:, : self._stats].tolist()  # one host read: samples, counts, losses
        count = max(sum(int(row[0]) for row in head), 1)
        return self._apply(buffer[:size].div_(count), rows, head)


__all__ = ["FloatStep"]
