"""Rank-gated printing (seed 004) and GPU memory reports (seed 000)."""

from __future__ import annotations

from typing import Any

import torch

from nn_handler.distributed.functional import get_global_rank, get_local_rank
from nn_handler.errors import ConfigError

NO_CUDA_MESSAGE = "GPU memory: CUDA is not available on this machine; nothing to report."


def global_print(*args: Any, global_rank: int = 0, **kwargs: Any) -> None:
    """print(), only on the process whose global rank is ``global_rank`` (default 0)."""
    if get_global_rank() == global_rank:
        print(*args, **kwargs)


def local_print(*args: Any, local_rank: int = 0, **kwargs: Any) -> None:
    """print(), only on the processes whose local rank is ``local_rank`` (default 0)."""
    if get_local_rank() == local_rank:
        print(*args, **kwargs)


def format_bytes(count: float) -> str:
    """Human-readable size: 1536 -> '1.50 KiB'."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GiB"  # pragma: no cover


def _cuda_index(device_id: int | str | torch.device | None) -> int | None:
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if device_id is None:
        index = torch.cuda.current_device()
    elif isinstance(device_id, int) and not isinstance(device_id, bool):
        index = device_id
    else:
        device = torch.device(device_id)
        if device.type != "cuda":
            raise ConfigError(f"device_id={device_id!r} is not a CUDA device.")
        index = device.index if device.index is not None else torch.cuda.current_device()
    if not 0 <= index < count:
        raise ConfigError(
            f"device_id={device_id!r} does not exist: {count} CUDA device(s) are visible."
        )
    return index


def print_gpu_memory_usage(device_id: int | str | torch.device | None = None) -> None:
    """Print allocated, reserved, peak and total memory of one GPU (default: current device).

    Without CUDA, prints one line saying so instead of raising.
    """
    index = _cuda_index(device_id)
    if index is None:
        print(NO_CUDA_MESSAGE)
        return
    total = torch.cuda.get_device_properties(index).total_memory
    print(
        f"[rank {get_global_rank()}] cuda:{index} memory: "
        f"allocated {format_bytes(torch.cuda.memory_allocated(index))} | "
        f"reserved {format_bytes(torch.cuda.memory_reserved(index))} | "
        f"peak allocated {format_bytes(torch.cuda.max_memory_allocated(index))} | "
        f"total {format_bytes(total)}"
    )


_STAT_KEYS = (
    ("allocated_bytes.all.current", "allocated now"),
    ("allocated_bytes.all.peak", "allocated peak"),
    ("reserved_bytes.all.current", "reserved now"),
    ("reserved_bytes.all.peak", "reserved peak"),
    ("active_bytes.all.current", "active now"),
    ("inactive_split_bytes.all.current", "inactive split"),
)


def print_gpu_memory_stats(device_id: int | str | torch.device | None = None) -> None:
    """Print detailed allocator statistics of one GPU (default: current device), plus the
    driver's free/total memory and the allocator's retry and OOM counts.

    Without CUDA, prints one line saying so instead of raising.
    """
    index = _cuda_index(device_id)
    if index is None:
        print(NO_CUDA_MESSAGE)
        return
    stats = torch.cuda.memory_stats(index)
    free, total = torch.cuda.mem_get_info(index)
    lines = [f"[rank {get_global_rank()}] cuda:{index} memory statistics:"]
    lines += [f"  {label:<16} {format_bytes(stats.get(key, 0))}" for key, label in _STAT_KEYS]
    lines.append(f"  {'driver free':<16} {format_bytes(free)} of {format_bytes(total)}")
    lines.append(f"  {'alloc retries':<16} {stats.get('num_alloc_retries', 0)}")
    lines.append(f"  {'OOMs':<16} {stats.get('num_ooms', 0)}")
    print("\n".join(lines))


__all__ = [
    "NO_CUDA_MESSAGE",
    "format_bytes",
    "global_print",
    "local_print",
    "print_gpu_memory_stats",
    "print_gpu_memory_usage",
]
