"""Carried: a member's own part of an abandoned attempt's exact sum (fault tolerance), kept so
that the step's redo computes only the micro-batches no survivor holds. The sum is of int64
fixed-point values at the step's kept scales, so adding a carried part to the redo's is the
same bits as computing it again."""

from __future__ import annotations

import dataclasses

import torch

from nn_handler.data.fixed_batches import MicroBatch


@dataclasses.dataclass(frozen=True)
class Carried:
    """This rank's contribution to a step's int64 sum, as it was before the sum: the
    accumulated gradients of ``micro`` at ``exponents``, then the slots of their rows."""

    #: The optimizer step it belongs to.
    global_step: int
    #: The fixed-point exponents the gradients were accumulated at.
    exponents: torch.Tensor
    #: The sum's vector (gradients, then slots), copied before the sum.
    vector: torch.Tensor
    #: The micro-batches it holds.
    micro: tuple[MicroBatch, ...]

    def fits(self, global_step: int, exponents: torch.Tensor | None) -> bool:
        """Whether it can be added to ``global_step``'s sum at ``exponents``."""
        return (
            global_step == self.global_step
            and exponents is not None
            and torch.equal(exponents, self.exponents)
        )

    def indices(self) -> list[int]:
        """The indices (in the step) of the micro-batches it holds."""
        return [m.index for m in self.micro]


__all__ = ["Carried"]
