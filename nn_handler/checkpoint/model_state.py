"""Model weights in and out of checkpoints, whatever wrappers the model had.

DistributedDataParallel prefixes every key with ``module.`` and torch.compile with
``_orig_mod.``; checkpoints hold the plain keys, and loading accepts either form.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nn_handler.errors import CheckpointError

WRAPPER_PREFIXES = ("module.", "_orig_mod.")
_SHOWN = 10


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module inside DistributedDataParallel and torch.compile wrappers."""
    while True:
        if isinstance(model, DistributedDataParallel):
            model = model.module
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            inner = model._orig_mod
            if not isinstance(inner, nn.Module):
                return model
            model = inner
        else:
            return model


def strip_wrapper_prefixes(
    state: Mapping[str, Any], expected: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """``state`` with the ``module.`` / ``_orig_mod.`` prefixes removed from its keys.

    A prefix is removed only when every key carries it, and not when the ``expected`` keys
    (the target model's) carry it too (a submodule really named ``module``).
    """
    result = dict(state)
    changed = True
    while changed and result:
        changed = False
        for prefix in WRAPPER_PREFIXES:
            wanted = (
                expected is not None and expected and all(k.startswith(prefix) for k in expected)
            )
            if not wanted and all(k.startswith(prefix) for k in result):
                result = {k[len(prefix) :]: v for k, v in result.items()}
                changed = True
    return result


def model_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict with plain keys (no DDP or compile prefixes)."""
    return dict(unwrap_model(model).state_dict())


def load_model_state(
    model: nn.Module, state: Mapping[str, Any], strict: bool = True, source: str = "checkpoint"
) -> nn.Module:
    """Load weights into ``model`` (plain, DDP-wrapped or compiled) from a state dict whose keys
    may or may not carry ``module.`` / ``_orig_mod.`` prefixes.

    Strict by default: missing or unexpected keys raise a CheckpointError listing them (pass
    ``strict=False`` to load what matches). Shape mismatches always raise. Returns the plain
    module.
    """
    target = unwrap_model(model)
    expected = target.state_dict()
    weights = strip_wrapper_prefixes(state, expected)
    missing = [k for k in expected if k not in weights]
    unexpected = [k for k in weights if k not in expected]
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"the weights in {source} do not match {type(target).__name__}: "
            f"{_listing('missing', missing)}{_listing('unexpected', unexpected)}"
            f"Check that the model is built the same way, or pass strict=False to load only the "
            f"matching keys."
        )
    mismatched = [
        f"{k}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in weights.items()
        if k in expected and isinstance(v, torch.Tensor) and v.shape != expected[k].shape
    ]
    if mismatched:
        raise CheckpointError(
            f"the weights in {source} have other shapes than {type(target).__name__}'s: "
            + "; ".join(mismatched[:_SHOWN])
        )
    target.load_state_dict(weights, strict=strict)
    return target


def _listing(kind: str, keys: list[str]) -> str:
    if not keys:
        return ""
    shown = ", ".join(keys[:_SHOWN]) + (f", ... ({len(keys)} in all)" if len(keys) > _SHOWN else "")
    return f"{len(keys)} {kind} key(s) [{shown}]. "


__all__ = [
    "WRAPPER_PREFIXES",
    "load_model_state",
    "model_state_dict",
    "strip_wrapper_prefixes",
    "unwrap_model",
]
