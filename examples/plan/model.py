"""A 1.1-billion-parameter language model for `nn-handler plan` (docs/planning.md): built on
the meta device by the planner, never allocated.

    nn-handler plan examples/plan/hsdp_512.yaml --world 512 --nodes 64 \\
        --model examples.plan.model:language_model --device-memory 80GiB
"""

from __future__ import annotations

import torch
from torch import nn

VOCABULARY, WIDTH, LAYERS, HEADS, FEEDFORWARD, LENGTH, MICRO_BATCH = (
    32_000,
    2048,
    20,
    16,
    8192,
    2048,
    2,
)


class LanguageModel(nn.Module):
    """Token embeddings, ``LAYERS`` transformer blocks (each one FSDP unit), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCABULARY, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, HEADS, FEEDFORWARD, batch_first=True, norm_first=True)
            for _ in range(LAYERS)
        )
        self.head = nn.Linear(WIDTH, VOCABULARY, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def language_model() -> tuple[nn.Module, torch.Tensor]:
    """The model, and one micro-batch's inputs (for the activations)."""
    return LanguageModel(), torch.zeros(MICRO_BATCH, LENGTH, dtype=torch.long)


def language_model_only() -> nn.Module:
    """The model alone: its plan counts no activations."""
    return LanguageModel()
