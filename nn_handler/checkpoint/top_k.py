"""The k best checkpoints by a monitored value (Lightning's ``save_top_k``): which names to
keep and which to drop. Pure bookkeeping; the CheckpointManager does the files."""

from __future__ import annotations

import math
import re
from typing import Any

from nn_handler.errors import CheckpointError

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")
#: What top_name makes: no path separator, never '.' or '..'.
_NAME = re.compile(r"top-e\d{4,}-s\d{8,}-[A-Za-z0-9_.-]+=[A-Za-z0-9_.+-]+")


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
        """The entries a checkpoint kept. Their names are later deleted from the checkpoint
        folder, so each must be a plain top-k file name (never a path out of the folder):
        anything else is a CheckpointError."""
        entries: list[tuple[float, str]] = []
        for entry in state if isinstance(state, list) else [state]:
            value, name = entry if isinstance(entry, list | tuple) and len(entry) == 2 else (0, 0)
            if not (isinstance(name, str) and _NAME.fullmatch(name)) or not isinstance(
                value, int | float
            ):
                raise CheckpointError(
                    f"the checkpoint's top_k entry {entry!r} is not (value, top-k file name): "
                    f"the checkpoint is corrupt or was not written by nn_handler."
                )
            entries.append((float(value), name))
        self.entries = entries[: self.k]


__all__ = ["TopK", "top_name"]
