"""Strategy: the one object that knows how the model is parallelised.

The Trainer asks it to prepare the module (device, synchronised BatchNorm), to wrap it (DDP,
torch.compile), to suppress gradient synchronisation inside an accumulation window, to clip
the gradient norm, and to drop its wrappers before the process group goes. The loop itself
never imports torch.distributed. ``SingleDeviceStrategy`` and ``DDPStrategy`` exist today;
sharded strategies (FSDP2) add themselves here.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nn_handler.checkpoint.format import kind_of
from nn_handler.checkpoint.model_state import load_model_state, model_state_dict
from nn_handler.checkpoint.opening import read
from nn_handler.checkpoint.optimizer_state import is_named, to_indexed
from nn_handler.checkpoint.registry import Part
from nn_handler.checkpoint.sharded import load_shards, verify_sharded
from nn_handler.config.training import TrainerConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.strategies.activation_checkpointing import checkpoint_blocks
from nn_handler.strategies.activation_estimate import meta_twin
from nn_handler.strategies.blocks import blocks_of
from nn_handler.strategies.exact_gradients import ExactGradients, ReplicatedGradients
from nn_handler.strategies.meta_init import (
    load_weights_file,
    materialize,
    on_meta,
    transient_buffers,
)
from nn_handler.strategies.reduction_timer import ReductionTimer


class Strategy(ABC):
    """How one rank's model takes part in the run.

    Attributes:
        name: 'single', 'ddp' or 'fsdp' (what ``TrainerConfig.strategy`` names).
        comm: the run's Communicator (its rank and world size are the run's).
        device: this rank's device.
        module: the plain module after ``setup`` (on the device, BatchNorm converted).
        model: what the loop calls in training (the wrapped module), after ``setup``.
        precision: the run's resolved precision ('32', 'bf16', 'fp16').
    """

    name: str = ""
    #: Whether the checkpoint views (``checkpoint_parts``, ``optimizer_state_dict``) are
    #: collectives that every rank must call (a sharded model's).
    collective_state: bool = False

    def __init__(
        self,
        comm: Communicator,
        device: torch.device,
        config: TrainerConfig,
        precision: str = "32",
    ) -> None:
        self.comm = comm
        self.device = device
        self.config = config
        self.precision = precision
        self.module: nn.Module | None = None
        self.model: nn.Module | None = None
        #: The blocks sharded, recomputed or compiled one by one, and their names (after
        #: ``setup``).
        self.blocks: list[nn.Module] = []
        self.block_names: list[str] = []
        #: The model as given, on the meta device (for the memory plan's activation estimate;
        #: None when it cannot be copied), and whether it was built there.
        self.twin: nn.Module | None = None
        self.built_on_meta = False
        self._checkpoint_group: dist.ProcessGroup | None = None

    def setup(self, model: nn.Module) -> tuple[nn.Module, nn.Module]:
        """(plain module, training model): ``model`` moved to the device, prepared and wrapped.
        Called once, before the optimizer is built."""
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be a torch.nn.Module, got {type(model).__name__}.")
        if isinstance(model, nn.parallel.DistributedDataParallel):
            raise ConfigError(
                "pass the plain model, not a DistributedDataParallel wrapper: the strategy wraps "
                "it itself when world size > 1."
            )
        meta = self.built_on_meta = on_meta(model)
        planned = meta or self.name == "fsdp" or self.config.memory_budget is not None
        self.twin = meta_twin(model) if planned else None
        module = model if meta else model.to(self.device)
        self.blocks = self.transform_blocks(module)
        module = self.prepare(module)
        if meta or self.config.init_weights is not None:
            self.initialize(module, meta)
        self.module = module
        wrapped = self.wrap(module)
        if self.config.compile is True:
            wrapped = torch.compile(wrapped, **self.config.compile_kwargs)  # type: ignore[assignment]
        self.model = wrapped
        return self.module, wrapped

    def transform_blocks(self, module: nn.Module) -> list[nn.Module]:
        """The model's blocks (see strategies/blocks.py), with activation checkpointing and
        ``compile: blocks`` applied to each, before the strategy shards or wraps them."""
        settings = self.config.fsdp
        blocks = blocks_of(module, settings, "the units to shard, recompute or compile")
        names = {id(m): name for name, m in module.named_modules()}
        self.block_names = [names[id(block)] for block in blocks]
        checkpoint_blocks(blocks, settings.activation_checkpointing)
        if self.config.compile == "blocks":
            if not blocks:
                raise ConfigError(
                    "compile: 'blocks' compiles each block, and the model has none: name them "
                    "in fsdp.blocks (for example the transformer layer's class) or lower "
                    "fsdp.min_params; compile: true compiles the whole model."
                )
            for block in blocks:
                block.compile(**self.config.compile_kwargs)
        return blocks

    def initialize(self, module: nn.Module, meta: bool) -> None:
        """Give a meta-device ``module`` its storage on this rank (its shards only) and its
        initial weights: from ``init_weights`` when set, else from each module's
        ``reset_parameters`` (strategies/meta_init.py). Every rank must call this."""
        path = self.config.init_weights
        if meta and path is None:
            materialize(module, self.device, self.config.init_seed)
            return
        if meta and transient_buffers(module):  # the file cannot give them: reset first
            materialize(module, self.device, self.config.init_seed)
        elif meta:
            module.to_empty(device=self.device)
        if path is not None and kind_of(path) == "folder":
            self.load_sharded_weights(module, Path(path))
        elif path is not None:
            load_weights_file(module, path)

    def load_sharded_weights(self, module: nn.Module, folder: Path) -> None:
        """Fill ``module`` from the ``model`` of the sharded checkpoint ``folder``, each rank
        reading its own pieces (verified first). Every rank must call this."""
        group = self.checkpoint_group()
        comm = self.comm if group is not None else None
        verify_sharded(folder, comm, read(folder).contents)
        template = {"model": self.model_shards(module)}
        load_shards(folder, template, group)
        self.load_model_shards(module, template["model"], str(folder))

    def prepare(self, module: nn.Module) -> nn.Module:
        """The plain module, ready for this strategy (default: unchanged)."""
        return module

    @abstractmethod
    def wrap(self, module: nn.Module) -> nn.Module:
        """The module the loop trains (``module`` itself, or a wrapper around it)."""

    @property
    def reduces_gradients(self) -> bool:
        """Whether backward averages gradients across ranks (then one rank's NaN reaches
        every rank through the gradients themselves)."""
        return False

    @property
    def shards_gradients(self) -> bool:
        """Whether each rank holds only its shard of the gradients (then a check of them is
        local, and ranks agree through ``agree``)."""
        return False

    def timed_reductions(self) -> ReductionTimer | None:
        """A timer of the gradient reductions' exposed part (see ``ReductionTimer``), from
        the first call on; None when this strategy has no gradient reduction to time (one
        device) or cannot time it (FSDP2 reduces inside its own hooks). Call before the
        first backward."""
        return None

    def agree(self, flag: bool) -> bool:
        """``flag`` and-ed over the ranks where each rank sees only its shard (one tiny
        all-reduce); unchanged otherwise."""
        return flag

    def evaluation(self) -> contextlib.AbstractContextManager[None]:
        """A context around an evaluation pass (every rank enters it), in which ranks may run
        different numbers of forwards without a collective per forward."""
        return contextlib.nullcontext()

    def exact_gradients(self, params: list[nn.Parameter]) -> ExactGradients:
        """Where the reproducible mode reads, sums and puts ``params``' gradients: whole on
        every rank, one all_reduce (a sharded strategy sums each shard: fsdp_gradients.py)."""
        return ReplicatedGradients(params)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        """A context in which backward accumulates gradients without synchronising them (the
        micro-batches of an accumulation window before the last)."""
        return contextlib.nullcontext()

    def clip_grad_norm(
        self, parameters: Iterable[nn.Parameter], max_norm: float, norm_type: float
    ) -> torch.Tensor:
        """Clip the gradients' ``norm_type`` norm to ``max_norm`` (the norm of the whole
        model's gradients, on every rank alike) and return the norm before clipping."""
        return torch.nn.utils.clip_grad_norm_(list(parameters), max_norm, norm_type=norm_type)

    def checkpoint_parts(self) -> list[Part]:
        """The model's parts of a checkpoint: ``model`` (weights and buffers with plain keys,
        shared) and, with several ranks, ``buffers`` (each rank's own: BatchNorm statistics
        differ between the ranks' forwards). A sharded strategy returns collective views."""
        module = self._setup_module()
        parts = [
            Part(
                "model",
                lambda: model_state_dict(module),
                lambda state, source: load_model_state(module, state, source=source),
                missing="error",
                shards=lambda: self.model_shards(module),
                load_shards=lambda state, source: self.load_model_shards(module, state, source),
            )
        ]
        if self.comm.world_size > 1:
            parts.append(
                Part(
                    "buffers",
                    lambda: {n: b.detach().clone() for n, b in module.named_buffers()},
                    lambda state, _source: _copy_buffers(module, state),
                    per_rank=True,
                    missing="ignore",
                )
            )
        return parts

    def module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        """The whole state of ``module`` (this strategy's kind of model) with plain keys."""
        return model_state_dict(module)

    def load_module_state_dict(
        self, module: nn.Module, state: Mapping[str, Any], source: str
    ) -> None:
        """Load a state from ``module_state_dict`` into ``module``."""
        load_model_state(module, state, source=source)

    # ----------------------------------------------------------------- sharded views (DCP)
    def model_shards(self, module: nn.Module) -> dict[str, Any]:
        """The state of ``module`` as a sharded checkpoint holds it: plain keys, DTensors where
        the module is sharded (torch.distributed.checkpoint.state_dict's view). Every rank must
        call this."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return dict(get_model_state_dict(module))

    def load_model_shards(self, module: nn.Module, state: Mapping[str, Any], source: str) -> None:
        """Load a state of the form ``model_shards`` returns (filled by DCP) into ``module``."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        check_loaded(set_model_state_dict(module, dict(state)), module, source)

    def optimizer_shards(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state as a sharded checkpoint holds it (keyed by parameter name,
        DTensors where the model is sharded). Every rank must call this."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return dict(get_optimizer_state_dict(self._setup_module(), optimizer))

    def load_optimizer_shards(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        """Load a state of the form ``optimizer_shards`` returns (filled by DCP)."""
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self._setup_module(), optimizer, dict(state))

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The process group of sharded checkpoints' collectives: a gloo group of their own,
        made at the first call (every rank must call it then), so that a save running in the
        background never interleaves with training's collectives (and one whose backend
        handles CPU tensors, which DCP's coordination needs, also beside nccl). None in one
        process without a process group."""
        world = self.comm.world_size
        grouped = dist.is_available() and dist.is_initialized()
        if grouped and self._checkpoint_group is not None:
            return self._checkpoint_group
        if world == 1 and not (grouped and dist.get_world_size() == 1):
            return None  # one process without a group: DCP runs without collectives
        if not grouped or dist.get_world_size() != world:
            raise ConfigError(
                f"sharded checkpoints are written by every rank through a torch.distributed "
                f"process group, and this run's communicator (world size {world}) has none "
                f"of that size; use checkpoint.format='file' with a test communicator."
            )
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return self._checkpoint_group

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer's state as a checkpoint holds it."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]
    ) -> None:
        """Load a state from ``optimizer_state_dict`` into ``optimizer``; a state keyed by
        parameter name (written by the FSDP2 strategy) is converted."""
        if is_named(state):
            state = to_indexed(state, self._setup_module(), optimizer)
        optimizer.load_state_dict(dict(state))

    def _setup_module(self) -> nn.Module:
        if self.module is None:
            raise ConfigError(f"{type(self).__name__}.setup(model) has not been called.")
        return self.module

    def release(self) -> None:
        """Drop the wrappers (call before the process group is destroyed); the plain module
        stays usable for evaluation."""
        self.model = self.module
        group, self._checkpoint_group = self._checkpoint_group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.comm.world_size}, device={self.device})"


def check_loaded(result: Any, module: nn.Module, source: str) -> None:
    """Raise CheckpointError when ``load_state_dict``'s ``result`` names missing or
    unexpected keys."""
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(
            f"the weights in {source} do not match {type(module).__name__}: missing "
            f"{list(result.missing_keys)[:10]}, unexpected {list(result.unexpected_keys)[:10]}."
        )


def _copy_buffers(module: nn.Module, saved: Mapping[str, torch.Tensor]) -> None:
    for name, buffer in module.named_buffers():
        if name in saved:
            buffer.copy_(saved[name])


__all__ = ["Strategy", "check_loaded"]
