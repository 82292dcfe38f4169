"""Save and load throughput of a ~100 MB state dict: nn_handler's atomic, fsynced save and its
weights-only load against plain torch.save / torch.load(weights_only=True), in the same run.

    python benchmarks/checkpoint_io.py [--quick] [--out results.json]

Variants run back to back in each repetition (A B C A B C ...; one warm-up round excluded), into
one folder in the system's temp directory (on a disk, not tmpfs, for the fsyncs to mean
anything). Reported: the median seconds and MB/s of each, and the median and spread of
per-repetition ratios to the plain torch call. Targets: the atomic save
within 2x of torch.save (it also fsyncs the file and the folder, which torch.save does not),
the load within 1.2x of torch.load(weights_only=True).

``--quick``: 10 MB and 2 repetitions (a smoke test, not a measurement).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import torch

from nn_handler.checkpoint import CheckpointManager, atomic_save, load_file
from nn_handler.checkpoint.single_file import FileWriter
from nn_handler.config import CheckpointConfig
from nn_handler.distributed.communicator import NullCommunicator


def state_dict(megabytes: int) -> dict[str, torch.Tensor]:
    """``megabytes`` MiB of float32 in 1 MiB tensors, like a model's state dict."""
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(256, 1024, generator=generator) for i in range(megabytes)
    }


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    args = common.parse_args(__doc__ or "")
    megabytes, repeats = (10, 2) if args.quick else (100, 7)
    state = state_dict(megabytes)
    size_mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    with tempfile.TemporaryDirectory(prefix="nnh-bench-") as folder:
        base = Path(folder)
        manager = CheckpointManager(CheckpointConfig(dir=str(base / "run")), NullCommunicator())
        step = [0]

        def managed() -> None:
            step[0] += 1
            manager.save_periodic(FileWriter(manager.comm), state, 0, step[0])

        saves: dict[str, Callable[[], Any]] = {
            "torch.save": lambda: torch.save(state, base / "plain.pt"),
            "nn_handler atomic_save": lambda: atomic_save(state, base / "atomic.pt"),
            "nn_handler CheckpointManager.save_periodic": managed,
        }
        loads: dict[str, Callable[[], Any]] = {
            "torch.load(weights_only=True)": lambda: torch.load(
                base / "plain.pt", weights_only=True
            ),
            "nn_handler load_file": lambda: load_file(base / "atomic.pt"),
        }
        times: dict[str, list[float]] = {name: [] for name in (*saves, *loads)}
        for round_index in range(repeats + 1):
            for name, fn in (*saves.items(), *loads.items()):
                elapsed = timed(fn)
                if round_index:  # round 0 warms the page cache and the allocator
                    times[name].append(elapsed)
    results = {}
    for group, reference in ((saves, "torch.save"), (loads, "torch.load(weights_only=True)")):
        for name in group:
            ratios = [a / b for a, b in zip(times[name], times[reference], strict=True)]
            seconds = statistics.median(times[name])
            results[name] = {
                "seconds_median": seconds,
                "mb_per_s": size_mb / seconds,
                "ratio_to_torch_median": statistics.median(ratios),
                "ratio_spread": [min(ratios), max(ratios)],
            }
    save_ratio = results["nn_handler atomic_save"]["ratio_to_torch_median"]
    load_ratio = results["nn_handler load_file"]["ratio_to_torch_median"]
    common.report(
        {
            "benchmark": "checkpoint_io",
            "state_dict_mb": size_mb,
            "tensors": len(state),
            "repeats": repeats,
            "results": results,
            "targets_met": {
                "atomic_save within 2x of torch.save": save_ratio <= 2.0,
                "load_file within 1.2x of torch.load": load_ratio <= 1.2,
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
