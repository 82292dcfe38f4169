"""The Trainer's memory plan (strategies/memory_plan.py): printed at the start (rank 0, one
line per item) and checked against ``memory_budget`` (or the device's memory) twice: at
construction, for the parameters, gradients and optimizer state (before the gradients and the
optimizer state exist; with a meta-device model only the shards have been allocated), and at
the first training step, with the activations estimated from its batch on the model's meta
twin (before the first forward). A plan over the budget is a ConfigError on every rank that
names a layout that would fit."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from nn_handler.config.training import TrainerConfig
from nn_handler.distributed.env import parse_distributed_env
from nn_handler.strategies import Strategy
from nn_handler.strategies.activation_estimate import estimate_activations
from nn_handler.strategies.memory_plan import (
    Activations,
    Layout,
    MemoryPlan,
    ModelSizes,
    check_budget,
    fitting_layout,
    gib,
    optimizer_slots,
    plan_memory,
)
from nn_handler.training.model_summary import summary_lines


def device_budget(device: torch.device) -> tuple[int | None, str]:
    """The memory one rank of this machine may use, and where that number comes from: a
    GPU's total memory, or the machine's memory divided by its ranks (None: unknown)."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory), "the GPU's memory"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                ranks = parse_distributed_env(os.environ).local_world_size
                total = int(line.split()[1]) * 1024 // max(ranks, 1)
                return total, f"the machine's memory / {ranks} rank(s) on it"
    except (OSError, ValueError):
        pass
    return None, "unknown"


class MemoryPlanner:
    """Plans one rank's memory for the Trainer's strategy; see the module docstring."""

    def __init__(self, strategy: Strategy, config: TrainerConfig, device: torch.device) -> None:
        self.strategy = strategy
        self.config = config
        #: Whether the fit validates (the plan then counts the evaluation pass); set by fit.
        self.validates = True
        self.log = logger.bind(rank=strategy.comm.rank)
        if config.memory_budget is not None:
            self.budget: int | None = int(config.memory_budget)
            self.source = "trainer.memory_budget"
        else:
            self.budget, self.source = device_budget(device)
        module = strategy.module
        self.sizes = ModelSizes.of(module, strategy.blocks) if module is not None else None
        self.layout = _layout_of(strategy, config, device)
        self.slots, self.optimizer = 0.0, "no optimizer"
        self.plan: MemoryPlan | None = None
        self._pending = strategy.twin is not None
        #: Whether the plan is printed at info level (FSDP2, a meta-device model or a budget
        #: given); at debug level otherwise.
        self.loud = (
            strategy.name == "fsdp" or strategy.built_on_meta or (config.memory_budget is not None)
        )

    def at_start(self, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The model summary (rank 0, trainer.model_summary), then the plan without
        activations, printed and checked (every rank)."""
        module = self.strategy.module
        if self.config.model_summary and module is not None and self.strategy.comm.rank == 0:
            self.log.info("\n".join(summary_lines(module)))
        self.slots, self.optimizer = optimizer_slots(optimizers)
        self._check(None)

    def before_first_step(self, inputs_of: Callable[[], Any]) -> None:
        """At the first training step: estimate the activations of the batch's inputs
        (``inputs_of()``), print the full plan and check it; once per Trainer."""
        if not self._pending:
            return
        self._pending = False
        twin = self.strategy.twin
        if twin is None:
            return
        try:
            with torch.random.fork_rng(devices=[]):
                inputs = inputs_of()
                activations = estimate_activations(twin, self.strategy.block_names, inputs)
        except Exception as error:  # a forward the meta device cannot run (data-dependent)
            total = _gib(self.plan.total) if self.plan is not None else "unknown"
            self.log.log(
                self._level,
                "  activations: not estimated (the model's forward does not run on the meta "
                "device: {}); total without them: {}",
                error,
                total,
            )
            return
        self._check(activations)

    @property
    def _level(self) -> str:
        return "INFO" if self.loud else "DEBUG"

    def _check(self, activations: Activations | None) -> None:
        if self.sizes is None:
            return
        plan = plan_memory(
            self.sizes, self.layout, self.slots, self.optimizer, activations, self.validates
        )
        self.plan = plan
        level = self._level
        shown = plan.items if activations is None else plan.items[-2:]
        if activations is None:
            self.log.log(level, plan.heading())
        for name, size, how in shown:
            self.log.log(level, "  {}: {} ({})", name, _gib(size), how)
        if activations is not None:
            total, budget = _gib(plan.total), _gib(self.budget)
            self.log.log(
                level,
                "  total: {} of a budget of {} (the larger of training's peak, the gradients "
                "and the activations counted once as backward frees one as it makes the "
                "other, and validation's)",
                total,
                budget,
            )
        if self.budget is None or plan.total <= self.budget:
            return
        world = self.strategy.comm.world_size
        suggestion = fitting_layout(
            self.sizes, self.layout, self.slots, self.optimizer, activations, world,
            self.budget, self.validates,
        )  # fmt: skip
        check_budget(plan, self.budget, suggestion, self.source)


def _gib(size: int | None) -> str:
    return "unknown" if size is None else gib(size)


def _layout_of(strategy: Strategy, config: TrainerConfig, device: torch.device) -> Layout:
    mesh = getattr(strategy, "mesh_shape", (1, strategy.comm.world_size))
    world, precision = strategy.comm.world_size, strategy.precision
    return layout_for(strategy.name, config, world, mesh, precision, device.type)


def layout_for(
    strategy: str,
    config: TrainerConfig,
    world: int,
    mesh: tuple[int, int],
    precision: str,
    device_type: str,
) -> Layout:
    """The memory plan's layout of ``strategy`` (a resolved name: 'single', 'ddp',
    'replicated' or 'fsdp') over ``world`` ranks, ``mesh`` (replicate, shard) under FSDP2:
    the Trainer's at its start, and ``nn-handler plan``'s for a world it is not running in."""
    settings, mode = config.fsdp, config.reproducible
    exact = math.ceil(mode.micro_batches / world) if mode and mode.reduction == "exact" else 0
    if strategy == "fsdp":
        replicate, shard = mesh
        return Layout(
            "fsdp",
            shard=shard,
            replicate=replicate,
            activation_checkpointing=settings.activation_checkpointing,
            gathered_dtype_bytes=0.5 if precision == "bf16" and settings.mixed_precision else 1.0,
            foreach=device_type == "cuda",
            exact_micro_batches=exact,
        )
    return Layout(
        strategy,
        shard=1,
        replicate=world,
        activation_checkpointing=settings.activation_checkpointing,
        foreach=device_type == "cuda",
        exact_micro_batches=exact,
        fault_tolerant=config.fault_tolerance is not None,
    )


__all__ = ["MemoryPlanner", "device_budget", "layout_for"]
