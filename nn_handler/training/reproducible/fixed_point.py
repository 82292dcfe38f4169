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
from collections.abc import Sequence

import torch

#: The largest sum of magnitudes an int64 holds with a bit to spare.
_BITS = 62


def headroom(terms: int) -> int:
    """Bits left for the largest term when ``terms`` terms are summed."""
    return _BITS - max(0, math.ceil(math.log2(max(terms, 1))))


def scaled(
    parts: Sequence[torch.Tensor], multipliers: Sequence[float], out: torch.Tensor
) -> torch.Tensor:
    """``round(parts[i] * multipliers[i])``, the tensors flattened one after another into
    ``out`` (float64, as many elements as the parts): exact integer values. Exact up to the
    rounding when each multiplier is an integer below 2**29 times a power of two (``Scale.
    multipliers``): a float32 times it fits a float64's 53 bits. One copy and one multiply
    per tensor, each a single foreach call (no per-element scale is read or kept)."""
    if parts:
        views = torch.split(out, [p.numel() for p in parts])
        torch._foreach_copy_(views, [p.reshape(-1) for p in parts])
        torch._foreach_mul_(views, list(multipliers))
    return out.round_()


#: Elements converted at once by ``add_as_int64`` (32 MiB of int64).
CHUNK = 1 << 22


def add_as_int64(accumulator: torch.Tensor, values: torch.Tensor) -> None:
    """``accumulator += values`` (int64 += float64 holding exact integers), converted a chunk
    at a time: a whole int64 copy of ``values`` would hold as much memory as the accumulator
    (torch refuses a float added into an int64 tensor in place). Integer sums are exact in
    any order: the same bits as one conversion."""
    for into, part in zip(torch.split(accumulator, CHUNK), torch.split(values, CHUNK), strict=True):
        into.add_(part.to(torch.int64))


def quantize(parts: Sequence[torch.Tensor], multipliers: Sequence[float]) -> torch.Tensor:
    """``scaled`` as int64."""
    total = sum(p.numel() for p in parts)
    device = parts[0].device if parts else None
    out = torch.empty(total, dtype=torch.float64, device=device)
    return scaled(parts, multipliers, out).to(torch.int64)


def dequantize(
    total: torch.Tensor,
    sizes: Sequence[int],
    factors: Sequence[float],
    out: torch.Tensor | None = None,
    work: torch.Tensor | None = None,
) -> torch.Tensor:
    """The value of the fixed-point ``total`` (tensors of ``sizes`` elements one after
    another) times each tensor's factor (the scale's inverse over the divisor, ``Scale.
    factors``), computed in float64 (in ``work``) and rounded into ``out`` (any float dtype;
    default: ``work``). A copy, a foreach multiply, a copy: on the CPU torch's mixed-dtype
    multiply (int64 by float64 into float32) is five times slower."""
    if work is None:
        work = torch.empty(total.shape, dtype=torch.float64, device=total.device)
    work.copy_(total)
    torch._foreach_mul_(list(torch.split(work, list(sizes))), list(factors))
    return work if out is None else out.copy_(work)


class Scale:
    """Each tensor's fixed-point exponent ``e`` (its scale ``2**e``), kept from step to step.

    Set from a tensor's largest term (the maxima every rank agreed on, so every rank and every
    world size makes the same choice), it leaves ``MARGIN`` bits of room above that term. It
    ``holds`` for a later step while that step's largest term fits (below
    ``2**headroom(terms)``) and keeps at least ``headroom - 3 * MARGIN`` bits (51 and 35 with
    8 terms); otherwise the step is summed again with the scale set anew. A step summed with a
    kept scale needs no exchange of maxima first: one collective per step. The scales apply
    per tensor (``multipliers``, ``factors``: one float each), so nothing per element is kept.
    """

    MARGIN = 8

    def __init__(self, terms: int, device: torch.device) -> None:
        self.bits = headroom(terms)
        self.device = device  # where the exponents live (the maxima's device)
        self.exponents: torch.Tensor | None = None
        self._host: torch.Tensor = torch.zeros(0, dtype=torch.int64)
        self._multipliers: dict[int, list[float]] = {}
        self._factors: dict[int, list[float]] = {}

    def set(self, exponents: torch.Tensor | None) -> None:
        """The scales' exponents (one per tensor; None: none agreed yet). Read to the host
        once here (a run's first step, a rescale, a resume), never per step."""
        self.exponents = exponents
        self._host = (
            exponents.to("cpu", torch.int64)
            if exponents is not None
            else torch.zeros(0, dtype=torch.int64)
        )
        self._multipliers.clear()
        self._factors.clear()

    def multipliers(self, weight: int) -> list[float]:
        """Each tensor's ``weight * 2**e`` (``scaled``'s multipliers for a term of
        ``weight``, its samples), kept per weight until the scales change."""
        found = self._multipliers.get(weight)
        if found is None:
            weights = torch.full(self._host.shape, float(weight), dtype=torch.float64)
            found = self._multipliers[weight] = torch.ldexp(weights, self._host).tolist()
        return found

    def factors(self, divisor: int) -> list[float]:
        """Each tensor's ``2**-e / divisor`` (float64: one rounding; ``dequantize``'s
        factors), kept per divisor (a step's samples) until the scales change."""
        found = self._factors.get(divisor)
        if found is None:
            one = torch.ones(self._host.shape, dtype=torch.float64)
            found = self._factors[divisor] = (torch.ldexp(one, -self._host) / divisor).tolist()
        return found

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
    "CHUNK",
    "Scale",
    "add_as_int64",
    "as_slots",
    "dequantize",
    "from_slots",
    "headroom",
    "largest_magnitudes",
    "quantize",
    "scaled",
]
