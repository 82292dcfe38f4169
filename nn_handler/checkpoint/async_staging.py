"""CachedStager: the CPU buffers a sharded checkpoint's asynchronous save copies each rank's
state into, kept from one save to the next (checkpoint/sharded.py uses it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch


class CachedStager:
    """Copies a state for an asynchronous save into CPU buffers kept between saves: the first
    save allocates them (pinned when CUDA is there), later ones only copy, so returning to
    training costs one copy of this rank's state, without fresh allocations. The buffers are
    rebuilt when the state's layout changes. The writer waits for the previous save before
    staging the next one, so a buffer is never overwritten while it is written."""

    def __init__(self) -> None:
        self._cache: dict[str, Any] | None = None
        self._layout: list[tuple[Any, ...]] = []

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = _layout(state_dict)
        if self._cache is None or layout != self._layout:
            pinned = torch.cuda.is_available()
            self._cache = _create_cpu_state_dict(state_dict, pin_memory=pinned)
            self._layout = layout
        return _copy_state_dict(state_dict, self._cache, type_check=False)


def _layout(value: Any, path: str = "") -> list[tuple[Any, ...]]:
    """Every tensor's path, local shape and dtype (the buffers a staged copy needs)."""
    if isinstance(value, Mapping):
        return [item for key, v in value.items() for item in _layout(v, f"{path}.{key}")]
    if isinstance(value, (list, tuple)):
        return [item for i, v in enumerate(value) for item in _layout(v, f"{path}.{i}")]
    if isinstance(value, torch.Tensor):
        local = value.to_local() if hasattr(value, "to_local") else value
        return [(path, tuple(local.shape), local.dtype)]
    return [(path, type(value).__name__)]


__all__ = ["CachedStager"]
