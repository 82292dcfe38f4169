"""How many batches and optimizer steps a fit runs: pure arithmetic, property-tested."""

from __future__ import annotations

import math


def limited(batches: int | None, limit: int | float | None) -> int | None:
    """The batches an epoch runs: ``batches`` (None: unknown) cut to ``limit`` (an int number
    of batches, or a float fraction of them, at least one batch when there is any)."""
    if limit is None:
        return batches
    if isinstance(limit, float):
        if batches is None:
            return None  # a fraction of an unknown length: all of it
        return min(batches, max(1, int(batches * limit))) if batches else 0
    return limit if batches is None else min(batches, limit)


def window(index: int, accumulate: int, total: int | None) -> tuple[int, int]:
    """The accumulation window [start, end) that batch ``index`` of an epoch of ``total``
    batches (None: unknown) belongs to: windows of ``accumulate`` micro-batches from the first
    batch, the last one cut at the end of the epoch. The optimizer steps after batch end - 1."""
    start = index - index % accumulate
    end = start + accumulate
    return start, end if total is None else min(end, total)


def optimizer_steps_per_epoch(batches: int, accumulate: int) -> int:
    """Optimizer steps of an epoch of ``batches`` micro-batches (the last window may be
    shorter, and still steps)."""
    return math.ceil(batches / accumulate)


def stepping_batches(
    batches: int,
    accumulate: int,
    epochs: int,
    *,
    epochs_done: int = 0,
    steps_done: int = 0,
    max_steps: int | None = None,
) -> int:
    """The optimizer steps a fit to ``epochs`` epochs takes in total (the steps already done
    included), capped by ``max_steps``: what a per-step LR schedule needs as its length."""
    total = steps_done + (epochs - epochs_done) * optimizer_steps_per_epoch(batches, accumulate)
    return total if max_steps is None else min(total, max_steps)


__all__ = ["limited", "optimizer_steps_per_epoch", "stepping_batches", "window"]
