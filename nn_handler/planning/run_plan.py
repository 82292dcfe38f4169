"""A run planned before it is launched (``nn-handler plan``): in this process, on the meta
device, for a world of any size. The model is built on meta (no memory), the strategy's
layout resolved for that world as the launch resolves it (the mesh, the blocks, the modes),
and the report says what one rank holds, how the data is dealt and what the launch would
refuse. Every refusal comes from the function the launch itself calls, so the plan finds the
same ConfigError without the cluster.

The collectives of one optimizer step are planned for DDP, FSDP2/HSDP and the reproducible
mode's exact sums (collectives.py), and the checkpoint's format, size and writers
(checkpoint_plan.py); not planned yet: the float sum's and the fault-tolerant mode's
collectives."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from nn_handler.checkpoint.format import sharded_checkpoints
from nn_handler.config.handler import HandlerConfig
from nn_handler.data.fixed_batches import steps_per_epoch
from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.planning.checkpoint_plan import CheckpointPlan, plan_checkpoint
from nn_handler.planning.collectives import Collective, ddp_step, exact_step, fsdp_step
from nn_handler.strategies import strategy_name
from nn_handler.strategies.activation_estimate import estimate_activations
from nn_handler.strategies.blocks import blocks_of
from nn_handler.strategies.memory_plan import (
    MemoryPlan,
    ModelSizes,
    check_budget,
    fitting_layout,
    plan_memory,
)
from nn_handler.strategies.mesh import check_cpu_offload, mesh_shape
from nn_handler.training.checkpoint_format import world_change_note
from nn_handler.training.memory_planning import layout_for
from nn_handler.training.reproducible.exact_step import check_sharded_micro_batches

#: What a model factory gives: the model, or the model and one training batch's inputs (on
#: any device: they are moved to meta) for the activations.
Built = nn.Module | tuple[nn.Module, Any]


@dataclass(frozen=True)
class Refusal:
    """A ConfigError the launch would raise: where it comes from, and its message."""

    where: str
    message: str


@dataclass(frozen=True)
class DataPlan:
    """How a step's samples are dealt over the ranks.

    Attributes:
        global_batch: samples per optimizer step (all ranks).
        per_rank: the most samples one rank computes per step.
        micro_batches: micro-batches per step (the reproducible mode's), else None.
        micro_batches_per_rank: the most micro-batches one rank runs per step (else None).
        steps_per_epoch: optimizer steps per epoch (None: the dataset's size not given).
        resume: what a resume at ``resume_world`` ranks gives (None: not asked).
    """

    global_batch: int
    per_rank: int
    micro_batches: int | None
    micro_batches_per_rank: int | None
    steps_per_epoch: int | None
    resume: str | None


@dataclass(frozen=True)
class RunPlan:
    """The plan of one run at ``world`` ranks on ``nodes`` machines (see the module)."""

    world: int
    nodes: int
    strategy: str
    layout: str
    memory: MemoryPlan | None
    budget: int | None
    data: DataPlan | None
    refusals: list[Refusal] = field(default_factory=list)
    #: One optimizer step's collectives per rank (None: not planned for this mode).
    collectives: list[Collective] | None = None
    #: What a checkpoint of the run writes (None: not planned).
    checkpoint: CheckpointPlan | None = None


def plan_run(
    config: HandlerConfig | Mapping[str, Any],
    world: int,
    model: Callable[[], Built],
    *,
    nodes: int = 1,
    device_memory: int | None = None,
    resume_world: int | None = None,
    samples: int | None = None,
    device_type: str = "cuda",
    optimizer_slots: float = 2.0,
) -> RunPlan:
    """The plan of ``config`` at ``world`` ranks over ``nodes`` machines; ``model()`` is
    called under the meta device. ``device_memory``: one rank's budget in bytes (else the
    config's ``trainer.memory_budget``, else none); ``samples``: the training set's size;
    ``optimizer_slots``: optimizer state elements per parameter element (AdamW's 2)."""
    if world < 1 or nodes < 1:
        raise ConfigError(f"world={world} and nodes={nodes} must be at least 1.")
    refusals: list[Refusal] = []
    try:
        handler = config if isinstance(config, HandlerConfig) else HandlerConfig.from_dict(config)
    except ConfigError as error:
        refusals.append(Refusal("config", str(error)))
        return RunPlan(world, nodes, "?", "?", None, device_memory, None, refusals)
    trainer = handler.trainer
    if world % nodes:
        refusals.append(
            Refusal(
                "launch",
                f"--world {world} over --nodes {nodes}: every machine runs the same number of "
                f"ranks (torchrun's --nproc-per-node), so nodes must divide the world.",
            )
        )
    strategy = _refused(refusals, "trainer.strategy", "single", strategy_name, trainer, world)
    try:
        with torch.device("meta"):
            built = model()
    except Exception as error:  # the user's factory: say where, in one line
        raise ConfigError(
            f"the model factory failed on the meta device ({type(error).__name__}: {error}); "
            f"it must build the model from its shapes alone (no weights read, no data)."
        ) from error
    module, inputs = built if isinstance(built, tuple) else (built, None)
    if not isinstance(module, nn.Module):
        raise ConfigError(
            f"the model factory returned a {type(module).__name__}: return the model (an "
            f"nn.Module), or the model and one micro-batch's inputs."
        )
    mesh = (1, world)
    if strategy == "fsdp":
        sizes_asked = (trainer.fsdp.replicate, trainer.fsdp.shard)
        local = max(world // nodes, 1)
        mesh = _refused(refusals, "trainer.fsdp", mesh, mesh_shape, world, local, *sizes_asked)
        _refused(refusals, "trainer.fsdp", None, check_cpu_offload, trainer.fsdp, device_type)
    purpose = "the blocks to shard and checkpoint"
    blocks = _refused(refusals, "trainer.fsdp.blocks", [], blocks_of, module, trainer.fsdp, purpose)
    data = _data(handler, world, samples, resume_world, strategy, refusals)
    collective = strategy == "fsdp"  # the strategies whose state is collective (FSDP2's)
    checkpoint = handler.checkpoint
    sharded = _refused(refusals, "checkpoint", checkpoint.format == "sharded" or collective,
                       sharded_checkpoints, checkpoint, collective)  # fmt: skip
    precision = handler.precision.precision
    layout = layout_for(strategy, trainer, world, mesh, precision, device_type)
    sizes = ModelSizes.of(module, blocks)
    activations = None
    if inputs is not None:
        names = {id(m): name for name, m in module.named_modules()}
        try:
            activations = estimate_activations(module, [names[id(b)] for b in blocks], inputs)
        except Exception as error:  # a forward the meta device cannot run (data-dependent)
            raise ConfigError(
                f"the model's forward does not run on the meta device ({type(error).__name__}: "
                f"{error}): return the model alone from the factory (the plan then counts no "
                f"activations), or make its forward independent of the data's values."
            ) from error
    memory = plan_memory(sizes, layout, optimizer_slots, "an optimizer", activations)
    budget = device_memory if device_memory is not None else _budget(trainer.memory_budget)
    if budget is not None and memory.total > budget:
        fits = fitting_layout(
            sizes, layout, optimizer_slots, "an optimizer", activations, world, budget
        )
        source = "--device-memory" if device_memory is not None else "trainer.memory_budget"
        _refused(refusals, "memory", None, check_budget, memory, budget, fits, source)
    steps = _collectives(strategy, module, blocks, mesh, handler)
    saved = plan_checkpoint(module, sharded, strategy, mesh, optimizer_slots, handler.ema.enabled,
                            resume_world)  # fmt: skip
    return RunPlan(
        world, nodes, strategy, layout.describe(), memory, budget, data, refusals, steps, saved
    )


def _collectives(
    strategy: str,
    module: nn.Module,
    blocks: list[nn.Module],
    mesh: tuple[int, int],
    handler: HandlerConfig,
) -> list[Collective] | None:
    """One optimizer step's collectives, where planned (see collectives.py)."""
    trainer, settings = handler.trainer, handler.trainer.fsdp
    micro_batches = trainer.accumulate_grad_batches
    if strategy == "single":
        return []
    if strategy == "ddp":
        return ddp_step(module, mesh[0] * mesh[1])
    sharded = strategy == "fsdp"
    mixed = sharded and handler.precision.precision == "bf16" and settings.mixed_precision
    if mixed and any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules()):
        return None  # BatchNorm units of their own under mixed precision: not planned yet
    gathered = torch.bfloat16 if mixed else None
    mode = trainer.reproducible
    if mode is not None:
        if mode.reduction != "exact" or trainer.fault_tolerance is not None:
            return None  # the float sum and the fault-tolerant mode: not planned yet
        planned = exact_step(
            module, blocks, mesh, mode.micro_batches, sharded, gathered=gathered,
            reshard_after_forward=settings.reshard_after_forward,
        )  # fmt: skip
        return _agreement(planned, trainer.nonfinite) if sharded else planned
    planned = fsdp_step(
        module,
        blocks,
        mesh,
        micro_batches,
        gathered=gathered,
        reshard_after_forward=settings.reshard_after_forward,
        reduce_every_micro_batch=settings.reduce_every_micro_batch,
    )
    return _agreement(planned, trainer.nonfinite)


def _agreement(planned: list[Collective], nonfinite: str) -> list[Collective]:
    """With sharded gradients, each rank checks its shard and the ranks agree on whether the
    step's gradients are finite (one int64 all-reduce), unless ``nonfinite`` is off."""
    if nonfinite == "off":
        return planned
    return sorted([*planned, Collective("all_reduce", "world", 8, 1)])


def _refused(
    refusals: list[Refusal], where: str, default: Any, check: Callable[..., Any], *args: Any
) -> Any:
    """``check(*args)``, or ``default`` with its ConfigError kept in ``refusals``."""
    try:
        return check(*args)
    except ConfigError as error:
        refusals.append(Refusal(where, str(error)))
        return default


def _data(
    handler: HandlerConfig,
    world: int,
    samples: int | None,
    resume_world: int | None,
    strategy: str,
    refusals: list[Refusal],
) -> DataPlan:
    """The data's part of the plan, with the refusals it finds."""
    trainer, mode = handler.trainer, handler.trainer.reproducible
    if mode is not None:
        per_rank = math.ceil(mode.micro_batches / world)
        if strategy == "fsdp":
            _refused(
                refusals,
                "trainer.reproducible",
                None,
                check_sharded_micro_batches,
                mode.micro_batches,
                world,
            )
        steps = None
        if samples is not None:
            steps = _refused(
                refusals,
                "data",
                None,
                steps_per_epoch,
                samples,
                mode.global_batch_size,
                handler.loader.drop_last,
            )
        resume = None
        if resume_world is not None:
            resume = _resume_refusal(handler, world, resume_world, refusals)
            where, check = f"resume at {resume_world} ranks", check_sharded_micro_batches
            if strategy == "fsdp" and _refused(
                refusals, where, "refused", check, mode.micro_batches, resume_world
            ):
                resume = None
            elif resume is not None:
                most = math.ceil(mode.micro_batches / resume_world)
                resume += f"; at most {most} micro-batches per rank"
        return DataPlan(
            mode.global_batch_size,
            per_rank * mode.micro_batch_size,
            mode.micro_batches,
            per_rank,
            steps,
            resume,
        )
    batch = handler.loader.batch_size * trainer.accumulate_grad_batches
    global_batch = batch * world
    steps = None
    if samples is not None:
        per_rank_samples = math.ceil(samples / world)
        whole = per_rank_samples // handler.loader.batch_size
        batches = (
            whole
            if handler.loader.drop_last
            else math.ceil(per_rank_samples / handler.loader.batch_size)
        )
        steps = math.ceil(batches / trainer.accumulate_grad_batches)
    resume = None
    if resume_world is not None:
        resume = _resume_refusal(handler, world, resume_world, refusals)
    return DataPlan(global_batch, batch, None, None, steps, resume)


def _resume_refusal(
    handler: HandlerConfig, world: int, resume_world: int, refusals: list[Refusal]
) -> str | None:
    """What the launch says of a mid-epoch resume at ``resume_world`` ranks of a checkpoint
    written by ``world`` (training/checkpoint_format.world_change_note), or its refusal kept
    in ``refusals`` (None then)."""
    if resume_world == world:
        return f"resuming at the same {world} ranks: the same run, exactly"
    try:
        note = world_change_note(
            "a checkpoint of this run", world, resume_world, 1,
            handler.checkpoint.allow_world_size_change,
            exact=handler.trainer.reproducible is not None,
        )  # fmt: skip
    except CheckpointError as error:
        refusals.append(Refusal(f"resume at {resume_world} ranks", str(error)))
        return None
    return note


def _budget(memory_budget: Any) -> int | None:
    return None if memory_budget is None else int(memory_budget)


__all__ = ["Built", "DataPlan", "Refusal", "RunPlan", "plan_run"]
