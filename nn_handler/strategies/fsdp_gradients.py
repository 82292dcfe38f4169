"""ShardedGradients: the reproducible mode's exact sum for a model sharded by FSDP2 (or HSDP).

FSDP2's own reduce-scatter is a floating-point sum, and it adds each micro-batch's gradient
to the last in floating point: both depend on the world size. In the mode FSDP2 never
reduces (``set_requires_gradient_sync(False)`` on every unit): after each micro-batch's
backward the mode reads each parameter's whole (unsharded) gradient, which FSDP2 keeps on
the rank that computed it, quantises it, and at the step's end one int64 reduce-scatter over
the shard group (then an int64 all_reduce across HSDP's copies) gives each rank the exact
sum of its own shard. Parameters are still gathered by FSDP2 for forward and backward, the
optimizer steps on the shards, and a shard's gradient is the same bits at any world size.

It reads FSDP2's own records of each parameter (``FSDPParam``: the unsharded gradient, the
shard's size, the DTensor of a shard), which torch does not promise to keep: the real-group
tests (tests/distributed/test_reproducible_sharded.py) fail on a torch that changes them.

The layout of the reduce-scatter's input follows FSDP2's sharding: a parameter's dim 0 cut
in ``shard`` chunks of ``ceil(rows / shard)`` rows (the last ones shorter or empty), each
rank's chunk padded to that size; every rank's part ends with a copy of the slots, so that
every rank receives their sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError


@dataclass(frozen=True)
class Sharding:
    """One parameter's place in the reduce-scatter: ``rows`` of ``cols`` elements, cut in
    chunks of ``padded`` rows; this rank holds ``held`` of them."""

    rows: int
    cols: int
    padded: int
    held: int


class ShardedGradients:
    """The exact sum's gradient side for the FSDP2-sharded ``params`` of ``module`` (see the
    module docstring). Turns off FSDP2's own gradient reduction for the whole module."""

    balanced = True

    def __init__(self, module: nn.Module, params: list[nn.Parameter]) -> None:
        owners = _fsdp_params(module)
        missing = [i for i, p in enumerate(params) if id(p) not in owners]
        if missing:
            raise ConfigError(
                f"reproducible with strategy 'fsdp': trained parameters {missing} (in the "
                f"optimizer's order) are not sharded by FSDP2; train only the model's own "
                f"parameters."
            )
        self.params = params
        self._owners = [owners[id(p)] for p in params]
        mesh = getattr(params[0], "device_mesh", None) if params else None
        if mesh is None:
            raise ConfigError("reproducible with strategy 'fsdp': no sharded parameter to train.")
        self._shard_group = mesh.get_group(mesh.ndim - 1)
        self._copies_group = mesh.get_group(0) if mesh.ndim == 2 else None
        self._shards = mesh.size(mesh.ndim - 1)
        rank = mesh.get_local_rank(mesh.ndim - 1)
        self._layout = [_sharding(p, owner, self._shards, rank) for p, owner in
                        zip(params, self._owners, strict=True)]  # fmt: skip
        self.local_numels = [s.padded * s.cols for s in self._layout]
        self.collectives_per_sum = 1 + (self._copies_group is not None)
        self._input: torch.Tensor | None = None
        self._received: torch.Tensor | None = None
        for unit in module.modules():  # the mode sums the gradients itself
            if isinstance(unit, FSDPModule):
                unit.set_requires_gradient_sync(False, recurse=False)

    def clear(self) -> None:
        for owner in self._owners:
            owner.unsharded_accumulated_grad = None
            if hasattr(owner, "_unsharded_param"):
                owner._unsharded_param.grad = None

    def gradients(self) -> list[torch.Tensor]:
        found = []
        for p, owner in zip(self.params, self._owners, strict=True):
            grad = owner.unsharded_accumulated_grad
            if grad is None and hasattr(owner, "_unsharded_param"):
                grad = owner._unsharded_param.grad
            found.append(grad if grad is not None else torch.zeros(p.shape, device=p.device))
        return found

    def sum_(self, vector: torch.Tensor, slots: int, comm: Communicator) -> torch.Tensor:
        chunk = sum(self.local_numels)
        shape = (self._shards, chunk + slots)
        if self._input is None or self._input.shape != shape:  # padding stays zero
            self._input = torch.zeros(shape, dtype=torch.int64, device=vector.device)
        sent = self._input
        start = pack(sent, vector, self._layout)
        sent[:, chunk:] = vector[start:]
        if self._received is None or self._received.shape != (chunk + slots,):
            self._received = torch.empty(chunk + slots, dtype=torch.int64, device=vector.device)
        received = self._received
        # torch >= 2.13 names it reduce_scatter_single (reduce_scatter_tensor: deprecated)
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(received, sent.view(-1), group=self._shard_group)
        if self._copies_group is not None:
            dist.all_reduce(received, group=self._copies_group)
        return received

    def held_bytes(self) -> int:
        """The reduce-scatter's buffers (kept from step to step) and the whole gradients
        FSDP2 makes unsharded in each backward (freed by ``clear`` after the step: counted at
        their size, not read, since between steps there are none)."""
        held = [t for t in (self._input, self._received) if t is not None]
        whole = sum(p.numel() * p.element_size() for p in self.params)
        return sum(t.numel() * t.element_size() for t in held) + whole

    def assign(self, flat: torch.Tensor) -> None:
        offset = 0
        for p, owner, s in zip(self.params, self._owners, self._layout, strict=True):
            piece = flat[offset : offset + s.padded * s.cols].view(s.padded, s.cols)[: s.held]
            local = piece.reshape(owner.sharded_size).to(p.dtype)
            p.grad = owner.to_sharded_dtensor(local)
            offset += s.padded * s.cols


def pack(sent: torch.Tensor, vector: torch.Tensor, layout: list[Sharding]) -> int:
    """Each parameter's whole gradient (one after another in ``vector``) into the rows of
    ``sent`` (one row per shard: that shard's chunk of every parameter, each padded to
    ``padded`` rows; the padding is left as it is, zero). At most two copies a parameter,
    whatever the number of shards. Returns where the parameters end in ``vector``."""
    start, offset = 0, 0
    for s in layout:
        whole = vector[start : start + s.rows * s.cols]
        width = s.padded * s.cols
        full = min(s.rows // s.padded, sent.shape[0]) if s.padded else 0  # shards filled
        if full:
            sent[:full, offset : offset + width] = whole[: full * width].view(full, width)
        rest = s.rows * s.cols - full * width  # the next shard's fewer rows
        if rest > 0:
            sent[full, offset : offset + rest] = whole[full * width :]
        start, offset = start + s.rows * s.cols, offset + width
    return start


def _fsdp_params(module: nn.Module) -> dict[int, FSDPParam]:
    """Each FSDP2-sharded parameter's FSDPParam, by the parameter's id (torch 2.13 keeps a
    unit's parameter groups in a list; earlier releases kept one group)."""
    found: dict[int, FSDPParam] = {}
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            state = unit._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None)
            if groups is None:
                single = getattr(state, "_fsdp_param_group", None)
                groups = [single] if single is not None else []
            for group in groups:
                for owner in group.fsdp_params:
                    found[id(owner.sharded_param)] = owner
    return found


def _sharding(p: nn.Parameter, owner: FSDPParam, shards: int, rank: int) -> Sharding:
    dim = getattr(getattr(owner, "fsdp_placement", None), "dim", 0)
    if dim != 0:
        raise ConfigError(
            f"reproducible with strategy 'fsdp': a parameter of shape {tuple(p.shape)} is "
            f"sharded on dim {dim}; the exact sum follows FSDP2's default dim-0 sharding "
            f"(no shard_placement_fn)."
        )
    rows = p.shape[0] if p.dim() else 1
    cols = p.numel() // max(rows, 1)
    padded = -(-rows // shards)
    held = max(0, min(padded, rows - rank * padded))
    return Sharding(rows, cols, padded, held)


__all__ = ["ShardedGradients", "Sharding", "pack"]
