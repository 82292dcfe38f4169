"""nn_handler's training step on one GPU against a hand-written loop on the same GPU, and the
reproducible mode against the normal step with the same micro-batches.

    python benchmarks/gpu_step.py [--quick] [--out results.json]

Needs a CUDA device (it says so and exits 0 without one); not part of `make bench`, which runs
on the CPU machines: run it by hand where a GPU is lent, and commit its JSON as
benchmarks/results/gpu_step.json. One process on cuda:0. Workloads as in reproducible.py:
ResNet-8 on 3x32x32 images (batch 256) and two TransformerEncoderLayers (batch 64), in fp32
and bf16, SGD with momentum (torch's fused kernel, so nn_handler's non-finite guard skips on
the device: no host read in a step).

- ``against_raw``: NNHandler.train (the default configuration: the non-finite guard, the
  throughput monitor) against the hand-written loop (zero_grad, autocast, forward, backward,
  step) over the same batches, staged on the GPU before timing (StagedBatches: the step is
  measured, not the host's collation, the same for both and slower than these steps); also
  nn_handler with torch's plain (foreach) SGD, whose guard reads the host once a step,
  against the same loop with that SGD; and in bf16 both with ``torch.compile``
  (``compile: true``; not with --quick). Nondeterministic kernels allowed, as in a user's run
  (CUBLAS_WORKSPACE_CONFIG is set for the whole script: the reproducible section needs it).
- ``reproducible``: the mode's step against the normal step with the same work
  (deterministic kernels for both, as the mode needs): one micro-batch a step against one
  batch, four micro-batches against four accumulated micro-batches of the same size, and the
  float sum against one batch.

Each variant trains whole epochs in alternation after a warm-up epoch (the order flips each
repetition); a ratio is the median of the per-epoch ratios. Peak memory:
torch.cuda.max_memory_allocated over a variant's epochs.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import models
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nn_handler import DistributedConfig, DistributedContext, NNHandler

CASES: dict[str, Any] = {
    "resnet8": (models.resnet8, lambda n: models.dataset((3, 32, 32), n), 256),
    "transformer": (models.transformer, lambda n: models.token_dataset(64, n), 64),
}
#: The reproducible section's variants: (micro-batches a step, the mode's reduction), or
#: (micro-batches, None): the normal mode accumulating that many micro-batches a step.
VARIANTS: dict[str, tuple[int, str | None]] = {
    "normal": (1, None),
    "reproducible": (1, "exact"),
    "normal_4_micro": (4, None),
    "reproducible_4_micro": (4, "exact"),
    "reproducible_float": (1, "float"),
}
#: Which normal variant each mode variant is compared with (the same micro-batches).
BASELINES = {
    "reproducible": "normal",
    "reproducible_4_micro": "normal_4_micro",
    "reproducible_float": "normal",
}
Epoch = Callable[[int], None]
DEVICE = "cuda:0"


def _sgd(fused: bool) -> Callable[[Any], torch.optim.Optimizer]:
    def build(params: Any) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=fused or None)

    return build


def _nn_handler(
    case: str,
    data: TensorDataset | DataLoader[Any],
    precision: str,
    device: str,
    fused: bool = True,
    micro: int = 1,
    reduction: str | None = None,
    compiled: bool = False,
) -> Epoch:
    build, _, batch = CASES[case]
    torch.manual_seed(0)
    mode = None
    if reduction is not None:
        mode = {"global_batch_size": batch, "micro_batch_size": batch // micro,
                "reduction": reduction}  # fmt: skip
    accumulate = micro if reduction is None else 1
    handler = NNHandler(
        build(),
        _sgd(fused),
        nn.functional.cross_entropy,
        config={
            "loader": {"batch_size": batch // accumulate},
            "precision": precision,
            "trainer": {
                "progress_bar": False,
                "reproducible": mode,
                "accumulate_grad_batches": accumulate,
                "compile": compiled,
            },
            "logging": {"level": "WARNING"},
        },
        context=DistributedContext(DistributedConfig(device=device, enabled=False)),
    )

    def epoch(index: int) -> None:
        handler.train(data, epochs=index + 1)

    return epoch


class StagedBatches(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Whole batches already on the device (a DataLoader over it with ``batch_size=None``
    hands them out as they are): the step is timed, not the host's collation and copies,
    which on a fast GPU take longer than these models' steps and swing by tens of percent."""

    def __init__(self, data: TensorDataset, batch: int, device: str) -> None:
        inputs, labels = data.tensors
        steps = len(labels) // batch
        self.inputs = inputs[: steps * batch].reshape(steps, batch, *inputs.shape[1:]).to(device)
        self.labels = labels[: steps * batch].reshape(steps, batch).to(device)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inputs[index], self.labels[index]


def _raw(
    case: str, loader: DataLoader[Any], precision: str, device: str, fused: bool = True,
    compiled: bool = False,
) -> Epoch:  # fmt: skip
    """The hand-written loop a user writes: the same model, SGD and batches."""
    build, _, _ = CASES[case]
    torch.manual_seed(0)
    module: nn.Module = build().to(device)
    model: Any = torch.compile(module) if compiled else module
    optimizer = _sgd(fused)(module.parameters())
    dtype = {"bf16": torch.bfloat16}.get(precision)

    def epoch(_index: int) -> None:
        model.train()
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad(set_to_none=True)
            autocast = torch.autocast(device.split(":")[0], dtype) if dtype else _NOTHING
            with autocast:
                loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()

    return epoch


_NOTHING = contextlib.nullcontext()


def _synchronize(device: str, reset_peak: bool = False) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        if reset_peak:
            torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> int:
    return torch.cuda.max_memory_allocated() if device.startswith("cuda") else 0


def _alternate(
    epochs: dict[str, Epoch], steps: int, repeats: int, device: str
) -> tuple[dict[str, list[float]], dict[str, int]]:
    """Every variant's epoch times (the warm-up epoch left out) and peak memory."""
    times: dict[str, list[float]] = {name: [] for name in epochs}
    peaks: dict[str, int] = dict.fromkeys(epochs, 0)
    names = list(epochs)
    for index in range(repeats + 1):
        for name in names if index % 2 == 0 else names[::-1]:
            _synchronize(device, reset_peak=True)
            start = time.perf_counter()
            epochs[name](index)
            _synchronize(device)
            peaks[name] = max(peaks[name], _peak(device))
            if index:  # epoch 0 warms the allocator, cuDNN's choices, the caches, compile
                times[name].append(time.perf_counter() - start)
    return times, peaks


def _row(
    times: dict[str, list[float]], peaks: dict[str, int], steps: int, batch: int,
    baselines: dict[str, str],
) -> dict[str, Any]:  # fmt: skip
    row: dict[str, Any] = {"batch": batch, "steps_per_epoch": steps}
    for name in times:
        row[name] = {
            "ms_per_step": 1000 * statistics.median(times[name]) / steps,
            "peak_memory_mib": peaks[name] / 2**20,
        }
        if name in baselines:
            row[name]["against"] = baselines[name]
            row[name].update(common.ratio_summary(times[name], times[baselines[name]]))
    return row


def _against_raw(
    case: str, precision: str, steps: int, repeats: int, device: str, compiled: bool
) -> dict[str, Any]:
    """nn_handler against the hand-written loop (nondeterministic kernels allowed)."""
    _, make, batch = CASES[case]
    loader = DataLoader(StagedBatches(make(steps * batch), batch, device), batch_size=None)
    epochs = {
        "raw": _raw(case, loader, precision, device),
        "nn_handler": _nn_handler(case, loader, precision, device),
        "raw_plain_sgd": _raw(case, loader, precision, device, fused=False),
        "nn_handler_plain_sgd": _nn_handler(case, loader, precision, device, fused=False),
    }
    baselines = {"nn_handler": "raw", "nn_handler_plain_sgd": "raw_plain_sgd"}
    if compiled:
        epochs["raw_compiled"] = _raw(case, loader, precision, device, compiled=True)
        epochs["nn_handler_compiled"] = _nn_handler(case, loader, precision, device, compiled=True)
        baselines["nn_handler_compiled"] = "raw_compiled"
    times, peaks = _alternate(epochs, steps, repeats, device)
    return _row(times, peaks, steps, batch, baselines)


def _timed(
    case: str, precision: str, steps: int, repeats: int, device: str = DEVICE
) -> dict[str, Any]:
    """The reproducible mode against the normal step with the same micro-batches
    (deterministic kernels: the caller sets them); ``device`` 'cpu' in the suite's smoke
    test (no memory)."""
    _, make, batch = CASES[case]
    data = make(steps * batch)
    epochs = {
        name: _nn_handler(case, data, precision, device, micro=micro, reduction=reduction)
        for name, (micro, reduction) in VARIANTS.items()
    }
    times, peaks = _alternate(epochs, steps, repeats, device)
    return _row(times, peaks, steps, batch, BASELINES)


def main() -> None:
    args = common.parse_args(__doc__ or "")
    if not torch.cuda.is_available():
        print("gpu_step.py: no CUDA device on this machine; nothing measured.")
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # this script's own process
    steps, repeats = (4, 1) if args.quick else (40, 5)
    compiled = not args.quick
    against_raw: dict[str, Any] = {}
    for case in CASES:
        for precision in ("32", "bf16"):
            key = f"{case}-{precision}"
            with_compile = compiled and precision == "bf16"
            against_raw[key] = _against_raw(case, precision, steps, repeats, DEVICE, with_compile)
            print(json.dumps({key: against_raw[key]}), flush=True)  # a long run's progress
    torch.use_deterministic_algorithms(True)
    reproducible: dict[str, Any] = {}
    for case in CASES:
        for precision in ("32", "bf16"):
            key = f"{case}-{precision}"
            reproducible[key] = _timed(case, precision, steps, repeats)
            print(json.dumps({key: reproducible[key]}), flush=True)
    targets = {
        f"{key} {name}: within 1.02x of the hand-written loop": row[name]["ratio_median"] <= 1.02
        for key, row in against_raw.items()
        for name in ("nn_handler", "nn_handler_compiled")
        if name in row
    }
    targets.update(
        {
            f"{key}: the mode's step within 1.10x of the normal step's": (
                row["reproducible"]["ratio_median"] <= 1.10
            )
            for key, row in reproducible.items()
        }
    )
    common.report(
        {
            "benchmark": "gpu_step",
            "device": torch.cuda.get_device_name(0),
            "against_raw": against_raw,
            "reproducible": reproducible,
            "targets_met": targets,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
