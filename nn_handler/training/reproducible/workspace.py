"""Workspace: buffers kept from step to step by the reproducible mode's steps."""

from __future__ import annotations

import torch


class Workspace:
    """Buffers kept from step to step: a fresh multi-megabyte allocation per step costs
    thousands of page faults (see optimization.py)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        #: The buffers, by name.
        self.kept: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``shape`` (its first dimension may be larger: a prefix is returned)."""
        kept = self.kept.get(name)
        fits = kept is not None and kept.dtype == dtype and kept.shape[1:] == shape[1:]
        if kept is None or not fits or kept.shape[0] < shape[0]:
            kept = torch.empty(shape, dtype=dtype, device=self.device)
            self.kept[name] = kept
        return kept[: shape[0]]


__all__ = ["Workspace"]
