"""DistributedContext: who this process is, which device it uses, and the process group's life."""

from __future__ import annotations

import dataclasses
import gc
import os
from collections.abc import Mapping
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger
from torch._C._distributed_c10d import HashStore, PrefixStore, Store, TCPStore

from nn_handler.config import DistributedConfig
from nn_handler.config.base import validate_config
from nn_handler.distributed.communicator import Communicator, NullCommunicator, TorchCommunicator
from nn_handler.distributed.device import resolve_device
from nn_handler.distributed.env import DistributedInfo, parse_distributed_env
from nn_handler.distributed.faults import liveness
from nn_handler.distributed.faults.watchdog import WATCHDOGS
from nn_handler.distributed.local_groups import (
    LOCAL_GROUPS,
    create_local_process_group,
    destroy_local_process_group,
)
from nn_handler.errors import ConfigError, DistributedError


def collect_before_destroy() -> None:
    """Free unreachable objects that still use a process group before destroying it.

    DistributedDataParallel modules sit in reference cycles; if the garbage collector frees one
    after its group is destroyed (at interpreter exit, say), the C++ reducer aborts the process
    ("terminate called without an active exception") even though the work succeeded.
    """
    gc.collect()


def resolve_backend(backend: str, device: torch.device) -> str:
    """'auto' -> nccl on CUDA devices, gloo otherwise. nccl without CUDA is a ConfigError. A
    per-device form ('cpu:gloo,cuda:nccl') keeps the entries this torch build can create."""
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if ":" in backend:
        return _available_entries(backend, device)
    if backend == "nccl" and device.type != "cuda":
        raise ConfigError(
            f"backend 'nccl' needs CUDA, but this process uses device {device} (CUDA is not "
            f"available or a CPU device was asked for). Use backend='gloo' (or 'auto') on CPU."
        )
    return backend


def _info_from_group(info: DistributedInfo) -> DistributedInfo:
    """Reconcile ``info`` with an already-initialised default group."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if info.world_size == world_size and info.rank == rank:
        return info
    if info.launcher not in ("single", "manual"):
        raise DistributedError(
            f"the initialised process group has rank {rank} of {world_size}, but the "
            f"{info.launcher} environment says rank {info.rank} of {info.world_size}. Initialise "
            f"the group with the launcher's RANK/WORLD_SIZE."
        )
    # The group was initialised by hand: assume one machine, as a manual launch does.
    return dataclasses.replace(
        info,
        rank=rank,
        world_size=world_size,
        local_rank=rank,
        local_world_size=world_size,
        node_rank=0,
        launcher="manual",
    )


class DistributedContext:
    """Where this process stands in the run and the lifecycle of its process group.

    ``config``: a DistributedConfig or a dict of its fields. Build it from the environment (the
    default) or explicit ``rank``/``world_size``, then call
    ``setup`` on every rank (or use it as a context manager). With more than one process
    setup initialises the default process group, or adopts one that is already initialised.
    ``teardown`` destroys only the groups this context created and is idempotent.
    Configuration errors (inconsistent environment, nccl without CUDA, an unknown device) are
    raised by the constructor, before any socket is opened.
    """

    def __init__(
        self,
        config: DistributedConfig | Mapping[str, Any] | None = None,
        *,
        info: DistributedInfo | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.config = (
            config
            if isinstance(config, DistributedConfig)
            else validate_config(DistributedConfig, config or {}, "DistributedContext(config)")
        )
        source = os.environ if env is None else env
        self._info = info or parse_distributed_env(source, rank=rank, world_size=world_size)
        self._agent_store = source.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        self._restart_count = source.get("TORCHELASTIC_RESTART_COUNT", "0").strip() or "0"
        self.device = resolve_device(self.config.device, self._info.local_rank)
        self.backend = resolve_backend(self.config.backend, self.device)
        self._owns_group = False
        self._owns_local_group = False
        self._owns_watchdog = False
        self._communicator: Communicator | None = None

    # ----------------------------------------------------------------- identity
    @property
    def info(self) -> DistributedInfo:
        """Who this process is (reconciled with the process group once set up)."""
        return self._info

    @property
    def rank(self) -> int:
        return self._info.rank

    @property
    def local_rank(self) -> int:
        return self._info.local_rank

    @property
    def world_size(self) -> int:
        return self._info.world_size

    @property
    def is_main_process(self) -> bool:
        return self._info.rank == 0

    @property
    def is_distributed(self) -> bool:
        """True once a torch.distributed group is in use by this context."""
        return isinstance(self._communicator, TorchCommunicator)

    @property
    def communicator(self) -> Communicator:
        """The Communicator for this run; available after ``setup``."""
        if self._communicator is None:
            raise DistributedError("DistributedContext.communicator: call setup() first.")
        return self._communicator

    @property
    def should_initialize(self) -> bool:
        """Whether setup creates a process group (config.enabled, else world_size > 1)."""
        if self.config.enabled is not None:
            return self.config.enabled
        return self._info.world_size > 1

    # ----------------------------------------------------------------- lifecycle
    def init_method(self) -> str:
        """The rendezvous URL passed to init_process_group."""
        if self.config.init_method:
            return self.config.init_method
        info = self._info
        if info.master_addr and info.master_port:
            host = f"[{info.master_addr}]" if ":" in info.master_addr else info.master_addr
            return f"tcp://{host}:{info.master_port}"
        raise ConfigError(
            f"rank {info.rank} of {info.world_size} has no rendezvous address: set MASTER_ADDR "
            f"and MASTER_PORT (torchrun does), or pass "
            f"DistributedConfig(init_method='tcp://HOST:PORT')."
        )

    def setup(self) -> DistributedContext:
        """Join the run. Every rank must call this. Returns self.

        Initialises the default process group when ``should_initialize`` (or adopts an
        already-initialised one) and builds the communicator. Raises DistributedError when
        the rendezvous fails or the existing group contradicts the environment.
        """
        if self._communicator is not None:
            return self
        debug = self.config.debug_collectives or None
        if dist.is_available() and dist.is_initialized():
            self._info = _info_from_group(self._info)
        elif self.should_initialize:
            self._init_process_group()
        if dist.is_available() and dist.is_initialized():
            self._start_watchdog()
            comm_device = self.device if self.device.type == "cuda" else None
            self._communicator = TorchCommunicator(
                device=comm_device, debug=debug, watch=self.config.stall_timeout is not None
            )
        else:
            self._communicator = NullCommunicator(debug=debug)
        logger.debug("rank {} joined: {} on {}", self.rank, self._info, self.device)
        return self

    def _start_watchdog(self) -> None:
        stall = self.config.stall_timeout
        if stall is None or self._info.world_size < 2:
            return
        if WATCHDOGS.watchdog() is None:
            # Under torchrun the agent is this worker's parent: when it is gone, the worker is
            # an orphan and stops (LauncherGoneError) instead of training on.
            agent = os.getppid() if self._info.launcher == "torchrun" else None
            info = self._info
            self._owns_watchdog = WATCHDOGS.start(info.rank, info.world_size, stall, agent)

    def _init_process_group(self) -> None:
        if not dist.is_available():
            raise DistributedError("torch.distributed is not available in this torch build.")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        info = self._info
        if info.world_size == 1 and not self.config.init_method and not info.master_port:
            init: dict[str, object] = {"store": HashStore()}
            where = "an in-process store"
        elif self._agent_store and not self.config.init_method:
            where = f"{self.init_method()} (torchrun's store, restart {self._restart_count})"
            init = {"store": self._restart_store()}
        else:
            where = self.init_method()
            init = {"init_method": where}
        try:
            dist.init_process_group(
                self.backend,
                rank=info.rank,
                world_size=info.world_size,
                timeout=self.config.timeout,
                **init,  # type: ignore[arg-type]
            )
        except Exception as error:
            raise DistributedError(
                f"rank {info.rank} could not initialise the {self.backend} process group of "
                f"{info.world_size} via {where}: {error}. Check that every rank uses the same "
                f"MASTER_ADDR/MASTER_PORT and that the port is free on the master."
            ) from error
        self._owns_group = True
        liveness.register(info.rank)

    def _restart_store(self) -> Store:
        """A client of torchrun's store, with keys private to this restart and this group.

        torchrun's static rendezvous keeps one store across restarts, so a restarted group
        could read the addresses its failed predecessor published there and fail to connect;
        likewise a second group created in the same process (a notebook, a sweep, a test
        suite) would read the first one's. Each rank counts the groups it created in this
        restart in the store itself, so the n-th group of every rank shares one fresh prefix.
        """
        info = self._info
        client = TCPStore(
            str(info.master_addr),
            int(info.master_port or 0),
            is_master=False,
            timeout=self.config.timeout,
        )
        restart = f"nn_handler/restart{self._restart_count}"
        generation = client.add(f"{restart}/groups_created/rank{info.rank}", 1)
        return PrefixStore(f"{restart}/group{generation}", client)

    def create_local_process_group(self, num_workers_per_machine: int | None = None) -> None:
        """Create the per-machine groups (default size: the launcher's local world size).

        Every rank must call this after ``setup``. The groups are destroyed by teardown.
        """
        size = num_workers_per_machine or self._info.local_world_size
        existed = LOCAL_GROUPS.get() is not None
        create_local_process_group(size)
        self._owns_local_group = self._owns_local_group or not existed

    def teardown(self) -> None:
        """Destroy the groups this context created. Idempotent; every rank must call it.

        With the stall watchdog, the ranks compare their collectives one last time first (a
        bounded wait for the others): a mismatch in the last collectives, or a rank still
        waiting in one this rank never issued, is raised here, after the groups are gone,
        as the same CollectiveMismatchError on every rank."""
        incident: BaseException | None = None
        if self._owns_watchdog:
            incident = WATCHDOGS.finish()
            self._owns_watchdog = False
        if self._owns_local_group:
            destroy_local_process_group()
            self._owns_local_group = False
        if self._owns_group and dist.is_available() and dist.is_initialized():
            collect_before_destroy()
            dist.destroy_process_group()
        self._owns_group = False
        self._communicator = None
        if incident is not None:
            raise incident

    def __enter__(self) -> DistributedContext:
        return self.setup()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.teardown()

    def __repr__(self) -> str:
        return (
            f"DistributedContext(rank={self.rank}, world_size={self.world_size}, "
            f"device={self.device}, backend={self.backend!r})"
        )


def _available_entries(mapping: str, device: torch.device) -> str:
    pairs = [tuple(part.split(":")) for part in mapping.split(",")]
    usable = [
        (kind, name)
        for kind, name in pairs
        if dist.is_backend_available(name) and (kind != "cuda" or torch.cuda.is_available())
    ]
    if not any(kind == device.type for kind, _ in usable):
        raise ConfigError(
            f"backend {mapping!r} has no entry this machine can use for device {device} "
            f"(available: {[n for n in ('gloo', 'nccl', 'mpi') if dist.is_backend_available(n)]})."
        )
    if len(usable) < len(pairs):
        left_out = [f"{kind}:{name}" for kind, name in pairs if (kind, name) not in usable]
        logger.warning(
            "backend {!r}: leaving out {} (not available on this machine)", mapping, left_out
        )
    return ",".join(f"{kind}:{name}" for kind, name in usable)


__all__ = ["DistributedContext", "resolve_backend"]
