"""The models and data the benchmarks train: tiny ones (where a framework's own Python cost
shows) and realistic ones (where allocation patterns and real layers show)."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 10),
    )


class BasicBlock(nn.Module):
    """The CIFAR ResNet block: two 3x3 convolutions with BatchNorm and a shortcut."""

    def __init__(self, inputs: int, outputs: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inputs, outputs, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(outputs)
        self.conv2 = nn.Conv2d(outputs, outputs, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(outputs)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or inputs != outputs:
            self.shortcut = nn.Sequential(
                nn.Conv2d(inputs, outputs, 1, stride, bias=False), nn.BatchNorm2d(outputs)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


def resnet8() -> nn.Module:
    """ResNet-8 for 3x32x32 images (He et al.'s CIFAR family, one block per stage, 78k
    parameters, BatchNorm everywhere)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        BasicBlock(16, 16, 1),
        BasicBlock(16, 32, 2),
        BasicBlock(32, 64, 2),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


class SmallTransformer(nn.Module):
    """Two TransformerEncoderLayers (d_model 128, 4 heads, feed-forward 512) over sequences
    of 64 tokens from a 1,000-word vocabulary, mean-pooled into 10 classes."""

    def __init__(self, vocabulary: int = 1000, width: int = 128, length: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.position = nn.Parameter(torch.zeros(1, length, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(tokens) + self.position)
        return self.head(hidden.mean(dim=1))  # type: ignore[no-any-return]


def transformer() -> nn.Module:
    return SmallTransformer()


def dataset(shape: tuple[int, ...], samples: int) -> TensorDataset:
    """Random inputs of ``shape`` (float) and labels in 0..9, the same for every variant."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, *shape, generator=generator)
    y = torch.randint(0, 10, (samples,), generator=generator)
    return TensorDataset(x, y)


def token_dataset(length: int, samples: int, vocabulary: int = 1000) -> TensorDataset:
    """Random token sequences and labels in 0..9."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randint(0, vocabulary, (samples, length), generator=generator)
    y = torch.randint(0, 10, (samples,), generator=generator)
    return TensorDataset(x, y)
