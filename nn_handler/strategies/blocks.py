"""The model's blocks: the units FSDP2 shards one by one, activation checkpointing recomputes
and ``compile: blocks`` compiles, chosen once by class name or by size (FsdpConfig)."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from nn_handler.config.training import FsdpConfig
from nn_handler.errors import ConfigError


def shard_blocks(module: nn.Module, blocks: Iterable[str], min_params: int) -> list[nn.Module]:
    """The submodules to treat one by one, bottom-up (children before parents), never the
    root: those whose class name is in ``blocks``, or, when ``blocks`` is empty, the innermost
    modules of at least ``min_params`` parameters (a module holding one is not taken)."""
    names = set(blocks)
    chosen: list[nn.Module] = []

    def visit(current: nn.Module) -> bool:  # whether a block lies at or under ``current``
        below = [visit(child) for child in current.children()]
        if current is module:
            return any(below)
        if names:
            take = type(current).__name__ in names
        else:
            own = sum(p.numel() for p in current.parameters())
            take = own >= min_params and not any(below)
        if take:
            chosen.append(current)
        return take or any(below)

    visit(module)
    return chosen


def blocks_of(module: nn.Module, settings: FsdpConfig, purpose: str) -> list[nn.Module]:
    """``shard_blocks`` under ``settings``; a ConfigError (naming ``purpose`` and the model's
    module classes) when ``settings.blocks`` names classes the model does not have."""
    found = shard_blocks(module, settings.blocks, settings.min_params)
    if settings.blocks and not found:
        present = sorted({type(m).__name__ for m in module.modules()})
        raise ConfigError(
            f"fsdp.blocks names {settings.blocks} ({purpose}), and the model has no such "
            f"module; its module classes are {present}."
        )
    return found


__all__ = ["blocks_of", "shard_blocks"]
