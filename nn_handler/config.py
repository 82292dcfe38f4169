"""Validated configuration (pydantic v2, frozen, extra fields forbidden).

Config objects are validated once, at the edge; code below receives these objects, never dicts.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Literal

from pydantic import BaseModel, ConfigDict, field_validator

_DEVICE_PATTERN = re.compile(r"^(auto|cpu|cuda|gpu|mps|(cuda|gpu):[0-9]+)$")

Backend = Literal["auto", "gloo", "nccl", "mpi"]


class DistributedConfig(BaseModel):
    """How this process joins the run.

    Attributes:
        enabled: None: distributed when the launcher describes more than one process;
            True: always create a process group (even of one process); False: never.
        backend: 'auto' picks nccl when the device is CUDA and gloo otherwise.
        device: 'auto', 'cpu', 'cuda', 'gpu', 'cuda:N' or 'mps'.
        timeout: process group timeout for collectives (seed 002's default: 60 minutes).
        init_method: a torch init_method URL ('tcp://host:port', 'file:///path'); by default
            tcp://MASTER_ADDR:MASTER_PORT from the launcher.
        debug_collectives: check that every rank calls the same collective with compatible
            tensors before each one (also switched on by NN_HANDLER_DEBUG_COLLECTIVES=1).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool | None = None
    backend: Backend = "auto"
    device: str = "auto"
    timeout: timedelta = timedelta(minutes=60)
    init_method: str | None = None
    debug_collectives: bool = False

    @field_validator("device")
    @classmethod
    def _check_device(cls, value: str) -> str:
        normalized = value.strip().lower()
        if not _DEVICE_PATTERN.match(normalized):
            raise ValueError(
                f"unknown device {value!r}; use 'auto', 'cpu', 'cuda', 'gpu', 'cuda:N' or 'mps'"
            )
        return normalized

    @field_validator("timeout")
    @classmethod
    def _check_timeout(cls, value: timedelta) -> timedelta:
        if value.total_seconds() <= 0:
            raise ValueError(f"timeout must be positive, got {value}")
        return value


__all__ = ["Backend", "DistributedConfig"]
