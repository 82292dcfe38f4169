"""TorchCommunicator: collectives over a torch.distributed process group (gloo, nccl, ...)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from typing_extensions import override

from nn_handler.distributed.communicator.base import BackendReduceOp, Communicator, Waiter
from nn_handler.distributed.faults.watchdog import WATCHDOGS
from nn_handler.errors import DistributedError

# torch 2.13 renamed all_gather_into_tensor to all_gather_single; support both.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "product": dist.ReduceOp.PRODUCT,
}


class TorchCommunicator(Communicator):
    """Collectives over an initialised torch.distributed group (the default group if None).

    Ranks (``rank``, ``src``, ``dst``) are ranks within ``group``. Tensors travel on CUDA for
    nccl (the current CUDA device unless ``device`` is given) and on CPU otherwise.
    On the default group, while a stall watchdog runs (DistributedContext starts one), every
    collective is recorded for it unless ``watch=False``. Raises ``DistributedError`` when
    torch.distributed is not initialised or this process is not in ``group``.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        *,
        device: torch.device | None = None,
        debug: bool | None = None,
        watch: bool = True,
    ) -> None:
        super().__init__(debug=debug)
        if not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "TorchCommunicator needs an initialised torch.distributed process group; call "
                "DistributedContext.setup() (or init_dist) first, or use NullCommunicator for a "
                "single process."
            )
        rank = dist.get_rank(group)
        if rank < 0:
            raise DistributedError(
                f"global rank {dist.get_rank()} is not a member of the group passed to "
                f"TorchCommunicator; build it only on the group's members."
            )
        self._group = group
        self._rank = rank
        self._world_size = dist.get_world_size(group)
        self._backend = str(dist.get_backend(group)).lower()
        if device is None:
            uses_cuda = "nccl" in self._backend
            device = torch.device("cuda", torch.cuda.current_device()) if uses_cuda else None
        self._device = device or torch.device("cpu")
        if group is None and watch:  # the default group's collectives, for the watchdog
            self._watch = WATCHDOGS.ledger()

    @property
    @override
    def rank(self) -> int:
        return self._rank

    @property
    @override
    def world_size(self) -> int:
        return self._world_size

    @property
    @override
    def device(self) -> torch.device:
        return self._device

    @property
    def backend(self) -> str:
        """The process group's backend name ('gloo', 'nccl', ...)."""
        return self._backend

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group (None: the default group)."""
        return self._group

    def _global_rank(self, group_rank: int) -> int:
        return group_rank if self._group is None else dist.get_global_rank(self._group, group_rank)

    @override
    def _do_barrier(self, timeout: timedelta | None) -> None:
        try:
            if timeout is not None and self._backend == "gloo":
                dist.monitored_barrier(group=self._group, timeout=timeout, wait_all_ranks=True)
            elif self._device.type == "cuda":
                dist.barrier(group=self._group, device_ids=[self._device.index or 0])
            else:
                dist.barrier(group=self._group)
        except RuntimeError as error:
            raise DistributedError(
                f"barrier failed on rank {self._rank}: {error}\nEvery rank must call barrier(); "
                f"the ranks named above did not arrive in time (crashed, hung, or took another "
                f"code path). Tear the process group down after this error."
            ) from error

    @override
    def _do_all_reduce(self, tensor: torch.Tensor, op: BackendReduceOp) -> torch.Tensor:
        dist.all_reduce(tensor, op=_TORCH_OPS[op], group=self._group)
        return tensor

    @override
    def _do_all_reduce_async(self, tensor: torch.Tensor, op: BackendReduceOp) -> Waiter:
        work = dist.all_reduce(tensor, op=_TORCH_OPS[op], group=self._group, async_op=True)

        def wait() -> torch.Tensor:
            if work is not None:
                work.wait()
            return tensor

        return wait

    @override
    def _do_broadcast(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, src=self._global_rank(src), group=self._group)
        return tensor

    @override
    def _do_all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        flat = tensor.reshape(-1).contiguous()
        out = flat.new_empty((self._world_size * flat.numel(),))
        _all_gather_single(out, flat, group=self._group)
        return [part.view(tensor.shape) for part in out.chunk(self._world_size)]

    @override
    def _do_gather(self, tensor: torch.Tensor, dst: int) -> list[torch.Tensor] | None:
        tensor = tensor.contiguous()
        is_dst = self._rank == dst
        parts = [torch.empty_like(tensor) for _ in range(self._world_size)] if is_dst else None
        dist.gather(tensor, parts, dst=self._global_rank(dst), group=self._group)
        return parts
