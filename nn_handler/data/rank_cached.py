"""RankCachedDataset: this rank's shard of a dataset, read once and served from memory."""

from __future__ import annotations

import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate


def _stack(samples: list[Any]) -> Any | None:
    """Stack samples as default_collate would batch them, or None when they are not uniform
    tensors / numbers / arrays (or tuples / dicts of them)."""
    first = samples[0]
    if isinstance(first, torch.Tensor):
        if all(isinstance(s, torch.Tensor) and s.shape == first.shape for s in samples):
            return torch.stack(samples)
        return None
    if isinstance(first, np.ndarray):
        if all(isinstance(s, np.ndarray) and s.shape == first.shape for s in samples):
            return torch.as_tensor(np.stack(samples))
        return None
    if isinstance(first, bool | numbers.Number) and not isinstance(first, complex):
        if all(type(s) is type(first) for s in samples):
            return torch.tensor(samples)
        return None
    if isinstance(first, Mapping):
        keys = list(first)
        if not all(isinstance(s, Mapping) and list(s) == keys for s in samples):
            return None
        columns = {k: _stack([s[k] for s in samples]) for k in keys}
        return None if any(v is None for v in columns.values()) else columns
    if isinstance(first, tuple | list) and not isinstance(first, str):
        if not all(isinstance(s, tuple | list) and len(s) == len(first) for s in samples):
            return None
        parts = [_stack([s[i] for s in samples]) for i in range(len(first))]
        return None if any(p is None for p in parts) else parts
    return None


def _take(stacked: Any, index: torch.Tensor) -> Any:
    if isinstance(stacked, torch.Tensor):
        return torch.index_select(stacked, 0, index)  # about 2x faster than stacked[index]
    if isinstance(stacked, dict):
        return {k: _take(v, index) for k, v in stacked.items()}
    return [_take(v, index) for v in stacked]


def _nbytes(stacked: Any) -> int:
    if isinstance(stacked, torch.Tensor):
        return stacked.numel() * stacked.element_size()
    values = stacked.values() if isinstance(stacked, dict) else stacked
    return sum(_nbytes(v) for v in values)


class RankCachedDataset(Dataset[Any]):
    """The samples at ``indices`` of ``dataset``, read once (``len(indices)`` calls of
    ``dataset[i]``, at construction) and kept in memory.

    Uniform samples (tensors, arrays, numbers, or tuples/dicts of them) are stored stacked, so a
    batch is one indexing operation and looks exactly like default_collate's batch; anything
    else is kept as a list and collated per batch (with ``collate_fn`` when given).
    ``dataset_item[positions]`` with a list of positions returns a whole batch.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        indices: Sequence[int],
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> None:
        self.indices = list(indices)
        samples = [dataset[i] for i in self.indices]
        self.collate_fn = collate_fn or default_collate
        self._stacked = _stack(samples) if samples and collate_fn is None else None
        self._samples: list[Any] | None = None if self._stacked is not None else samples

    @property
    def is_stacked(self) -> bool:
        """True when the shard is held as stacked tensors (batches are one indexing op)."""
        return self._stacked is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by the stacked tensors (0 for list storage, which is not measured)."""
        return _nbytes(self._stacked) if self._stacked is not None else 0

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, key: int | list[int]) -> Any:
        if isinstance(key, int):
            if self._samples is not None:
                return self._samples[key]
            batch = _take(self._stacked, torch.tensor([key]))
            return _unbatch(batch)
        if self._samples is not None:
            return self.collate_fn([self._samples[i] for i in key])
        return _take(self._stacked, torch.as_tensor(key, dtype=torch.int64))


def _unbatch(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[0]
    if isinstance(batch, dict):
        return {k: _unbatch(v) for k, v in batch.items()}
    return [_unbatch(v) for v in batch]


__all__ = ["RankCachedDataset"]
