"""What a run's checkpoint writes, planned from the model's shapes: its format (the launch's own
decision: checkpoint/format.sharded_checkpoints), the tensors it holds (the model, the
optimizer state, the EMA), the most one rank writes, and what a resume at another world reads.

Counted: tensors' bytes. A sharded folder also holds torch.distributed.checkpoint's records
(about 2 KB a tensor and a rank's small items: measured 9% of a 68K-parameter model's folder,
tests/distributed/test_plan_checkpoint.py) and ``trainer.pt`` (the loop's position, random
states: tens of KB)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from nn_handler.planning.collectives import padded
from nn_handler.strategies.memory_plan import gib


@dataclass(frozen=True)
class CheckpointPlan:
    """A checkpoint of the run.

    Attributes:
        format: 'single file' or 'sharded folder'.
        tensors: the bytes of every tensor it holds (model, optimizer state, EMA), once.
        most_per_rank: the most tensor bytes one rank writes.
        writers: who writes what, in words.
        resume: what a resume at ``resume_world`` ranks reads (None: not asked).
    """

    format: str
    tensors: int
    most_per_rank: int
    writers: str
    resume: str | None


def plan_checkpoint(
    module: nn.Module,
    sharded: bool,
    strategy: str,
    mesh: tuple[int, int],
    slots: float,
    ema: bool,
    resume_world: int | None,
) -> CheckpointPlan:
    """The checkpoint of ``module`` trained under ``strategy`` over ``mesh`` (replicate,
    shard) with ``slots`` optimizer state elements per parameter element, ``ema`` kept;
    ``sharded``: a sharded folder (else one file)."""
    replicate, shard = mesh
    world = replicate * shard
    params = list(module.parameters())
    trained = [p for p in params if p.requires_grad]
    buffers = sum(_bytes(b) for b in module.buffers())
    model = sum(_bytes(p) for p in params) + buffers
    optimizer = int(slots * sum(_bytes(p) for p in trained))
    copies = 1 + int(ema)  # the weights, and the EMA's
    tensors = copies * model + optimizer
    if not sharded:
        reads = None if resume_world is None else "every rank reads the whole file"
        return CheckpointPlan("single file", tensors, tensors, "rank 0 writes it all", reads)
    if strategy == "fsdp":
        share = _first_share(params, shard, copies) + _first_share(trained, shard, slots)
        # Buffers are whole on every rank, written once; shards held by HSDP's copies too.
        most = math.ceil(share / replicate) + buffers * copies
        writers = (
            f"each rank its 1/{shard} of every tensor"
            if replicate == 1
            else f"each shard once, by one of the {replicate} ranks holding it (DCP's dedup)"
        )
    else:
        most = math.ceil(tensors / world) if world > 1 else tensors
        writers = "each tensor once, by one of the ranks (DCP's dedup spreads them)"
    reads = None
    if resume_world is not None:
        reads = (
            f"each of the {resume_world} ranks reads its own shard of every tensor (DCP "
            f"reshards: about {gib(tensors / resume_world)} a rank)"
            if strategy == "fsdp"
            else f"each of the {resume_world} ranks reads every tensor"
        )
    return CheckpointPlan("sharded folder", tensors, most, writers, reads)


def _first_share(tensors: Sequence[torch.Tensor], shard: int, per_element: float) -> int:
    """Rank 0's bytes of ``tensors`` sharded on dim 0 over ``shard`` ranks (the first ranks
    hold a padded chunk whole), times ``per_element``."""
    return int(per_element * sum(padded(t, shard) // shard * t.element_size() for t in tensors))


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


__all__ = ["CheckpointPlan", "plan_checkpoint"]
