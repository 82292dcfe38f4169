"""The activations one micro-batch keeps for backward, estimated without allocating: the
model's twin on the meta device (same shapes, no storage) runs one forward on the batch's
shapes while autograd's saved tensors are counted, per block, for each activation
checkpointing mode (none: everything saved; full: each block's input, plus one block's
activations while it is recomputed; selective: also the outputs of each block's linear and
attention layers, its matrix products)."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from nn_handler.strategies.activation_checkpointing import PRODUCT_MODULES
from nn_handler.strategies.memory_plan import Activations


def meta_twin(module: nn.Module) -> nn.Module | None:
    """A copy of ``module`` whose parameters and buffers are on the meta device (nothing
    allocated), or None when the module cannot be copied."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        twin = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(twin, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else twin
        )
    try:
        return copy.deepcopy(module, memo)
    except Exception:  # a module holding something that cannot be copied (a lock, a file)
        return None


def _size(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def estimate_activations(twin: nn.Module, block_names: Sequence[str], inputs: Any) -> Activations:
    """The activations of one training forward of ``twin`` (a meta twin) on ``inputs``
    (moved to the meta device), with the blocks named ``block_names``."""
    blocks = [twin.get_submodule(name) for name in block_names]
    parameters = {id(p) for p in twin.parameters()}
    current: list[int | None] = [None]
    saved: dict[int | None, int] = {}
    products: dict[int | None, int] = {}
    entered = [0] * len(blocks)
    seen: dict[int, torch.Tensor] = {}  # holds them, so that ids stay unique

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        base = tensor._base if tensor._base is not None else tensor
        if id(base) in parameters or id(tensor) in parameters or id(base) in seen:
            return tensor
        seen[id(base)] = base
        saved[current[-1]] = saved.get(current[-1], 0) + _size(base)
        return tensor

    def enter(index: int) -> Any:
        def hook(_module: nn.Module, args: Any) -> None:
            current.append(index)
            leaves, _ = tree_flatten(args)
            entered[index] += sum(_size(t) for t in leaves if isinstance(t, torch.Tensor))

        return hook

    def leave(_module: nn.Module, _args: Any, _out: Any) -> None:
        current.pop()

    def product(_module: nn.Module, _args: Any, out: Any) -> None:
        leaves, _ = tree_flatten(out)
        size = sum(_size(t) for t in leaves if isinstance(t, torch.Tensor))
        products[current[-1]] = products.get(current[-1], 0) + size

    handles = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave) for b in blocks]
    handles += [
        m.register_forward_hook(product)
        for b in blocks
        for m in b.modules()
        if isinstance(m, PRODUCT_MODULES)
    ]
    meta_inputs = tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, inputs)
    try:
        twin.train()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            twin(meta_inputs)
    finally:
        for handle in handles:
            handle.remove()
    everything = sum(saved.values())
    outside = saved.get(None, 0)
    in_blocks = [saved.get(i, 0) for i in range(len(blocks))]
    recompute = max(in_blocks, default=0)
    full = outside + sum(entered) + recompute
    selective = full + sum(products.get(i, 0) for i in range(len(blocks)))
    return Activations(
        none=everything, full=min(full, everything), selective=min(selective, everything)
    )


__all__ = ["estimate_activations", "meta_twin"]
