"""The bytes of the tensors an nn_handler object holds, found by walking its attributes: an
oracle for its own accounting (``held_bytes``) that lists nothing by name, so a buffer the
accounting forgot is still counted."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

#: Whose objects are walked into: nn_handler's, and FSDP2's per-parameter state (which holds
#: the unsharded gradients the reproducible mode keeps).
OWNERS = ("nn_handler", "torch.distributed.fsdp")


def held_tensor_bytes(root: Any, leave_out: list[torch.Tensor]) -> int:
    """The bytes of every distinct storage of the tensors reachable from ``root`` through
    ``OWNERS``' objects and the containers they hold (never into a model, an optimizer or
    torch's other objects), but those of ``leave_out`` (e.g. the parameters and their grads;
    a DTensor's: its shard's)."""
    skipped = {getattr(t, "_local_tensor", t).untyped_storage().data_ptr() for t in leave_out}
    storages: dict[int, int] = {}
    seen: set[int] = set()
    stack = [root]
    while stack:
        value = stack.pop()
        if id(value) in seen or isinstance(value, (nn.Module, torch.optim.Optimizer, type)):
            continue
        seen.add(id(value))
        if isinstance(value, torch.Tensor):
            if value.is_leaf and value.grad is not None:  # e.g. FSDP2's unsharded gradients
                stack.append(value.grad)
            local = getattr(value, "_local_tensor", value)  # a DTensor's shard
            storage = local.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in skipped:
                storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend(value)
        elif type(value).__module__.startswith(OWNERS):
            stack.extend(vars(value).values() if hasattr(value, "__dict__") else ())
            for name in getattr(type(value), "__slots__", ()):
                stack.append(getattr(value, name, None))
    return sum(storages.values())


__all__ = ["held_tensor_bytes"]
