"""Object and variable-size tensor gathers: nn_handler's Communicator vs torch.distributed.

    python benchmarks/object_collectives.py [--quick] [--out results.json]

World size 2 on gloo over 127.0.0.1, one thread per rank.
1. ``TorchCommunicator.all_gather_object`` vs ``dist.all_gather_object`` on a list of 1k floats,
   a dict of 100 small tensors, a 10 MB NumPy array and 100 MB of bytes: seconds per call
   (A B interleaved per repetition, warm-up excluded) and, for the 100 MB payload, the peak
   resident memory a call adds on a rank (Linux VmHWM after resetting it), as a multiple of
   the payload.
2. ``TorchCommunicator.all_gather`` of 1-D float tensors whose length differs per rank (pad,
   gather, trim) vs sending the same tensors through ``dist.all_gather_object``.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import numpy as np
import torch
import torch.distributed as dist

from nn_handler import TorchCommunicator
from nn_handler.distributed.communicator.torch_backend import _all_gather_single


def payloads(rank: int, quick: bool) -> dict[str, tuple[Any, int]]:
    """name -> (this rank's object, its size in bytes); sizes shrink 10x in quick mode."""
    scale = 10 if quick else 1
    big = 100 * 2**20 // scale
    generator = torch.Generator().manual_seed(rank)
    return {
        "list of 1k floats": ([float(i + rank) for i in range(1000)], 8 * 1000),
        "dict of 100 small tensors": (
            {f"t{i}": torch.rand(16, generator=generator) for i in range(100)},
            100 * 16 * 4,
        ),
        "10 MB numpy array": (
            np.full(10 * 2**20 // 8 // scale, rank, np.float64),
            10 * 2**20 // scale,
        ),
        "100 MB bytes": (bytes([rank]) * big, big),
    }


def _torch_gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _seconds(fn: Callable[[], object], calls: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _interleaved(
    raw: Callable[[], object], ours: Callable[[], object], repeats: int, calls: int
) -> dict[str, Any]:
    """Seconds per call of each, A B B A A B ... (the order flips every repetition, so drift
    within a repetition favours neither), after one warm-up call of each."""
    _seconds(raw, 1)
    _seconds(ours, 1)
    raw_s, ours_s = [], []
    for repeat in range(repeats):
        if repeat % 2:
            ours_s.append(_seconds(ours, calls))
            raw_s.append(_seconds(raw, calls))
        else:
            raw_s.append(_seconds(raw, calls))
            ours_s.append(_seconds(ours, calls))
    ratios = [o / r for o, r in zip(ours_s, raw_s, strict=True)]
    return {
        "torch_ms": statistics.median(raw_s) * 1e3,
        "nn_handler_ms": statistics.median(ours_s) * 1e3,
        "ratio_median": statistics.median(ratios),
        "ratio_spread": [min(ratios), max(ratios)],
        "speedup": 1 / statistics.median(ratios),
    }


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


def peak_added_bytes(fn: Callable[[], object]) -> int:
    """Peak resident memory that ``fn()`` adds while its result is alive (Linux only)."""
    gc.collect()
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current VmRSS
    before = _status_kb("VmRSS")
    result = fn()
    peak = _status_kb("VmHWM")
    del result
    gc.collect()
    return (peak - before) * 1024


def _worker(rank: int, port: int, quick: bool, out: Any) -> None:
    common.join_gloo_group(rank, port, timeout_s=300)
    comm = TorchCommunicator()
    repeats = 3 if quick else 9
    objects: dict[str, Any] = {}
    for name, (obj, size) in payloads(rank, quick).items():
        # Latency-bound payloads (two gloo round trips, about a millisecond, swinging by 50%):
        # many more calls and repetitions, so the medians separate overhead from noise. The
        # dict's gathers take 10-50 ms each, so fewer calls time it as well.
        small = size <= 2**20
        calls = (5 if quick else 20 if name.startswith("dict") else 100) if small else 1
        reps = (3 if quick else 41) if small else repeats
        row = _interleaved(
            lambda o=obj: _torch_gather(o), lambda o=obj: comm.all_gather_object(o), reps, calls
        )
        row["payload_bytes"] = size
        row["torch_mb_per_s"] = size / row["torch_ms"] * 1e3 / 2**20
        row["nn_handler_mb_per_s"] = size / row["nn_handler_ms"] * 1e3 / 2**20
        objects[name] = row
    size = 100 * 2**20  # at full size even in quick mode: smaller blocks reuse freed heap pages
    large = bytes([rank]) * size
    memory = {
        "payload_bytes": size,
        "torch_peak_x_payload": peak_added_bytes(lambda: _torch_gather(large)) / size,
        "nn_handler_peak_x_payload": peak_added_bytes(lambda: comm.all_gather_object(large)) / size,
    }
    tensors = {}
    for numel in (1000, 4 * 2**20 // (10 if quick else 1)):
        mine = torch.rand(numel - rank * 7)  # the lengths differ per rank
        equal = torch.rand(numel)

        def bare(t: torch.Tensor = equal) -> None:  # the floor: equal lengths, no metadata
            _all_gather_single(torch.empty(2 * t.numel()), t)

        bare_ms = statistics.median(_seconds(bare, 1) for _ in range(repeats)) * 1e3
        row = _interleaved(
            lambda m=mine: _torch_gather(m),
            lambda m=mine: comm.all_gather(m),
            repeats,
            1 if numel > 2**20 // 10 else (5 if quick else 50),
        )
        row["bare_all_gather_into_tensor_ms"] = bare_ms
        tensors[f"{numel} floats"] = row
    per_rank = [None, None] if rank == 0 else None
    dist.gather_object(memory, per_rank, dst=0)
    if rank == 0:
        out.put({"objects": objects, "peak_memory_per_rank": per_rank, "variable_tensors": tensors})
    dist.destroy_process_group()


TARGETS = {  # payload -> (field, comparison, bound, what the target says)
    "list of 1k floats": ("ratio_median", "<=", 1.05, "at most 1.05x the time of"),
    "dict of 100 small tensors": ("speedup", ">=", 2.0, "at least 2x faster than"),
    "10 MB numpy array": ("speedup", ">=", 1.3, "at least 1.3x the throughput of"),
    "100 MB bytes": ("speedup", ">=", 1.3, "at least 1.3x the throughput of"),
}


def main() -> None:
    args = common.parse_args(__doc__ or "")
    result = common.run_two_ranks(_worker, args.quick, timeout=900)
    met = {
        f"{name}: {words} all_gather_object": common.meets(result["objects"][name][key], op, bound)
        for name, (key, op, bound, words) in TARGETS.items()
    }
    met["100 MB: peak memory per rank at most 4x the payload"] = all(
        row["nn_handler_peak_x_payload"] <= 4 for row in result["peak_memory_per_rank"]
    )
    met["4M floats, lengths differing per rank: all_gather at least 1.8x faster than objects"] = (
        list(result["variable_tensors"].values())[-1]["speedup"] >= 1.8
    )
    common.report(
        {"benchmark": "object_collectives", "world_size": 2, **result, "targets_met": met},
        args.out,
    )


if __name__ == "__main__":
    main()
