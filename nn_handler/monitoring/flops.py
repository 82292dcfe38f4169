"""FLOPs of a step and the peak a device could do: what MFU is measured against.

``count_flops`` runs code under ``torch.utils.flop_counter.FlopCounterMode`` (matrix products
and convolutions, forward and backward). ``peak_tflops`` looks the device up in
``PEAK_TFLOPS``: dense (no sparsity) tensor-core numbers from the vendors' data sheets.
"""

from __future__ import annotations

from typing import Any

import torch

#: Dense peak TFLOP/s by device-name fragment (checked in this order, the first match wins)
#: and precision: 'bf16' (also fp16), 'tf32' (fp32 matmuls with TF32 allowed), 'fp32'.
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},  # SXM ("NVIDIA H100 80GB HBM3")
    "H200": {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "GH200": {"bf16": 989.0, "tf32": 494.5, "fp32": 67.0},
    "B200": {"bf16": 2250.0, "tf32": 1100.0, "fp32": 80.0},
    "A100": {"bf16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "A10": {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "V100": {"bf16": 125.0, "tf32": 15.7, "fp32": 15.7},  # no bf16: its fp16 tensor cores
}


def precision_kind(precision: str) -> str:
    """The ``PEAK_TFLOPS`` column of a Trainer precision ('32', 'bf16', 'fp16')."""
    if precision in ("bf16", "fp16"):
        return "bf16"
    return "tf32" if tf32_matmuls() else "fp32"


def tf32_matmuls() -> bool:
    """Whether fp32 CUDA matmuls may use TF32, by the new API (which reflects the legacy
    ``allow_tf32`` and ``set_float32_matmul_precision`` too; reading the legacy flag after
    the new API was used raises)."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)  # torch >= 2.9
    if precision is None:  # pragma: no cover - older torch
        return bool(matmul.allow_tf32)
    return bool(precision == "tf32")


def peak_tflops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak for ``precision`` from ``PEAK_TFLOPS``; None for a CPU or an
    unknown GPU (then give ``peak_tflops`` yourself to get an MFU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment in name:
            return peaks[precision_kind(precision)]
    return None


class FlopCount:
    """A context that counts the FLOPs run inside it (FlopCounterMode, no printing);
    ``total`` after it exits."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self._mode: Any = FlopCounterMode(display=False)
        self.total = 0

    def __enter__(self) -> FlopCount:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        self.total = int(self._mode.get_total_flops())


__all__ = ["PEAK_TFLOPS", "FlopCount", "peak_tflops", "precision_kind"]
