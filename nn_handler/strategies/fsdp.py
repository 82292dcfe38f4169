"""FSDP2Strategy: parameters, gradients and optimizer state sharded over the ranks with
``torch.distributed.fsdp.fully_shard`` (FSDP2), so a model that does not fit one device trains.

Each block (FsdpConfig.blocks, or every module of at least ``min_params`` parameters) is one
unit: its parameters are all-gathered for its forward and backward and its gradients are
reduce-scattered; the root is sharded last. The collectives it makes outside the
Communicator are FSDP2's own (all-gather, reduce-scatter) on torch.distributed's default
group, plus, in the checkpoint views, those of ``torch.distributed.checkpoint.state_dict``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
)

from nn_handler.checkpoint.optimizer_state import is_named, to_named
from nn_handler.checkpoint.registry import Part
from nn_handler.distributed.env import parse_distributed_env
from nn_handler.errors import ConfigError
from nn_handler.strategies.base import Strategy, check_loaded
from nn_handler.strategies.blocks import shard_blocks
from nn_handler.strategies.exact_gradients import ExactGradients
from nn_handler.strategies.fsdp_gradients import ShardedGradients
from nn_handler.strategies.mesh import build_mesh, check_cpu_offload, mesh_shape
from nn_handler.strategies.sync_batchnorm import convert_sync_batchnorm

#: Full (unsharded) state, on rank 0 only: what a single-file checkpoint holds.
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
#: Loading a full state that every rank holds: each rank keeps its shard.
LOAD_FULL = StateDictOptions(full_state_dict=True)


#: torch's FSDP2 warning that a wrapped module returned a view tensor (the same on every
#: rank, raised by each rank's first forward): shown by rank 0 only.
VIEW_WARNING = r"FSDP2-wrapped module \(.*\) returned a view tensor"


class FSDP2Strategy(Strategy):
    """FSDP2 over every rank of the run (a 1-D device mesh on torch.distributed's default
    group; each rank holds 1/world of the parameters, gradients and optimizer state), or HSDP
    with ``fsdp.replicate`` > 1: a ``replicate x shard`` mesh, each rank 1/shard of them."""

    name = "fsdp"
    #: (replicate, shard): the mesh's sizes, after ``setup``.
    mesh_shape: tuple[int, int] = (1, 1)
    #: Checkpoint views of the model and optimizers are collectives (every rank saves).
    collective_state = True

    def prepare(self, module: nn.Module) -> nn.Module:
        check_cpu_offload(self.config.fsdp, self.device.type)
        if not (dist.is_available() and dist.is_initialized()):
            alone = self.comm.world_size == 1
            raise ConfigError(
                f"strategy 'fsdp' shards the model over a process group, and there is none "
                f"(the communicator reports world size {self.comm.world_size}). "
                + (
                    "One process makes no group by default, also under torchrun: set "
                    "distributed: {enabled: true} for a group of one, i.e. add\n"
                    "    distributed:\n      enabled: true\n"
                    'to the YAML file, or "distributed": {"enabled": True} to the config '
                    "dict (HandlerConfig(distributed=DistributedConfig(enabled=True))); or use "
                    "strategy 'single'."
                    if alone
                    else "Launch with torchrun, SLURM or nn_handler.launch."
                )
            )
        if dist.get_world_size() != self.comm.world_size:
            raise ConfigError(
                f"strategy 'fsdp': the communicator reports world size {self.comm.world_size} "
                f"but the process group has {dist.get_world_size()}; FSDP shards over the group."
            )
        if self.config.sync_batchnorm and self.comm.world_size > 1:
            module = convert_sync_batchnorm(module, self.device)
        settings = self.config.fsdp
        both_auto = settings.replicate == settings.shard == "auto"
        local = _local_world_size() if both_auto else 1  # read only when it decides
        self.mesh_shape = mesh_shape(
            self.comm.world_size, local, settings.replicate, settings.shard
        )
        mesh = build_mesh(self.device.type, *self.mesh_shape)
        offload: OffloadPolicy = CPUOffloadPolicy() if settings.cpu_offload else OffloadPolicy()
        mixed = self.mixed_precision()
        if mixed.param_dtype is not None:  # first: units nest inside the blocks' units
            for norm in _batch_norms(module, self.blocks):
                fully_shard(
                    norm,
                    mesh=mesh,
                    reshard_after_forward=settings.reshard_after_forward,
                    offload_policy=offload,
                    mp_policy=MixedPrecisionPolicy(),
                )
        for block in self.blocks:
            fully_shard(
                block,
                mesh=mesh,
                reshard_after_forward=settings.reshard_after_forward,
                offload_policy=offload,
                mp_policy=mixed,
            )
        fully_shard(module, mesh=mesh, offload_policy=offload, mp_policy=mixed)
        if self.comm.rank != 0:  # torch's advice about a view output: rank 0 says it once
            warnings.filterwarnings("ignore", message=VIEW_WARNING, category=UserWarning)
        return module

    def mixed_precision(self) -> MixedPrecisionPolicy:
        """With ``precision: bf16`` (and ``fsdp.mixed_precision``), FSDP2 casts each block's
        gathered parameters to bf16 for forward and backward (half the all-gather bytes) and
        reduces the gradients in fp32; the sharded parameters, gradients and optimizer state
        stay fp32. BatchNorm layers are units of their own that stay fp32 (bf16 inputs, as
        under autocast): CUDA's batch norm refuses bf16 weights beside fp32 running
        statistics. Otherwise the parameters keep their dtype (fp16 runs use autocast and the
        GradScaler, as under DDP)."""
        if self.precision == "bf16" and self.config.fsdp.mixed_precision:
            return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return MixedPrecisionPolicy()

    def wrap(self, module: nn.Module) -> nn.Module:
        return module  # fully_shard changed the module in place

    @property
    def reduces_gradients(self) -> bool:
        return True  # reduce-scatter sums every rank's gradient into every shard

    @property
    def shards_gradients(self) -> bool:
        return True

    def agree(self, flag: bool) -> bool:
        """Every rank's flag, and-ed: each rank checks its own shard of the gradients."""
        flags = self.comm.all_reduce(torch.tensor([int(flag)], device=self.device), op="min")
        return bool(flags.item())

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        if self.config.fsdp.reduce_every_micro_batch:
            return contextlib.nullcontext()
        return self._without_gradient_sync()

    @contextlib.contextmanager
    def _without_gradient_sync(self) -> Iterator[None]:
        module = self._fsdp_module()
        module.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            module.set_requires_gradient_sync(True)

    def clip_grad_norm(
        self, parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        """The norm of the whole model's gradients across every shard (DTensor arithmetic:
        one small all-reduce), the same on every rank."""
        norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)
        full = getattr(norm, "full_tensor", None)
        return full() if callable(full) else norm

    @contextlib.contextmanager
    def evaluation(self) -> Iterator[None]:
        """Every block's parameters gathered once for the whole evaluation (every rank must
        enter): ranks may then run different numbers of batches, as exact evaluation needs,
        without a collective per forward. Needs the whole model to fit each device."""
        modules = [m for m in self._setup_module().modules() if isinstance(m, FSDPModule)]
        for module in modules:
            module.unshard()
            module.set_reshard_after_forward(False, recurse=False)
        try:
            yield
        finally:
            for module in modules:
                module.reshard()
            reshard = self.config.fsdp.reshard_after_forward
            for module in modules[1:] if modules else []:  # the root keeps its default
                module.set_reshard_after_forward(reshard, recurse=False)

    # ----------------------------------------------------------------- checkpoint views
    def checkpoint_parts(self) -> list[Part]:
        module = self._setup_module()
        model = Part(
            "model",
            lambda: self.module_state_dict(module),
            lambda state, source: self.load_module_state_dict(module, state, source),
            missing="error",
            collective=True,
            shards=lambda: self.model_shards(module),
            load_shards=lambda state, source: self.load_model_shards(module, state, source),
        )
        return [model] + [p for p in super().checkpoint_parts() if p.per_rank]

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The whole state of a sharded ``module``, gathered to rank 0 (a collective)."""
        return dict(get_model_state_dict(module, options=FULL))

    def load_module_state_dict(
        self, module: nn.Module, state: Mapping[str, Any], source: str
    ) -> None:
        check_loaded(set_model_state_dict(module, dict(state), options=LOAD_FULL), module, source)

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's full state keyed by parameter name, on rank 0 (a collective); the
        other strategies load it too (converted to their index-keyed layout)."""
        return dict(get_optimizer_state_dict(self._setup_module(), optimizer, options=FULL))

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        module = self._setup_module()
        if not is_named(state):  # written by the single-device or DDP strategy
            state = to_named(state, module, optimizer)
        set_optimizer_state_dict(module, optimizer, dict(state), options=LOAD_FULL)

    def exact_gradients(self, params: list[nn.Parameter]) -> ExactGradients:
        """The reproducible mode's exact sum, shard by shard (FSDP2's own gradient reduction
        turned off): one int64 reduce-scatter a step (and an all_reduce across HSDP's copies)."""
        return ShardedGradients(self._setup_module(), params)

    def _fsdp_module(self) -> FSDPModule:
        module = self._setup_module()
        if not isinstance(module, FSDPModule):
            raise ConfigError("FSDP2Strategy.setup(model) has not been called.")
        return module


def _local_world_size() -> int:
    """The ranks on this machine, as the launcher's environment says (for ``auto`` sizes)."""
    return parse_distributed_env(os.environ).local_world_size


def _batch_norms(module: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The BatchNorm layers of ``module`` with parameters (affine) that are not blocks."""
    units = {id(block) for block in blocks}
    return [
        m
        for m in module.modules()
        if isinstance(m, nn.modules.batchnorm._BatchNorm)
        and m.weight is not None
        and id(m) not in units
    ]


__all__ = ["FSDP2Strategy", "shard_blocks"]
