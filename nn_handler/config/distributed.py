"""Configuration of the distributed run: how this process joins it."""

from __future__ import annotations

import re
from datetime import timedelta

from pydantic import StrictBool, ValidationInfo, field_validator, model_validator

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

    enabled: StrictBool | None = None
    backend: Backend = "auto"
    device: str = "auto"
    timeout: timedelta = timedelta(minutes=30)
    stall_timeout: timedelta | None = timedelta(minutes=5)
    init_method: str | None = None
    debug_collectives: StrictBool = False

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


__all__ = ["Backend", "DistributedConfig"]
