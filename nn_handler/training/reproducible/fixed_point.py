"""Fixed-point sums whose result does not depend on the order of their terms.

A floating-point sum rounds after every addition, so its result depends on the order of the
terms (and so on how many ranks summed them, and in which tree). An int64 sum is exact, in any
order. A gradient becomes integers with a scale chosen per tensor from the largest magnitude
any term has (agreed over ranks): ``q = round(g * n * 2**e)``, where ``n`` weighs the term
(its samples) and ``e`` is the largest exponent for which ``terms`` such integers cannot
overflow 62 bits. The sum of the ``q`` is exact; it is turned back into a float once.

What it keeps: each term's elements are rounded to a multiple of ``2**-e``, which is
``2**-(62 - ceil(log2(terms)))`` of the tensor's largest term element (59 bits for 8 terms):
every element within 2**-35 of the largest keeps all its float32 bits, and no element is off
by more than half a unit of that last place. Exact transport of other values (losses,
statistics): float64 bit patterns viewed as int64 in slots only one rank fills, so the sum
across ranks adds zeros to them and keeps every bit.
"""

from __future__ import annotations

import math

import torch

#: The largest sum of magnitudes an int64 holds with a bit to spare.
_BITS = 62


def headroom(terms: int) -> int:
    """Bits left for the largest term when ``terms`` terms are summed."""
    return _BITS - max(0, math.ceil(math.log2(max(terms, 1))))


def scales(maxima: torch.Tensor, terms: int) -> torch.Tensor:
    """The power-of-two scale of each tensor (float64): ``2**e`` with ``maxima * 2**e <
    2**headroom(terms)``; 1 for a tensor whose terms are all zero (or not finite)."""
    maxima = maxima.to(torch.float64)
    usable = torch.isfinite(maxima) & (maxima > 0)
    _, exponent = torch.frexp(torch.where(usable, maxima, torch.ones_like(maxima)))
    shift = torch.where(usable, headroom(terms) - exponent, torch.zeros_like(exponent))
    return torch.ldexp(torch.ones_like(maxima), shift)


def quantize(values: torch.Tensor, weight: int, scale: torch.Tensor) -> torch.Tensor:
    """``round(values * weight * scale)`` as int64 (``scale`` per element, float64). Exact up
    to the rounding: a float32 times an integer below 2**29 times a power of two fits a
    float64's 53 bits."""
    return torch.round(values.to(torch.float64) * (scale * weight)).to(torch.int64)


def dequantize(total: torch.Tensor, scale: torch.Tensor, divisor: int) -> torch.Tensor:
    """The float64 value of the fixed-point ``total``, divided by ``divisor``."""
    return total.to(torch.float64) / scale / divisor


def as_slots(values: torch.Tensor) -> torch.Tensor:
    """Float64 ``values`` as int64 bit patterns (a sum with zeros keeps every bit)."""
    return values.to(torch.float64).contiguous().view(torch.int64)


def from_slots(slots: torch.Tensor) -> torch.Tensor:
    """The float64 values whose bit patterns ``as_slots`` made."""
    return slots.contiguous().view(torch.float64)


__all__ = ["as_slots", "dequantize", "from_slots", "headroom", "quantize", "scales"]
