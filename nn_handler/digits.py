"""The digits task of the demo, tests and benchmarks: scikit-learn's bundled 8x8 handwritten
digits (1,797 images shipped inside scikit-learn, no download) and a small CNN for them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from nn_handler.errors import ConfigError


def digits_datasets(
    val_fraction: float = 0.2, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """(train, validation) TensorDatasets of (1x8x8 float images in [0, 1], int64 labels),
    split reproducibly by ``seed``. Needs scikit-learn: ``pip install 'nn_handler[demo]'``."""
    if not 0.0 < val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}.")
    pixels, targets = _bundled_digits()
    images = torch.as_tensor(pixels, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.as_tensor(targets, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(labels) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])


def _bundled_digits() -> tuple[Any, Any]:
    """(pixels (n, 64), labels (n,)) as numpy arrays: the CSV scikit-learn ships, read as its
    ``load_digits`` reads it, without importing scikit-learn (about 1.3 s of CPU in every rank
    that loads the digits); ``load_digits`` itself if the file is not where scikit-learn keeps
    it."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        raise ConfigError(
            "the digits dataset comes with scikit-learn: pip install 'nn_handler[demo]'."
        )
    bundled = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    if bundled.is_file():
        import numpy as np

        table = np.loadtxt(bundled, delimiter=",")
        if table.ndim == 2 and table.shape[1] == 65:
            return table[:, :-1], table[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    data = load_digits()
    return data.data, data.target


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, max-pooling and two linear layers (about 40k parameters)."""

    def __init__(self, batchnorm: bool = False, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.BatchNorm2d(16) if batchnorm else nn.Identity(),
            nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.BatchNorm2d(32) if batchnorm else nn.Identity(),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.head(self.features(x))
        return output


__all__ = ["DigitsCNN", "digits_datasets"]
