"""``seed_everything``: one call that seeds Python's, NumPy's and torch's generators (Lightning's
name, for the scripts users bring from it)."""

from __future__ import annotations

import random

import numpy as np
import torch

from nn_handler.errors import ConfigError


def seed_everything(seed: int) -> int:
    """Seed ``random``, NumPy's global generator and torch (CPU and every CUDA device) with
    ``seed``; returns it. Call it on every rank with the same seed for identical initial
    weights (the loaders' shuffles and worker seeds come from ``loader.seed``). Unlike
    Lightning's, it writes no environment variable."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed_everything needs an int in [0, 2**32), got {seed!r}.")
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # every device's generator, CUDA included
    return seed


__all__ = ["seed_everything"]
