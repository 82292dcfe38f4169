"""The reproducible mode's step on one GPU, against the normal mode's, and its peak memory.

    python benchmarks/gpu_step.py [--quick] [--out results.json]

Needs a CUDA device (it says so and exits 0 without one); not part of `make bench`, which
runs on the CPU machines: run it by hand where a GPU is lent, and commit its JSON as
benchmarks/results/gpu_step.json. One process on cuda:0 (a group of one: no reduction
crosses a wire, so this is the mode's own cost: quantising every gradient into int64, the
kept scales, the per-micro-batch forward and backward), deterministic kernels on for every
variant (the mode needs them; the normal mode then pays the same). Workloads as in
reproducible.py: ResNet-8 on 3x32x32 images (batch 256) and two TransformerEncoderLayers
(batch 64), in fp32 and bf16. Variants: the normal mode (one batch a step), the mode with one
micro-batch a step (the same samples per step) and with four micro-batches a step (a quarter
each), and with one micro-batch and a floating-point sum (``reduction: float``). Each trains
epochs in alternation after one warm-up epoch; the ratio is the median of the per-epoch
ratios. Peak memory: torch.cuda.max_memory_allocated over a variant's epochs.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import common
import models
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nn_handler import DistributedConfig, DistributedContext, NNHandler

CASES: dict[str, Any] = {
    "resnet8": (models.resnet8, lambda n: models.dataset((3, 32, 32), n), 256),
    "transformer": (models.transformer, lambda n: models.token_dataset(64, n), 64),
}
#: Variant: (micro-batches a step, the mode's reduction); None: the normal mode.
VARIANTS: dict[str, tuple[int, str] | None] = {
    "normal": None,
    "reproducible": (1, "exact"),
    "reproducible_4_micro": (4, "exact"),
    "reproducible_float": (1, "float"),
}


def _handler(
    build: Any, batch: int, variant: tuple[int, str] | None, precision: str, device: str
) -> NNHandler:
    torch.manual_seed(0)
    mode = None
    if variant is not None:
        micro, reduction = variant
        mode = {"global_batch_size": batch, "micro_batch_size": batch // micro,
                "reduction": reduction}  # fmt: skip
    return NNHandler(
        build(),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        nn.functional.cross_entropy,
        config={
            "loader": {"batch_size": batch},
            "precision": precision,
            "trainer": {"progress_bar": False, "reproducible": mode},
            "logging": {"level": "WARNING"},
        },
        context=DistributedContext(DistributedConfig(device=device, enabled=False)),
    )


def _synchronize(device: str, reset_peak: bool = False) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0


def _timed(
    case: str, precision: str, steps: int, repeats: int, device: str = "cuda:0"
) -> dict[str, Any]:
    """One workload's variants; ``device`` 'cpu' in the suite's smoke test (no memory)."""
    build, make, batch = CASES[case]
    data = make(steps * batch)
    handlers = {
        name: _handler(build, batch, variant, precision, device)
        for name, variant in VARIANTS.items()
    }
    times: dict[str, list[float]] = {name: [] for name in handlers}
    peaks: dict[str, int] = dict.fromkeys(handlers, 0)
    for index in range(repeats + 1):
        for name, handler in handlers.items():
            _synchronize(device, reset_peak=True)
            start = time.perf_counter()
            handler.train(data, epochs=index + 1)
            _synchronize(device)
            peaks[name] = max(peaks[name], _peak(device))
            if index:  # epoch 0 warms the allocator, cuDNN's choices and the caches
                times[name].append(time.perf_counter() - start)
    for handler in handlers.values():
        handler.close()
    row: dict[str, Any] = {"batch": batch, "steps_per_epoch": steps}
    for name in handlers:
        row[name] = {
            "ms_per_step": 1000 * statistics.median(times[name]) / steps,
            "peak_memory_mib": peaks[name] / 2**20,
        }
        if name != "normal":
            row[name].update(common.ratio_summary(times[name], times["normal"]))
    return row


def main() -> None:
    args = common.parse_args(__doc__ or "")
    if not torch.cuda.is_available():
        print("gpu_step.py: no CUDA device on this machine; nothing measured.")
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # this script's own process
    torch.use_deterministic_algorithms(True)
    steps, repeats = (4, 1) if args.quick else (40, 7)
    results = {
        f"{case}-{precision}": _timed(case, precision, steps, repeats)
        for case in CASES
        for precision in ("32", "bf16")
    }
    common.report(
        {
            "benchmark": "gpu_step",
            "device": torch.cuda.get_device_name(0),
            "results": results,
            "targets_met": {
                f"{key}: the mode's step within 1.10x of the normal mode's": (
                    row["reproducible"]["ratio_median"] <= 1.10
                )
                for key, row in results.items()
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
