"""Module-level functions of seeds 000 (dist_utils) and 004 (helios.core.distributed).

They read torch.distributed's default group (the engine's own global state) and build a
Communicator per call; they keep no state of their own. "Where am I" comes from one place,
``get_dist_info``: the initialised group when there is one, else the launcher's environment,
so ``get_rank()`` is already right under torchrun before ``init_process_group``.

In one process every function works and returns the single-process answer, except those whose
seed documents an error when distributed is not initialised (``gather_into_tensor``,
``all_reduce_tensors``), which raise ``DistributedError`` (a
RuntimeError).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from nn_handler.distributed.communicator import Communicator, NullCommunicator, TorchCommunicator
from nn_handler.distributed.communicator.base import ReduceOp
from nn_handler.distributed.env import DistributedInfo, is_torchrun_env, parse_distributed_env
from nn_handler.distributed.local_groups import LOCAL_GROUPS
from nn_handler.errors import ConfigError, DistributedError


def is_dist_active() -> bool:
    """True when torch.distributed is available and its default group is initialised."""
    return dist.is_available() and dist.is_initialized()


def is_using_torchrun() -> bool:
    """True when this process was started by torchrun (its worker variables are set)."""
    return is_torchrun_env(os.environ)


def communicator(group: dist.ProcessGroup | None = None) -> Communicator:
    """A Communicator over ``group`` when distributed is active, else a NullCommunicator."""
    if is_dist_active():
        return TorchCommunicator(group)
    return NullCommunicator()


def get_dist_info() -> DistributedInfo:
    """Who this process is: from the initialised group, else from the launcher's environment.

    Without distributed training both ranks are 0 and both world sizes 1. When the group was
    initialised by hand (no launcher variables) the run is assumed to be on one machine. A
    local group made by create_local_process_group overrides the local rank and size.
    """
    info = parse_distributed_env(os.environ)
    if is_dist_active():
        rank, world_size = dist.get_rank(), dist.get_world_size()
        if (info.rank, info.world_size) != (rank, world_size):
            info = DistributedInfo(
                local_rank=rank,
                rank=rank,
                local_world_size=world_size,
                world_size=world_size,
                launcher="manual",
            )
    local = LOCAL_GROUPS.get()
    if local is not None and (local.rank, local.size) != (info.local_rank, info.local_world_size):
        info = dataclasses.replace(
            info,
            local_rank=local.rank,
            local_world_size=local.size,
            node_rank=info.rank // local.size,
        )
    return info


def get_world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of processes in ``group`` (default: the whole run); 1 without distributed."""
    if is_dist_active():
        return dist.get_world_size(group)
    return get_dist_info().world_size


def get_rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (default: global); 0 without distributed."""
    if is_dist_active():
        return dist.get_rank(group)
    return get_dist_info().rank


def get_global_rank() -> int:
    """This process's global rank; 0 without distributed."""
    return get_rank()


def get_local_rank() -> int:
    """This process's rank on its machine (LOCAL_RANK under torchrun); 0 without distributed."""
    return get_dist_info().local_rank


def get_local_world_size() -> int:
    """Number of processes on this machine (LOCAL_WORLD_SIZE); 1 without distributed."""
    return get_dist_info().local_world_size


def get_local_size() -> int:
    """Size of this machine's process group (same as ``get_local_world_size``)."""
    return get_dist_info().local_world_size


def is_main_process() -> bool:
    """True on global rank 0."""
    return get_rank() == 0


def synchronize() -> None:
    """Barrier over all processes; a no-op without distributed. Every rank must call this."""
    communicator().barrier()


def safe_barrier(**kwargs: Any) -> None:
    """torch.distributed.barrier that is a no-op when distributed is not active.

    Accepts ``group``, ``device_ids`` (the communicator picks the device itself),
    ``timeout`` (seconds or timedelta; on gloo the error names the ranks that did not arrive)
    and ``async_op`` (accepted; the barrier completes before this returns, and None is
    returned, as seed 004's does). Every rank must call this.
    """
    group = kwargs.pop("group", None)
    kwargs.pop("device_ids", None)
    kwargs.pop("async_op", None)
    timeout = kwargs.pop("timeout", None)
    if kwargs:
        raise ConfigError(
            f"safe_barrier got unexpected keyword(s) {sorted(kwargs)}; accepted: group, "
            f"device_ids, timeout."
        )
    communicator(group).barrier(timeout)


def all_gather(
    data: Any, group: dist.ProcessGroup | None = None, safe_clone: bool = True
) -> list[Any]:
    """Gather any picklable ``data`` from every rank; every rank gets the list, by rank.

    Every rank must call this. In one process the result is ``[data]``, as in the originals.
    With ``safe_clone`` (default) tensors in ``data`` (itself, or in its lists, tuples and
    dicts) are detached before they travel, so every gathered tensor is a copy without
    autograd history (seed 000); without it, this rank's entry is ``data`` itself. For
    tensors, ``Communicator.all_gather`` avoids pickling.
    """
    comm = communicator(group)
    if comm.world_size == 1:
        return [data]
    gathered = comm.all_gather_object(_detached(data) if safe_clone else data)
    if not safe_clone:
        gathered[comm.rank] = data
    return gathered


def _detached(data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.detach()
    if isinstance(data, list):
        return [_detached(item) for item in data]
    if isinstance(data, tuple) and not hasattr(data, "_fields"):
        return tuple(_detached(item) for item in data)
    if isinstance(data, dict):
        return {key: _detached(value) for key, value in data.items()}
    return data


def gather(data: Any, dst: int = 0, group: dist.ProcessGroup | None = None) -> list[Any]:
    """Gather picklable ``data`` on rank ``dst`` (a list by rank); others get ``[]``.

    Every rank must call this.
    """
    return communicator(group).gather_object(data, dst)


def reduce_dict(
    input_dict: Mapping[str, Any], average: bool = True, *, ignore_nan: bool = False
) -> dict[str, Any]:
    """Sum or average a dict of numbers/tensors over all ranks; every rank gets the result
    (detectron2's gives it to rank 0 only), keys sorted. In one process, as detectron2's, the
    input itself comes back unchanged.

    As the originals, a NaN or inf on any rank propagates; ``ignore_nan=True`` leaves NaN
    ranks out of each key's mean instead (see ``Communicator.reduce_dict``). Every rank must
    call this with the same keys: different keys raise CollectiveMismatchError on every rank.
    """
    comm = communicator()
    if comm.world_size < 2:
        return input_dict  # type: ignore[return-value]
    return comm.reduce_dict(input_dict, average=average, ignore_nan=ignore_nan)


def shared_random_seed() -> int:
    """A random seed in [0, 2**31) that is identical on every rank. Every rank must call this."""
    return communicator().shared_random_seed()


def _require_active(name: str) -> None:
    if not is_dist_active():
        raise DistributedError(
            f"{name} needs an initialised process group; call init_dist() (or "
            f"DistributedContext.setup()) first."
        )


def gather_into_tensor(tensor: torch.Tensor, size: Sequence[int], **kwargs: Any) -> torch.Tensor:
    """All ranks' tensors merged into one tensor of shape ``size``, on every rank.

    ``size`` is either the concatenation along dim 0 (``(world * n, ...)``) or any shape with
    that many elements, e.g. stacked ``(world, n, ...)``. Accepts ``group`` and ``async_op``
    (the gather completes before this returns). Every rank must call this. Raises
    ``DistributedError`` (a RuntimeError) when distributed is not initialised, and
    ``ConfigError`` when ``size`` does not fit.
    """
    _require_active("gather_into_tensor")
    group = _pop_group_kwargs("gather_into_tensor", kwargs)
    merged = communicator(group).gather_into_tensor(tensor)
    shape = tuple(int(s) for s in size)
    if tuple(merged.shape) == shape:
        return merged
    if merged.numel() != torch.Size(shape).numel():
        raise ConfigError(
            f"gather_into_tensor: size={shape} does not hold the gathered {tuple(merged.shape)} "
            f"({merged.numel()} elements)."
        )
    return merged.reshape(shape)


_TORCH_TO_OP: dict[Any, ReduceOp] = {
    dist.ReduceOp.SUM: "sum",
    dist.ReduceOp.AVG: "mean",
    dist.ReduceOp.MIN: "min",
    dist.ReduceOp.MAX: "max",
    dist.ReduceOp.PRODUCT: "product",
}


def all_reduce_tensors(tensor: torch.Tensor | list[torch.Tensor], **kwargs: Any) -> torch.Tensor:
    """Reduce tensor(s) across all ranks so all have the same value (default op: sum).

    A list is concatenated (torch.cat) into one tensor first; a list of 0-d tensors (scalars)
    is stacked into a 1-d one. ``op`` takes a torch.distributed.ReduceOp (SUM, AVG, MIN, MAX,
    PRODUCT) or 'sum'/'mean'/'min'/'max'/'product'; ``group`` is accepted, and ``async_op``
    too (the reduction completes before this returns). As torch.distributed.all_reduce does,
    a single input tensor is updated in place (when the result keeps its dtype), also an
    ``nn.Parameter`` or another tensor that requires grad, and returned. Every rank must call
    this. Raises ``DistributedError`` (a RuntimeError) when not initialised.
    """
    _require_active("all_reduce_tensors")
    op_arg = kwargs.pop("op", dist.ReduceOp.SUM)
    group = _pop_group_kwargs("all_reduce_tensors", kwargs)
    op = op_arg if isinstance(op_arg, str) else _TORCH_TO_OP.get(op_arg)
    if op is None:
        raise ConfigError(f"all_reduce_tensors: unsupported op {op_arg!r}.")
    source = _joined(list(tensor)) if isinstance(tensor, list | tuple) else tensor
    reduced = communicator(group).all_reduce(source, op=op)  # type: ignore[arg-type]
    if source is tensor and reduced.dtype == source.dtype:
        with torch.no_grad():  # as c10d's in-place collectives, outside autograd
            source.copy_(reduced)
        return source
    return reduced


def _joined(tensors: list[torch.Tensor]) -> torch.Tensor:
    if tensors and all(t.dim() == 0 for t in tensors):
        return torch.stack(tensors)
    return torch.cat(tensors)


def _pop_group_kwargs(name: str, kwargs: dict[str, Any]) -> dist.ProcessGroup | None:
    group: dist.ProcessGroup | None = kwargs.pop("group", None)
    kwargs.pop("async_op", None)  # accepted: the call returns its result, so it completes
    if kwargs:
        raise ConfigError(f"{name} got unexpected keyword(s) {sorted(kwargs)}.")
    return group


__all__ = [
    "all_gather",
    "all_reduce_tensors",
    "communicator",
    "gather",
    "gather_into_tensor",
    "get_dist_info",
    "get_global_rank",
    "get_local_rank",
    "get_local_size",
    "get_local_world_size",
    "get_rank",
    "get_world_size",
    "is_dist_active",
    "is_main_process",
    "is_using_torchrun",
    "reduce_dict",
    "safe_barrier",
    "shared_random_seed",
    "synchronize",
]
