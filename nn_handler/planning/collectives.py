"""The collectives one rank makes in one optimizer step, planned from the model's shapes:
which op, over which group (the world, or a mesh dimension), how many bytes, how many times.
Counted in a real step with the same rules (tests/distributed/test_plan_collectives.py): the
bytes are those of the op's first tensor, as torch's c10d ops receive them (an all-reduce's
tensor, an all-gather's gathered output, a reduce-scatter's one-shard output).

- DDP: one all-reduce per gradient bucket (torch's own bucket assignment over the gradients in
  the order backward makes them: a first bucket of 1 MiB, then 25 MiB), and, when the model has
  buffers, their broadcast from rank 0 (DDP's ``broadcast_buffers``: coalesced per dtype) at
  the forward that syncs, the step's last (the others run under ``no_sync``).
- FSDP2 (``fully_shard`` per block and on the root): per micro-batch, an all-gather of each
  unit's parameters before its forward, again before each block's backward (resharded after
  forward; the root is kept), each parameter padded on dim 0 to a multiple of the shard size,
  in the gathered dtype (bf16 under mixed precision); at the step's last micro-batch (or every
  one with ``reduce_every_micro_batch``) a reduce-scatter of each unit's gradients (fp32), and
  under HSDP an all-reduce of the shard across the copies.
- The reproducible mode ('exact'): one int64 sum a step of every rank's fixed-point gradients
  and, per micro-batch, a row of float64 values as int64 slots (samples, BatchNorm element
  counts, loss, BatchNorm means and variances, each tensor's largest magnitude): an all-reduce
  of the whole model's gradients when replicated; sharded, a reduce-scatter inside the copy
  whose output is the rank's padded chunk of every parameter and the rows (then an all-reduce
  across HSDP's copies), and FSDP2's all-gathers for each of the rank's passes (the most
  micro-batches a rank owns: the others run filler passes). The run's first step and a
  rescaled one sum again (and the first agrees on the maxima first): not a steady step's.
- 'single', the 'float' reduction and the fault-tolerant mode: not planned yet.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

#: DDP's bucket sizes (torch's defaults, which nn_handler keeps): the first, then the others.
FIRST_BUCKET_BYTES = 2**20
BUCKET_BYTES = 25 * 2**20
#: DDP's bucket for broadcasting buffers.
BUFFER_BUCKET_BYTES = 250 * 2**20


@dataclass(frozen=True, order=True)
class Collective:
    """One kind of collective of a step: ``count`` of them, each of ``bytes`` (see module)."""

    op: str
    group: str
    bytes: int
    count: int


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def ddp_step(module: nn.Module, world: int) -> list[Collective]:
    """DDP's collectives in one optimizer step, however many micro-batches it has (the
    gradients are reduced and the buffers broadcast at the last one only: ``no_sync``
    before)."""
    if world == 1:
        return []
    params = [p for p in module.parameters() if p.requires_grad][::-1]  # as backward makes them
    # DDP's own assignment (torch keeps it private: the plan must be DDP's, not a copy of it).
    assign = getattr(dist, "_compute_bucket_assignment_by_size")  # noqa: B009
    buckets, _ = assign(params, [FIRST_BUCKET_BYTES, BUCKET_BYTES], [False] * len(params))
    sizes = Counter(sum(_bytes(params[i]) for i in bucket) for bucket in buckets)
    planned = [Collective("all_reduce", "world", size, n) for size, n in sizes.items()]
    by_dtype: Counter[torch.dtype] = Counter()
    for buffer in module.buffers():
        by_dtype[buffer.dtype] += _bytes(buffer)
    for size in by_dtype.values():  # coalesced per dtype, in chunks of 250 MB
        whole, rest = divmod(size, BUFFER_BUCKET_BYTES)
        for chunk, n in ((BUFFER_BUCKET_BYTES, whole), (rest, int(rest > 0))):
            if n:
                planned.append(Collective("broadcast", "world", chunk, n))
    return sorted(planned)


def padded(parameter: torch.Tensor, shard: int) -> int:
    """Elements of ``parameter`` as FSDP2 shards it: dim 0 padded to a multiple of ``shard``."""
    if parameter.dim() == 0:
        return shard
    rows = math.ceil(parameter.shape[0] / shard) * shard
    return rows * math.prod(parameter.shape[1:])


def fsdp_step(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    mesh: tuple[int, int],
    micro_batches: int,
    *,
    gathered: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    reduce_every_micro_batch: bool = False,
) -> list[Collective]:
    """FSDP2's collectives in one optimizer step (see the module): ``mesh`` (replicate,
    shard), ``gathered`` the all-gathers' dtype (None: the parameters')."""
    replicate, shard = mesh
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    units = [list(block.parameters()) for block in blocks]
    root = [p for p in module.parameters() if id(p) not in in_blocks]
    counts: Counter[tuple[str, str, int]] = Counter()
    reductions = micro_batches if reduce_every_micro_batch else 1
    group = "shard" if replicate > 1 else "world"
    for index, unit in enumerate([*units, root]):
        if not unit:
            continue
        is_root = index == len(units)
        gathers = micro_batches * (1 if is_root or not reshard_after_forward else 2)
        gathered_bytes = sum(padded(p, shard) * _size(gathered or p.dtype) for p in unit)
        if shard > 1:
            counts["all_gather", group, gathered_bytes] += gathers
        trainable = [p for p in unit if p.requires_grad]
        if not trainable:
            continue
        shard_bytes = sum(padded(p, shard) * _size(p.dtype) for p in trainable) // shard
        if shard > 1:
            counts["reduce_scatter", group, shard_bytes] += reductions
        if replicate > 1:
            counts["all_reduce", "replicate", shard_bytes] += reductions
    return sorted(Collective(op, g, size, n) for (op, g, size), n in counts.items())


def exact_row_width(module: nn.Module, trained: int) -> int:
    """Float64 values in one micro-batch's row of the exact sum (ExactStep's layout): its
    samples, each BatchNorm layer's elements per channel, its loss, every tracked BatchNorm
    layer's means and variances, each of the ``trained`` tensors' largest magnitude."""
    norms = [
        m for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats
    ]  # fmt: skip
    return 2 + len(norms) + 2 * sum(m.num_features for m in norms) + trained


def exact_step(
    module: nn.Module,
    blocks: Sequence[nn.Module],
    mesh: tuple[int, int],
    micro_batches: int,
    sharded: bool,
    *,
    gathered: torch.dtype | None = None,
    reshard_after_forward: bool = True,
) -> list[Collective]:
    """The reproducible mode's collectives in a steady optimizer step of ``micro_batches``
    micro-batches (see the module): ``sharded`` under FSDP2 over ``mesh``."""
    replicate, shard = mesh
    world = replicate * shard
    trained = [p for p in module.parameters() if p.requires_grad]
    rows = micro_batches * exact_row_width(module, len(trained))
    if not sharded:
        whole = (sum(p.numel() for p in trained) + rows) * 8
        return [Collective("all_reduce", "world", whole, 1)] if world > 1 else []
    passes = math.ceil(micro_batches / world)
    gathers = fsdp_step(
        module, blocks, mesh, passes, gathered=gathered, reshard_after_forward=reshard_after_forward
    )
    planned = [c for c in gathers if c.op == "all_gather"]
    chunk = sum(padded(p, shard) // shard for p in trained)  # each rank's padded chunk
    received = (chunk + rows) * 8
    group = "shard" if replicate > 1 else "world"
    if shard > 1:
        planned.append(Collective("reduce_scatter", group, received, 1))
    if replicate > 1:
        planned.append(Collective("all_reduce", "replicate", received, 1))
    return sorted(planned)


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype, device="meta").element_size()


__all__ = ["Collective", "ddp_step", "exact_row_width", "exact_step", "fsdp_step", "padded"]
