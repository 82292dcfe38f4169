"""Configuration of the distributed run and of the loaders."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from nn_handler.config.base import ConfigModel

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|gpu|mps|(cuda|gpu):[0-9]+)$")

#: A backend name ('auto', 'gloo', 'nccl', 'mpi', 'ucc', ..., any case) or torch's per-device
#: form 'cpu:gloo,cuda:nccl'; validated and lower-cased by DistributedConfig.
Backend = str
_BACKEND_NAMES = ("gloo", "nccl", "mpi", "ucc", "xccl", "hccl")
_BACKEND_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu", "privateuseone")


class DistributedConfig(ConfigModel):
    """How this process joins the run.

    Attributes:
        enabled: None: distributed when the launcher describes more than one process;
            True: always create a process group (even of one process); False: never.
        backend: 'auto' picks nccl when the device is CUDA and gloo otherwise; or a backend
            name (case-insensitive) or torch's per-device form 'cpu:gloo,cuda:nccl' (entries
            whose backend this torch build lacks are left out, with a warning).
        device: 'auto', 'cpu', 'cuda', 'gpu', 'cuda:N' or 'mps'.
        timeout: the process group's timeout for a collective (30 minutes): the last resort
            when the stall watchdog cannot act (collectives it does not see, waits marked
            patient); ``initialize_ddp`` keeps seed 002's 60 minutes.
        stall_timeout: how long a rank may wait in one collective before the stall watchdog
            makes every rank raise CollectiveStallError with one report (5 minutes, or half
            of a shorter ``timeout``); None turns the watchdog off. Must be shorter than
            ``timeout``.
        init_method: a torch init_method URL ('tcp://host:port', 'file:///path'); by default
            tcp://MASTER_ADDR:MASTER_PORT from the launcher.
        debug_collectives: check that every rank calls the same collective with compatible
            tensors before each one (also switched on by NN_HANDLER_DEBUG_COLLECTIVES=1).
    """

    enabled: bool | None = None
    backend: Backend = "auto"
    device: str = "auto"
    timeout: timedelta = timedelta(minutes=30)
    stall_timeout: timedelta | None = timedelta(minutes=5)
    init_method: str | None = None
    debug_collectives: bool = False

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str) -> str:
        normalized = value.strip().lower().replace(" ", "")
        if normalized == "auto" or normalized in _BACKEND_NAMES:
            return normalized
        pairs = [part.partition(":") for part in normalized.split(",")]
        if ":" in normalized and all(
            device in _BACKEND_DEVICES and sep and name in _BACKEND_NAMES
            for device, sep, name in pairs
        ):
            return normalized
        raise ValueError(
            f"unknown backend {value!r}; use 'auto', one of {', '.join(_BACKEND_NAMES)}, or "
            f"torch's per-device form such as 'cpu:gloo,cuda:nccl'"
        )

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        normalized = value.strip().lower()
        if not _DEVICE_PATTERN.match(normalized):
            raise ValueError(
                f"unknown device {value!r}; use 'auto', 'cpu', 'cuda', 'gpu', 'cuda:N' or 'mps'"
            )
        return normalized

    @field_validator("timeout", "stall_timeout")
    @classmethod
    def _check_timeout(cls, value: timedelta | None, info: ValidationInfo) -> timedelta | None:
        if value is not None and value.total_seconds() <= 0:
            raise ValueError(f"{info.field_name} must be positive, got {value}")
        return value

    @model_validator(mode="after")
    def _stall_before_timeout(self) -> DistributedConfig:
        if self.stall_timeout is None or self.stall_timeout < self.timeout:
            return self
        if "stall_timeout" not in self.model_fields_set:  # a short timeout, the default stall
            self.__dict__["stall_timeout"] = self.timeout / 2
            return self
        if self.stall_timeout >= self.timeout:
            raise ValueError(
                f"stall_timeout ({self.stall_timeout}) must be shorter than timeout "
                f"({self.timeout}): the watchdog reports a stall before the process group "
                f"gives up without a report; lower stall_timeout, raise timeout, or pass "
                f"stall_timeout=None to turn the watchdog off"
            )
        return self


LoaderMode = Literal["distributed", "rank_cached"]


class LoaderConfig(ConfigModel):
    """How the LoaderFactory builds loaders. ``batch_size`` is per rank: the effective batch size
    of one optimizer step is ``batch_size x world_size`` (x gradient accumulation steps).

    Attributes:
        batch_size: samples per batch on each rank.
        shuffle: shuffle training data (reproducibly, from ``seed`` and the epoch). Evaluation
            loaders never shuffle.
        num_workers: worker processes per rank, clamped to the CPUs available per local rank.
            Rank-cached loaders serve from memory in the main process and use none.
        pin_memory: None: only when the device is CUDA (forced off otherwise).
        persistent_workers: None: when there are workers (forced off without workers).
        prefetch_factor: batches prefetched per worker (only with workers).
        drop_last: training only: drop the tail so every rank gets the same number of full
            batches (see docs/data.md for the exact rule); otherwise the tail is padded.
        seed: the one seed behind shuffles, shards and worker seeds, on every rank.
        mode: 'distributed' (a DistributedSampler over the dataset) or 'rank_cached' (each rank
            reads its shard once into memory).
    """

    batch_size: int = Field(default=32, ge=1, strict=True)
    shuffle: bool = True
    num_workers: int = Field(default=0, ge=0, strict=True)
    pin_memory: bool | None = None
    persistent_workers: bool | None = None
    prefetch_factor: int | None = Field(default=None, ge=1, strict=True)
    drop_last: bool = False
    seed: int = Field(default=0, ge=0, lt=2**63, strict=True)
    mode: LoaderMode = "distributed"


__all__ = ["Backend", "DistributedConfig", "LoaderConfig", "LoaderMode"]
