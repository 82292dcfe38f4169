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


def val_check_every(batches: int | None, interval: int | float, accumulate: int) -> int | None:
    """Training batches between two validations inside an epoch of ``batches`` batches (None:
    unknown), for ``val_check_interval`` (an int number of batches, or a float fraction of the
    epoch): always a whole number of accumulation windows, at least one. None when the epoch
    ends before the first one (validation then runs at the end of the epoch only)."""
    if isinstance(interval, float):
        if batches is None:
            raise ValueError("a fraction of an epoch of unknown length")
        every = max(accumulate, int(batches * interval) // accumulate * accumulate)
    else:
        every = interval
    if every % accumulate:
        raise ValueError(f"{every} batches end inside an accumulation window of {accumulate}")
    return every if batches is None or every < batches else None


__all__ = ["limited", "optimizer_steps_per_epoch", "stepping_batches", "val_check_every", "window"]
