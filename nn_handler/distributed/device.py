"""Device resolution: turn 'auto', 'cpu', 'cuda', 'gpu', 'cuda:N', 'mps' or a torch.device into
the torch.device this process should use.

``resolve_device_spec`` is pure (the hardware facts are arguments) so every branch is tested on
any machine; ``resolve_device`` asks torch for those facts.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from nn_handler.errors import ConfigError

DeviceSpec = str | torch.device


@dataclass(frozen=True)
class Hardware:
    """What accelerators this process can see."""

    cuda_device_count: int = 0
    mps_available: bool = False

    @classmethod
    def detect(cls) -> Hardware:
        """Ask torch what this process can see (CUDA honours CUDA_VISIBLE_DEVICES)."""
        cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
        mps_backend = getattr(torch.backends, "mps", None)
        mps = bool(mps_backend is not None and mps_backend.is_available())
        return cls(cuda_device_count=cuda, mps_available=mps)


_CPU = torch.device("cpu")


def _fallback(spec: str, why: str) -> torch.device:
    warnings.warn(
        f"device {spec!r} requested but {why}; falling back to CPU.", RuntimeWarning, stacklevel=4
    )
    return _CPU


def _cuda_for_local_rank(local_rank: int | None, count: int) -> torch.device:
    index = local_rank or 0
    if index < count:
        return torch.device("cuda", index)
    if count == 1:
        # Launchers that bind one GPU per process (SLURM --gpus-per-task, CUDA_VISIBLE_DEVICES
        # set per rank) leave each process seeing exactly one device whatever its local rank.
        return torch.device("cuda", 0)
    raise ConfigError(
        f"local rank {index} needs GPU {index} but only {count} CUDA device(s) are visible. "
        f"Start at most {count} processes per node, or make CUDA_VISIBLE_DEVICES expose one "
        f"GPU per process."
    )


def resolve_device_spec(
    device: DeviceSpec, local_rank: int | None = None, hardware: Hardware | None = None
) -> torch.device:
    """Resolve ``device`` against ``hardware`` (default: no accelerator).

    - 'auto': cuda:local_rank when CUDA is visible, else 'mps' when available, else CPU.
    - 'cuda' / 'gpu' (or torch.device('cuda') without index): cuda:local_rank (cuda:0 alone).
    - 'cuda:N': that device; N >= the visible device count is a ``ConfigError``.
    - CUDA or MPS asked for but absent: CPU, with a ``RuntimeWarning``.
    - anything else unknown: ``ConfigError``.
    """
    hw = hardware or Hardware()
    if isinstance(device, torch.device):
        spec = str(device)
    elif isinstance(device, str):
        spec = device.strip().lower()
    else:
        raise ConfigError(
            f"device must be a str or torch.device, got {type(device).__name__} {device!r}."
        )
    if spec == "auto":
        if hw.cuda_device_count:
            return _cuda_for_local_rank(local_rank, hw.cuda_device_count)
        return torch.device("mps") if hw.mps_available else _CPU
    if spec == "cpu":
        return _CPU
    if spec in ("cuda", "gpu"):
        if not hw.cuda_device_count:
            return _fallback(spec, "CUDA is not available")
        return _cuda_for_local_rank(local_rank, hw.cuda_device_count)
    if spec.startswith(("cuda:", "gpu:")):
        index_text = spec.split(":", 1)[1]
        if not (index_text.isascii() and index_text.isdecimal()):
            raise ConfigError(f"device {device!r}: the CUDA index must be a non-negative integer.")
        if not hw.cuda_device_count:
            return _fallback(spec, "CUDA is not available")
        index = int(index_text)
        if index >= hw.cuda_device_count:
            raise ConfigError(
                f"device {device!r} does not exist: {hw.cuda_device_count} CUDA device(s) are "
                f"visible (cuda:0 to cuda:{hw.cuda_device_count - 1}). Check "
                f"CUDA_VISIBLE_DEVICES or pass 'cuda' to pick the local rank's GPU."
            )
        return torch.device("cuda", index)
    if spec == "mps" or spec.startswith("mps:"):
        return torch.device("mps") if hw.mps_available else _fallback(spec, "MPS is not available")
    raise ConfigError(
        f"unknown device {device!r}; use 'auto', 'cpu', 'cuda', 'gpu', 'cuda:N' or 'mps'."
    )


def resolve_device(device: DeviceSpec = "auto", local_rank: int | None = None) -> torch.device:
    """Resolve ``device`` for the hardware this process sees (see resolve_device_spec)."""
    return resolve_device_spec(device, local_rank, Hardware.detect())


__all__ = ["DeviceSpec", "Hardware", "resolve_device", "resolve_device_spec"]
