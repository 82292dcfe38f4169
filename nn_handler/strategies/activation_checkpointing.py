"""Activation checkpointing per block (``fsdp.activation_checkpointing``): a block keeps only
its input (full) or also its matrix products (selective) and recomputes the rest in backward,
with torch.utils.checkpoint (non-reentrant, the RNG state preserved, so dropout draws the
same masks and the gradients are those of the run without it).

The block's ``forward`` is replaced on the instance, not wrapped in another module: the
parameter names, and so every checkpoint, stay the same with and without it."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

from nn_handler.errors import ConfigError

_aten = torch.ops.aten
#: What selective checkpointing keeps: the outputs of matrix products and attention (the
#: expensive operators); everything else in a block is recomputed.
SAVED_OPERATORS = [
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
]


#: The modules whose outputs are such products (for the memory plan's estimate).
PRODUCT_MODULES = (nn.Linear, nn.MultiheadAttention, nn.Bilinear)
_contexts: Any = create_selective_checkpoint_contexts  # untyped in torch


def _selective_contexts() -> Any:
    return _contexts(SAVED_OPERATORS)


def checkpoint_blocks(blocks: Sequence[nn.Module], mode: str) -> None:
    """Make each block recompute its activations in backward ('full' or 'selective'; 'none'
    leaves them). A block with BatchNorm is refused: its recomputed forward would update the
    running statistics a second time."""
    if mode == "none":
        return
    if not blocks:
        raise ConfigError(
            f"fsdp.activation_checkpointing: {mode!r} recomputes each block, and the model has "
            f"no block: name them in fsdp.blocks (for example the transformer layer's class) "
            f"or lower fsdp.min_params."
        )
    for block in blocks:
        norm = next((m for m in block.modules() if _updates_statistics(m)), None)
        if norm is not None:
            raise ConfigError(
                f"fsdp.activation_checkpointing: block {type(block).__name__} holds "
                f"{type(norm).__name__}, whose running statistics the recomputed forward would "
                f"update twice per step; choose blocks without BatchNorm (fsdp.blocks) or set "
                f"activation_checkpointing: none."
            )
        context = _selective_contexts if mode == "selective" else None
        block.__dict__["forward"] = _checkpointed(block.forward, context)


def _checkpointed(forward: Callable[..., Any], context: Callable[[], Any] | None) -> Any:
    options: dict[str, Any] = {"use_reentrant": False}
    if context is not None:
        options["context_fn"] = context

    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, **options, **kwargs)

    return run


def _updates_statistics(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm) and module.track_running_stats


__all__ = ["PRODUCT_MODULES", "SAVED_OPERATORS", "checkpoint_blocks"]
