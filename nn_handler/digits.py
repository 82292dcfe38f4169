"""The digits task of the demo, tests and benchmarks: scikit-learn's bundled 8x8 handwritten
digits (1,797 images shipped inside scikit-learn, no download) and a small CNN for them."""

from __future__ import annotations

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
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ConfigError(
            "the digits dataset comes with scikit-learn: pip install 'nn_handler[demo]'."
        ) from error
    data = load_digits()
    images = torch.as_tensor(data.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.as_tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(labels) * val_fraction)
    val, train = order[:n_val], order[n_val:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])


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
