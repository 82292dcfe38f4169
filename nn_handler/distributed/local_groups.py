"""Per-machine process groups (seed 000's create_local_process_group and friends).

The local group is the only per-process state nn_handler keeps. It lives in one explicit
registry, ``LOCAL_GROUPS``, that ``create_local_process_group`` sets and
``destroy_local_process_group`` (and DistributedContext.teardown) clears.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch.distributed as dist

from nn_handler.distributed.communicator.torch_backend import TorchCommunicator
from nn_handler.distributed.env import parse_distributed_env
from nn_handler.errors import ConfigError, LocalGroupSizeError, NoLocalGroupError


@dataclass(frozen=True)
class LocalGroup:
    """This process's machine-local group: the group (None in one process), rank and size."""

    group: dist.ProcessGroup | None
    rank: int
    size: int


class LocalGroupRegistry:
    """Holds the current ``LocalGroup`` of this process, if one was created."""

    def __init__(self) -> None:
        self._current: LocalGroup | None = None

    def get(self) -> LocalGroup | None:
        return self._current

    def set(self, local: LocalGroup) -> None:
        self._current = local

    def clear(self) -> LocalGroup | None:
        previous, self._current = self._current, None
        return previous


#: The process-wide registry of the local group.
LOCAL_GROUPS = LocalGroupRegistry()


def _is_active() -> bool:
    return dist.is_available() and dist.is_initialized()


def create_local_process_group(num_workers_per_machine: int) -> dist.ProcessGroup | None:
    """Create one process group per machine of ``num_workers_per_machine`` consecutive ranks.

    Every rank must call this (torch's new_group is collective). Ranks are assumed placed
    machine by machine, as torchrun and srun do. Returns this process's local group (None in a
    single process, where the only valid value is 1). Calling it again with the same value
    returns the existing group. Raises ``ConfigError`` when the world size is not a
    multiple of ``num_workers_per_machine`` (``LocalGroupSizeError``, also an AssertionError
    as in detectron2); when it disagrees with LOCAL_WORLD_SIZE /
    LOCAL_RANK set by the launcher on any rank, every rank raises
    ``RankFailedError`` naming those ranks.
    """
    n = num_workers_per_machine
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ConfigError(f"num_workers_per_machine must be a positive int, got {n!r}.")
    world_size = dist.get_world_size() if _is_active() else 1
    rank = dist.get_rank() if _is_active() else 0
    if world_size % n:
        raise LocalGroupSizeError(
            f"world size {world_size} is not a multiple of num_workers_per_machine={n}; pass "
            f"the number of processes on each machine (torchrun's --nproc-per-node)."
        )
    placement: ConfigError | None = None
    if "LOCAL_WORLD_SIZE" in os.environ:  # a launcher says how ranks are placed: agree with it
        placement = _check_placement(rank, n)
    if world_size > 1:
        # The placement can be wrong on some ranks only: they must all raise, or the others
        # would wait in new_group forever.
        TorchCommunicator().raise_if_any_failed(placement, "create_local_process_group")
    elif placement is not None:
        raise placement
    existing = LOCAL_GROUPS.get()
    if existing is not None:
        if existing.size == n:
            return existing.group
        raise LocalGroupSizeError(  # an AssertionError too, as detectron2's
            f"a local process group of size {existing.size} already exists; call "
            f"destroy_local_process_group() on every rank before creating one of size {n}."
        )
    mine: dist.ProcessGroup | None = None
    if world_size > 1:
        machine = rank // n
        for index in range(world_size // n):
            group = dist.new_group(list(range(index * n, (index + 1) * n)))
            if index == machine:
                mine = group
    LOCAL_GROUPS.set(LocalGroup(group=mine, rank=rank % n, size=n))
    return mine


def _check_placement(rank: int, n: int) -> ConfigError | None:
    launcher = parse_distributed_env(os.environ)
    if launcher.local_world_size != n:
        return ConfigError(
            f"num_workers_per_machine={n} disagrees with LOCAL_WORLD_SIZE="
            f"{launcher.local_world_size} set by the launcher; pass {launcher.local_world_size}."
        )
    if launcher.local_rank != rank % n:
        return ConfigError(
            f"rank {rank} would be local rank {rank % n} with num_workers_per_machine={n}, but "
            f"LOCAL_RANK={launcher.local_rank}: ranks are not placed machine by machine."
        )
    return None


def get_local_process_group() -> dist.ProcessGroup | None:
    """This machine's process group from ``create_local_process_group``.

    Returns None in a single process. Raises ``NoLocalGroupError`` (a DistributedError and
    an AssertionError, as detectron2's assert) in a distributed run where no local group was
    created yet.
    """
    local = LOCAL_GROUPS.get()
    if local is not None:
        return local.group
    if not _is_active() or dist.get_world_size() == 1:
        return None
    raise NoLocalGroupError(
        "no local process group exists; call create_local_process_group(num_workers_per_machine)"
        " on every rank first."
    )


def destroy_local_process_group() -> None:
    """Destroy the local group if one exists (idempotent). Every rank must call this."""
    local = LOCAL_GROUPS.clear()
    if local is not None and local.group is not None and _is_active():
        gc.collect()  # see context.collect_before_destroy: free DDP reducers first
        dist.destroy_process_group(local.group)


__all__ = [
    "LOCAL_GROUPS",
    "LocalGroup",
    "LocalGroupRegistry",
    "create_local_process_group",
    "destroy_local_process_group",
    "get_local_process_group",
]
