"""Flatten nested dicts/lists/tuples of tensors and numbers into tensors, and back.

Collectives move a few large buffers, not many small ones: leaves are flattened, grouped by
transport dtype and concatenated, so a nested metrics dict costs one collective per dtype.
"""

from __future__ import annotations

import contextlib
import numbers
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from nn_handler.errors import ConfigError


@dataclass(frozen=True)
class Leaf:
    """How to rebuild one leaf: a tensor (with its device, dtype, shape) or a Python number."""

    kind: str  # "tensor" | "int" | "float"
    device: torch.device | None = None
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.kind == "tensor":
            dtype = str(self.dtype).replace("torch.", "")
            return f"{dtype}{list(self.shape)}"
        return self.kind


# A spec is a Leaf, or ("dict", keys, children), ("list", children), ("tuple", children).
Spec = Any


def flatten(data: Any, path: str = "data") -> tuple[list[torch.Tensor], Spec]:
    """Split ``data`` into tensor leaves (numbers become 0-d tensors) and a spec to rebuild it.

    Raises ``ConfigError`` naming the path of the first unsupported value.
    """
    leaves: list[torch.Tensor] = []

    def visit(value: Any, where: str) -> Spec:
        if isinstance(value, torch.Tensor):
            leaves.append(value.detach())
            return Leaf("tensor", value.device, value.dtype, tuple(value.shape))
        if isinstance(value, bool | numbers.Integral):
            leaves.append(torch.tensor(int(value), dtype=torch.int64))
            return Leaf("int")
        if isinstance(value, numbers.Real):
            leaves.append(torch.tensor(float(value), dtype=torch.float64))
            return Leaf("float")
        if isinstance(value, Mapping):
            keys = list(value.keys())
            with contextlib.suppress(TypeError):  # unorderable keys keep insertion order
                keys.sort()
            children = [visit(value[k], f"{where}[{k!r}]") for k in keys]
            return ("dict", keys, children)
        if isinstance(value, list | tuple):
            children = [visit(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return ("list" if isinstance(value, list) else "tuple", children)
        raise ConfigError(
            f"{where} is a {type(value).__name__}; collectives take tensors, numbers and nested "
            f"dicts/lists/tuples of them. Use the *_object collectives for other Python objects."
        )

    spec = visit(data, path)
    return leaves, spec


def unflatten(spec: Spec, values: Iterator[torch.Tensor]) -> Any:
    """Rebuild the structure described by ``spec`` from reduced tensors, in leaf order.

    Tensors go back to their original device; ``int``/``float`` leaves become Python numbers
    (an int leaf whose result is floating, as after a mean, becomes a float).
    """
    if isinstance(spec, Leaf):
        value = next(values)
        if spec.kind == "tensor":
            return value.to(spec.device) if value.device != spec.device else value
        number = value.item()
        return number if spec.kind == "int" or isinstance(number, float) else float(number)
    kind = spec[0]
    if kind == "dict":
        return {key: unflatten(child, values) for key, child in zip(spec[1], spec[2], strict=True)}
    items = [unflatten(child, values) for child in spec[1]]
    return items if kind == "list" else tuple(items)


def describe(spec: Spec) -> str:
    """A compact, deterministic text of the structure, dtypes and shapes (for debug checks)."""
    if isinstance(spec, Leaf):
        return spec.describe()
    if spec[0] == "dict":
        inner = ", ".join(f"{k!r}: {describe(c)}" for k, c in zip(spec[1], spec[2], strict=True))
        return "{" + inner + "}"
    inner = ", ".join(describe(c) for c in spec[1])
    return f"[{inner}]" if spec[0] == "list" else f"({inner})"


def packed_apply(
    leaves: list[torch.Tensor],
    device: torch.device,
    transport: Callable[[torch.dtype], torch.dtype],
    collective: Callable[[torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """Run ``collective`` once per transport dtype on the concatenated leaves; split the results.

    Leaves are moved to ``device`` and cast to ``transport(dtype)``; results keep the transport
    dtype and stay on ``device`` (the caller restores devices when unflattening).
    """
    groups: dict[torch.dtype, list[int]] = {}
    for index, leaf in enumerate(leaves):
        groups.setdefault(transport(leaf.dtype), []).append(index)
    results: list[torch.Tensor | None] = [None] * len(leaves)
    for dtype in sorted(groups, key=str):  # the same order on every rank
        indices = groups[dtype]
        parts = [leaves[i].to(device=device, dtype=dtype).reshape(-1) for i in indices]
        buffer = parts[0].clone() if len(parts) == 1 else torch.cat(parts)
        reduced = collective(buffer)
        offset = 0
        for i, part in zip(indices, parts, strict=True):
            results[i] = reduced[offset : offset + part.numel()].view(leaves[i].shape)
            offset += part.numel()
    return [r for r in results if r is not None]
