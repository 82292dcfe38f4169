"""Optimizer states in either of torch's two layouts, so a checkpoint moves between strategies.

``optimizer.state_dict()`` (single device, DDP) keys each parameter's state by its index in
the optimizer's groups; ``torch.distributed.checkpoint.state_dict`` (FSDP2) keys it by the
parameter's name in the model. Both convert through the optimizer's own parameter order (the
order torch's ``load_state_dict`` pairs saved and current parameters by).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from nn_handler.errors import CheckpointError


def is_named(state: Mapping[str, Any]) -> bool:
    """Whether ``state`` keys parameters by name (FSDP2's layout) rather than by index."""
    for group in state.get("param_groups") or []:
        params = group.get("params") or []
        if params:
            return isinstance(params[0], str)
    return any(isinstance(key, str) for key in (state.get("state") or {}))


def _names(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The name of every parameter of every group of ``optimizer``, in order."""
    by_id = {id(p): name for name, p in module.named_parameters(remove_duplicate=False)}
    groups = []
    for index, group in enumerate(optimizer.param_groups):
        names = []
        for param in group["params"]:
            if id(param) not in by_id:
                raise CheckpointError(
                    f"a parameter of optimizer group {index} is not a parameter of "
                    f"{type(module).__name__}; its state cannot be named."
                )
            names.append(by_id[id(param)])
        groups.append(names)
    return groups


def _check_groups(saved: list[Any], names: list[list[str]], source: str) -> None:
    sizes = [len(g.get("params") or []) for g in saved]
    if sizes != [len(n) for n in names]:
        raise CheckpointError(
            f"the optimizer state in {source} has groups of {sizes} parameters and this run's "
            f"optimizer {[len(n) for n in names]}; build the optimizer the same way."
        )


def to_named(
    state: Mapping[str, Any],
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    source: str = "checkpoint",
) -> dict[str, Any]:
    """An index-keyed optimizer state (``optimizer.state_dict()``) keyed by parameter name."""
    names = _names(module, optimizer)
    saved_groups = list(state.get("param_groups") or [])
    _check_groups(saved_groups, names, source)
    rename: dict[Any, str] = {}
    groups = []
    for group, group_names in zip(saved_groups, names, strict=True):
        rename.update(zip(group["params"], group_names, strict=True))
        groups.append({**group, "params": list(group_names)})
    values = state.get("state") or {}
    return {"state": {rename[k]: v for k, v in values.items()}, "param_groups": groups}


def to_indexed(
    state: Mapping[str, Any],
    module: nn.Module,
    optimizer: torch.optim.Optimizer,
    source: str = "checkpoint",
) -> dict[str, Any]:
    """A name-keyed optimizer state (FSDP2's) keyed by index, as ``load_state_dict`` takes."""
    names = _names(module, optimizer)
    saved_groups = list(state.get("param_groups") or [])
    _check_groups(saved_groups, names, source)
    index: dict[str, int] = {}
    groups = []
    counter = 0
    for group, group_names in zip(saved_groups, names, strict=True):
        if set(group["params"]) != set(group_names):
            missing = sorted(set(group_names) - set(group["params"]))[:5]
            raise CheckpointError(
                f"the optimizer state in {source} names other parameters than this model's "
                f"(for example {missing} are missing); build the model the same way."
            )
        ids = list(range(counter, counter + len(group_names)))
        counter += len(group_names)
        index.update(zip(group_names, ids, strict=True))
        groups.append({**group, "params": ids})
    values = state.get("state") or {}
    return {"state": {index[k]: v for k, v in values.items()}, "param_groups": groups}


__all__ = ["is_named", "to_indexed", "to_named"]
