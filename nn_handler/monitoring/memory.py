"""Peak memory of this process per epoch: CUDA's most allocated bytes, or the peak resident
set size on CPU (Linux's VmHWM, reset per epoch through /proc/self/clear_refs where the
kernel lets us; elsewhere the peak since the process started)."""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak; False when only the peak since the process started can be read."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_memory_bytes(device: torch.device) -> int:
    """The peak since the last ``reset_peak_memory`` (CUDA: allocated by tensors; CPU: the
    process's resident set)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


__all__ = ["peak_memory_bytes", "reset_peak_memory"]
