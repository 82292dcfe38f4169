"""DDPStrategy: every rank holds the whole model; DistributedDataParallel averages gradients.

The collectives it makes outside the Communicator are DDP's own (the reducer's bucketed
all-reduce in backward, the parameter broadcast at wrapping) and, with ``sync_batchnorm``,
SyncBatchNorm's per-layer statistics reduction: both run on torch.distributed's default group,
which the run's Communicator also spans.
"""

from __future__ import annotations

import contextlib

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from nn_handler.errors import ConfigError
from nn_handler.strategies.base import Strategy
from nn_handler.strategies.reduction_timer import ReductionTimer
from nn_handler.strategies.sync_batchnorm import convert_sync_batchnorm


class DDPStrategy(Strategy):
    """DistributedDataParallel over torch.distributed's default group (device_ids for CUDA,
    none for CPU), with synchronised BatchNorm when ``sync_batchnorm`` asks for it."""

    name = "ddp"
    _ddp: DistributedDataParallel | None = None
    _timer: ReductionTimer | None = None

    def prepare(self, module: nn.Module) -> nn.Module:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(
                f"strategy 'ddp' needs an initialised process group, and there is none (the "
                f"communicator reports world size {self.comm.world_size}). Launch with torchrun, "
                f"SLURM or nn_handler.launch, or use strategy 'auto'."
            )
        if dist.get_world_size() != self.comm.world_size:
            raise ConfigError(
                f"strategy 'ddp': the communicator reports world size {self.comm.world_size} but "
                f"the process group has {dist.get_world_size()}; DDP averages over the group."
            )
        if self.config.sync_batchnorm and self.comm.world_size > 1:
            module = convert_sync_batchnorm(module, self.device)
        return module

    def wrap(self, module: nn.Module) -> nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        self._ddp = DistributedDataParallel(
            module,
            device_ids=device_ids,
            find_unused_parameters=self.config.find_unused_parameters,
        )
        return self._ddp

    @property
    def reduces_gradients(self) -> bool:
        return self._ddp is not None

    def timed_reductions(self) -> ReductionTimer | None:
        """DDP's all-reduce through a timing communication hook (registered once: DDP takes
        one hook per model)."""
        if self._ddp is None:
            return None
        if self._timer is None:
            self._timer = ReductionTimer(cuda=self.device.type == "cuda")
            timer = self._timer
            # A lambda: DDP checks the hook's annotations, which postponed ones would fail.
            self._ddp.register_comm_hook(None, lambda state, bucket: timer.hook(state, bucket))
        return self._timer

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        if self._ddp is None:
            return contextlib.nullcontext()
        return self._ddp.no_sync()

    def release(self) -> None:
        self._ddp = None
        self._timer = None
        super().release()


__all__ = ["DDPStrategy"]
