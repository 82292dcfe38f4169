"""A sharded member's state, rank by rank: what rank i of a live member sends to rank i of a
joining one (transport.py checks the bytes), and how the joiner takes it.

``local_state`` replaces every DTensor with its local shard (a plain tensor: nothing of the
sender's mesh travels) and records each one's layout; ``take_local_state`` compares that layout
with the joiner's own DTensors, then copies each shard into them in place, so the joiner's
parameters (and the optimizer's references to them) stay its own. A member sharded otherwise
(another number of ranks, other placements, another coordinate) is refused: a ConfigError
naming the first tensor and the fix; nothing is resharded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from nn_handler.checkpoint.registry import describe_tensor
from nn_handler.errors import CheckpointError, ConfigError

#: The payload's keys: the state with local shards, and their layouts by path.
STATE, LAYOUT = "state", "layout"


def local_state(state: Any) -> dict[str, Any]:
    """``state`` (nested dicts, lists and tuples) with every DTensor replaced by a copy of its
    local shard, and the layout of each (``LAYOUT``: path -> global shape, placements, mesh
    shape, this rank's coordinate). What rank i of a member sends to rank i of another."""
    layout: dict[str, list[Any]] = {}

    def plain(value: Any, path: str) -> Any:
        if _is_dtensor(value):
            layout[path] = _layout_of(value)
            return value.to_local().detach().clone()
        if isinstance(value, Mapping):
            return {key: plain(item, f"{path}.{key}") for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            items = [plain(item, f"{path}.{i}") for i, item in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return value

    return {STATE: plain(state, ""), LAYOUT: layout}


def take_local_state(template: Any, received: Mapping[str, Any], where: str) -> Any:
    """``template`` (this rank's state: its DTensors sharded like the sender's) filled from
    ``received`` (``local_state``'s payload of the sender's rank holding the same shards):
    tensors copied in place, other values taken. Raises ConfigError when the two members are
    sharded differently, CheckpointError when the payload does not fit the state, both naming
    the first tensor; nothing is changed then."""
    state, layout = received.get(STATE), received.get(LAYOUT)
    if not isinstance(layout, Mapping):
        raise CheckpointError(f"{where}: it has no shard layout; it was refused.")
    pairs = list(_pairs(template, state, "", where))
    mine = {path: _layout_of(ours) for path, ours, _ in pairs if _is_dtensor(ours)}
    for path in sorted(set(mine) | set(layout)):
        theirs = layout.get(path)
        if theirs is None or path not in mine or list(theirs) != mine[path]:
            raise ConfigError(_mismatch(where, path.lstrip("."), mine.get(path), theirs))
    for path, ours, value in pairs:
        local = ours.to_local() if _is_dtensor(ours) else ours
        if not isinstance(value, torch.Tensor) or _is_dtensor(value):
            raise CheckpointError(f"{where}: {path.lstrip('.')} is not a plain tensor; refused.")
        if value.shape != local.shape or value.dtype != local.dtype:
            raise CheckpointError(
                f"{where}: {path.lstrip('.')} is {describe_tensor(value)} there and "
                f"{describe_tensor(local)} here; it was refused."
            )
    for _, ours, value in pairs:
        (ours.to_local() if _is_dtensor(ours) else ours).copy_(value)
    return _filled(template, state)


def _is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor (none exists before torch.distributed.tensor is
    imported, which importing nn_handler does not: it costs every process 0.4 s)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _layout_of(tensor: Any) -> list[Any]:
    mesh = tensor.device_mesh
    return [
        list(tensor.shape),
        [str(placement) for placement in tensor.placements],
        list(mesh.shape),
        list(mesh.get_coordinate() or []),
    ]


def _pairs(ours: Any, theirs: Any, path: str, where: str) -> Iterator[tuple[str, Any, Any]]:
    """(path, this rank's tensor, the received value) for every tensor of ``ours``."""
    if isinstance(ours, torch.Tensor):
        yield path, ours, theirs
    elif isinstance(ours, Mapping):
        if not isinstance(theirs, Mapping) or set(theirs) != set(ours):
            raise CheckpointError(f"{where}: {path.lstrip('.') or 'the state'} differs in its "
                                  f"keys from this member's; it was refused.")  # fmt: skip
        for key, value in ours.items():
            yield from _pairs(value, theirs[key], f"{path}.{key}", where)
    elif isinstance(ours, (list, tuple)):
        if not isinstance(theirs, (list, tuple)) or len(theirs) != len(ours):
            raise CheckpointError(f"{where}: {path.lstrip('.')} differs in length; refused.")
        for i, (value, other) in enumerate(zip(ours, theirs, strict=True)):
            yield from _pairs(value, other, f"{path}.{i}", where)


def _filled(ours: Any, theirs: Any) -> Any:
    """``ours`` with its tensors kept (filled in place) and every other value ``theirs``."""
    if isinstance(ours, torch.Tensor):
        return ours
    if isinstance(ours, Mapping):
        return {key: _filled(value, theirs[key]) for key, value in ours.items()}
    if isinstance(ours, (list, tuple)):
        items = [_filled(value, other) for value, other in zip(ours, theirs, strict=True)]
        return items if isinstance(ours, list) else tuple(items)
    return theirs


def _mismatch(where: str, path: str, mine: list[Any] | None, theirs: Any) -> str:
    if mine is None or theirs is None:
        holder = "this member" if theirs is None else "the sending member"
        return (
            f"{where}: {path} is sharded only on {holder}; every member must build the same "
            f"model with the same fsdp settings."
        )
    if list(theirs[0]) != mine[0]:
        return (
            f"{where}: {path} has the shape {tuple(theirs[0])} on the sending member and "
            f"{tuple(mine[0])} here; every member must build the same model."
        )
    return (
        f"{where}: {path} is sharded over a mesh of {theirs[2]} ranks ({', '.join(theirs[1])}) "
        f"at {theirs[3]} on the sending member and {mine[2]} ({', '.join(mine[1])}) at {mine[3]} "
        f"here. A joining member needs the same shard layout as the live ones: launch every "
        f"member with the same number of ranks (torchrun --nproc-per-node) and fsdp settings."
    )


__all__ = ["LAYOUT", "STATE", "local_state", "take_local_state"]
