"""Fixed-point sums whose result does not depend on the order of their terms.

A floating-point sum rounds after every addition, so its result depends on the order of the
terms (and so on how many ranks summed them, and in which tree). An int64 sum is exact, in any
order. A gradient becomes integers with a power-of-two scale per tensor (``Scale``), chosen
from the largest magnitude any term has, as every rank agreed on it: ``q = round(g * n *
2**e)``, where ``n`` weighs the term (its samples), and ``terms`` such integers cannot
overflow 62 bits. The sum of the ``q`` is exact; it is turned back into a float once.

What it keeps: each term's elements are rounded to a multiple of ``2**-e``. The scale gives a
tensor's largest term between 35 and 51 bits (with 8 terms; ``Scale``), so every element
within 2**-11 of the largest keeps all its float32 bits, and none is off by more than half a
unit of that last place: the rounding is far below float32's own in practice. Exact transport
of other values (losses, statistics, maxima): float64 bit patterns viewed as int64 in slots
only one rank fills, so the sum across ranks adds zeros to them and keeps every bit.
"""

from __future__ import annotations

import math

import torch

#: The largest sum of magnitudes an int64 holds with a bit to spare.
_BITS = 62


def headroom(terms: int) -> int:
    """Bits left for the largest term when ``terms`` terms are summed."""
    return _BITS - max(0, math.ceil(math.log2(max(terms, 1))))


def scaled(
    values: torch.Tensor,
    weight: int,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    unit: int = 1,
) -> torch.Tensor:
    """``round(values * weight * 2**e)`` in float64 (into ``out``), an exact integer value;
    ``scale``: per element ``2**e * unit`` (``Scale.per_element``), so that a term whose
    weight is the unit takes one multiply. Exact up to the rounding, and the same bits for any
    unit: a float32 times an integer below 2**29 times a power of two fits a float64's 53
    bits, so dividing by the unit and multiplying by the weight are exact too."""
    if out is None:
        out = torch.empty(values.shape, dtype=torch.float64, device=values.device)
    out.copy_(values).mul_(scale)  # faster than one mixed-dtype multiply on the CPU
    if weight != unit:
        if unit != 1:
            out.div_(unit)
        out.mul_(weight)
    return out.round_()


def quantize(values: torch.Tensor, weight: int, scale: torch.Tensor, unit: int = 1) -> torch.Tensor:
    """``scaled`` as int64."""
    return scaled(values, weight, scale, unit=unit).to(torch.int64)


def dequantize(
    total: torch.Tensor,
    factors: torch.Tensor,
    out: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
) -> torch.Tensor:
    """The value of the fixed-point ``total`` times ``factors`` (per element, float64: the
    scale's inverse over the divisor, ``Scale.factors``), computed in float64 (in ``work``)
    and rounded into ``out`` (any float dtype; default: ``work``). Three plain passes: on
    the CPU torch's mixed-dtype multiply (int64 by float64 into float32) is five times
    slower than all three, and into float64 no faster in a training step."""
    if work is None:
        work = torch.empty(total.shape, dtype=torch.float64, device=total.device)
    work.copy_(total).mul_(factors)
    return work if out is None else out.copy_(work)


class Scale:
    """Each tensor's fixed-point exponent ``e`` (its scale ``2**e``), kept from step to step.

    Set from a tensor's largest term (the maxima every rank agreed on, so every rank and every
    world size makes the same choice), it leaves ``MARGIN`` bits of room above that term. It
    ``holds`` for a later step while that step's largest term fits (below
    ``2**headroom(terms)``) and keeps at least ``headroom - 3 * MARGIN`` bits (51 and 35 with
    8 terms); otherwise the step is summed again with the scale set anew. A step summed with a
    kept scale needs no exchange of maxima first: one collective per step.
    """

    MARGIN = 8

    def __init__(self, terms: int, device: torch.device, unit: int = 1) -> None:
        self.bits = headroom(terms)
        self.device = device
        #: The weight most terms have (a micro-batch's samples): ``per_element`` holds it.
        self.unit = unit
        #: Each tensor's elements, and those of the part of its sum this rank receives (its
        #: shard when sharded; None: the whole tensor).
        self.numels = torch.zeros(0, dtype=torch.int64)
        self.local_numels: torch.Tensor | None = None
        self.exponents: torch.Tensor | None = None
        #: Per element: 2**e * ``unit`` (``scaled``'s scale).
        self.per_element = torch.zeros(0, dtype=torch.float64)
        #: Per element of the part this rank receives: 2**-e / ``_divisor`` (``factors``).
        self.inverse = torch.zeros(0, dtype=torch.float64)
        self._divisor = 1

    def set(self, exponents: torch.Tensor | None) -> None:
        self.exponents = exponents
        if exponents is not None:
            unit = torch.full((len(exponents),), float(self.unit), dtype=torch.float64,
                              device=self.device)  # fmt: skip
            scale = torch.ldexp(unit, exponents.to(self.device))
            self.per_element = torch.repeat_interleave(scale, self.numels.to(self.device))
            self._divisor = 1
            self.inverse = self._received(1)

    def _received(self, divisor: int) -> torch.Tensor:
        """2**-e / ``divisor`` (one float64 rounding per tensor) for each element this rank
        receives."""
        if self.exponents is None:
            return torch.zeros(0, dtype=torch.float64, device=self.device)
        one = torch.ones(len(self.exponents), dtype=torch.float64, device=self.device)
        inverse = torch.ldexp(one, -self.exponents.to(self.device)) / divisor
        local = self.numels if self.local_numels is None else self.local_numels
        return torch.repeat_interleave(inverse, local.to(self.device))

    def factors(self, divisor: int) -> torch.Tensor:
        """Per element received, 2**-e / ``divisor`` (float64): ``dequantize``'s factors,
        kept while the scales and the divisor (a step's samples) stay."""
        if divisor != self._divisor:
            self.inverse = self._received(divisor)
            self._divisor = divisor
        return self.inverse

    def recenter(self, maxima: torch.Tensor) -> None:
        """Scales that leave ``MARGIN`` bits above each tensor's largest term (a tensor whose
        terms are all zero gets 1)."""
        maxima = maxima.to(torch.float64)
        usable = torch.isfinite(maxima) & (maxima > 0)
        _, exponent = torch.frexp(torch.where(usable, maxima, torch.ones_like(maxima)))
        shift = self.bits - self.MARGIN - exponent.to(torch.int64)
        self.set(torch.where(usable, shift, torch.zeros_like(shift)))

    def flags(self, maxima: torch.Tensor) -> torch.Tensor:
        """On ``maxima``'s device, no host read: (finite, fits, coarse) as float64 0/1, for
        ``verdict_of``. Terms up to ``maxima`` fit in fixed point at these scales; coarse:
        the scales keep too few bits of some maximum."""
        finite = torch.isfinite(maxima).all()
        if self.exponents is None:
            no = torch.zeros((), dtype=torch.bool, device=maxima.device)
            return torch.stack([finite, no, no]).to(torch.float64)
        scaled = torch.ldexp(maxima.to(torch.float64), self.exponents)
        fits = (scaled < 2.0**self.bits).all()
        coarse = ((maxima > 0) & (scaled < 2.0 ** (self.bits - 3 * self.MARGIN))).any()
        return torch.stack([finite, fits, coarse]).to(torch.float64)

    @staticmethod
    def verdict_of(flags: list[float]) -> tuple[bool, bool, bool]:
        """``flags``, read to the host: finite, fits, holds (fits, with enough bits)."""
        finite, fits, coarse = (bool(flag) for flag in flags)
        fitting = finite and fits
        return finite, fitting, fitting and not coarse

    def verdict(self, maxima: torch.Tensor) -> tuple[bool, bool, bool]:
        """Whether ``maxima`` are finite, whether terms up to them fit in fixed point at
        these scales, and whether the scales also keep enough bits of them (``holds``), in
        one read to the host."""
        return self.verdict_of(self.flags(maxima).tolist())

    def fits(self, maxima: torch.Tensor) -> bool:
        """Whether terms up to ``maxima`` fit in fixed point at these scales."""
        return self.verdict(maxima)[1]

    def holds(self, maxima: torch.Tensor) -> bool:
        """Whether these scales fit the agreed ``maxima`` and keep enough bits of them."""
        return self.verdict(maxima)[2]


def largest_magnitudes(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's largest magnitude (NaN if it holds one, 0 if empty), float64. On a GPU
    one fused pass (torch's foreach infinity norm, as clip_grad_norm_ uses: two kernels per
    tensor cost more in launches than in work); on the CPU each tensor's smallest and largest
    element in one pass (no copy of its magnitudes; the foreach norm falls back to a
    per-tensor norm there, eight times slower)."""
    filled = [t if t.numel() else t.new_zeros(1) for t in tensors]
    if filled and filled[0].device.type == "cuda":
        return torch.stack(torch._foreach_norm(filled, math.inf)).to(torch.float64)
    if not filled:
        return torch.zeros(0, dtype=torch.float64)
    ends = torch.stack([torch.stack(torch.aminmax(t)).to(torch.float64) for t in filled])
    return ends.abs_().amax(1)


def as_slots(values: torch.Tensor) -> torch.Tensor:
    """Float64 ``values`` as int64 bit patterns (a sum with zeros keeps every bit)."""
    return values.to(torch.float64).contiguous().view(torch.int64)


def from_slots(slots: torch.Tensor) -> torch.Tensor:
    """The float64 values whose bit patterns ``as_slots`` made."""
    return slots.contiguous().view(torch.float64)


__all__ = [
    "Scale",
    "as_slots",
    "dequantize",
    "from_slots",
    "headroom",
    "largest_magnitudes",
    "quantize",
    "scaled",
]
