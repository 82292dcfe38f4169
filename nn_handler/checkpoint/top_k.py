"""The k best checkpoints by a monitored value (Lightning's ``save_top_k``): which names to
keep and which to drop. Pure bookkeeping; the CheckpointManager does the files."""

from __future__ import annotations

import math
import re
from typing import Any

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def top_name(monitor: str, value: float, epoch: int, step: int, sharded: bool) -> str:
    """``top-e0003-s00000120-val_loss=0.231.pt`` (a folder's, without ``.pt``, when sharded):
    the epoch and step make it unique, the value is for the eye."""
    key = _UNSAFE.sub("_", monitor)
    return f"top-e{epoch:04d}-s{step:08d}-{key}={value:.4g}{'' if sharded else '.pt'}"


class TopK:
    """The ``k`` best (value, name) pairs seen, best first; among equal values the earlier
    stays ahead. ``mode`` 'min': lower is better; 'max': higher."""

    def __init__(self, k: int, mode: str) -> None:
        self.k = k
        self.mode = mode
        self.entries: list[tuple[float, str]] = []

    def _better(self, value: float, than: float) -> bool:
        return value < than if self.mode == "min" else value > than

    def admits(self, value: float) -> bool:
        """Whether ``value`` would be among the k best (never a NaN)."""
        if math.isnan(value):
            return False
        return len(self.entries) < self.k or self._better(value, self.entries[-1][0])

    def add(self, value: float, name: str) -> list[str]:
        """Rank ``name`` (call only when ``admits(value)``); the names that fell out."""
        index = next(
            (i for i, (held, _) in enumerate(self.entries) if self._better(value, held)),
            len(self.entries),
        )
        self.entries.insert(index, (value, name))
        dropped, self.entries = self.entries[self.k :], self.entries[: self.k]
        return [dropped_name for _, dropped_name in dropped]

    def names(self) -> list[str]:
        return [name for _, name in self.entries]

    def state_dict(self) -> list[list[Any]]:
        return [[value, name] for value, name in self.entries]

    def load_state_dict(self, state: Any) -> None:
        self.entries = [(float(value), str(name)) for value, name in state][: self.k]


__all__ = ["TopK", "top_name"]
