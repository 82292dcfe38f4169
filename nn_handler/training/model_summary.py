"""The model summary printed at the start (Lightning's ModelSummary, depth 1): the model's
parameters, trainable and frozen, and the memory they take, then the same per top-level
module. Counts are the whole model's under every strategy (a sharded parameter counts its
full size; a meta-device model its planned one)."""

from __future__ import annotations

from torch import nn

#: Top-level modules listed at most (then one line says how many more).
MOST = 20


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _counts(module: nn.Module) -> tuple[int, int, int]:
    """(parameters, trainable ones, their bytes), each parameter once."""
    total = trainable = nbytes = 0
    for param in module.parameters():
        count = param.numel()
        total += count
        trainable += count if param.requires_grad else 0
        nbytes += count * param.element_size()
    return total, trainable, nbytes


def _described(total: int, trainable: int) -> str:
    if total == 0:
        return "no parameters"
    if trainable == total:
        return f"{total:,} parameters (all trainable)"
    return f"{total:,} parameters ({trainable:,} trainable, {total - trainable:,} frozen)"


def summary_lines(module: nn.Module) -> list[str]:
    """The summary: one heading line, then one line per top-level module."""
    total, trainable, nbytes = _counts(module)
    lines = [f"model: {type(module).__name__}, {_described(total, trainable)}, {_size(nbytes)}"]
    children = list(module.named_children())
    for name, child in children[:MOST]:
        count, learned, size = _counts(child)
        memory = f", {_size(size)}" if count else ""
        lines.append(f"  {name}: {type(child).__name__}, {_described(count, learned)}{memory}")
    if len(children) > MOST:
        lines.append(f"  ... and {len(children) - MOST} more modules")
    return lines


__all__ = ["summary_lines"]
