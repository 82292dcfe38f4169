"""Per-call cost of the Communicator against raw torch.distributed.

    python benchmarks/communicator_overhead.py [--quick] [--out results.json]

1. In one process: NullCommunicator calls (what a single-process training step pays).
2. In a 2-process gloo group on 127.0.0.1, on 4 and 1M floats: ``all_reduce_`` (in place) vs a
   bare in-place ``dist.all_reduce``, and ``all_reduce`` (a new tensor; the input is kept) vs
   ``dist.all_reduce`` on a clone, interleaved per repetition (warm-up excluded), reported as
   the median and spread of per-repetition ratios, because absolute times on shared machines
   drift.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import common
import torch
import torch.distributed as dist

from nn_handler import NullCommunicator, TorchCommunicator


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def single_process(repeats: int, calls: int) -> dict[str, float]:
    comm = NullCommunicator()
    t = torch.ones(4)
    cases: dict[str, Callable[[], object]] = {
        "tensor.clone() (reference)": t.clone,
        "all_reduce(tensor)": lambda: comm.all_reduce(t),
        "all_reduce(float)": lambda: comm.all_reduce(0.5),
        "reduce_dict(2 floats)": lambda: comm.reduce_dict({"loss": 0.5, "acc": 0.9}),
        "barrier()": comm.barrier,
    }
    return {
        name: statistics.median(_per_call_us(fn, calls) for _ in range(repeats))
        for name, fn in cases.items()
    }


def _interleaved(
    fns: dict[str, Callable[[], object]], repeats: int, calls: int
) -> dict[str, list[float]]:
    """Microseconds per call of each function, A B C A B C ... (after one warm-up round)."""
    for fn in fns.values():
        _per_call_us(fn, calls)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            dist.barrier()
            times[name].append(_per_call_us(fn, calls))
    return times


def _ratio_row(times: dict[str, list[float]], ours: str, raw: str) -> dict[str, float]:
    ratios = [o / r for o, r in zip(times[ours], times[raw], strict=True)]
    return {
        "raw_us_median": statistics.median(times[raw]),
        "ours_us_median": statistics.median(times[ours]),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
    }


def _group_worker(rank: int, port: int, repeats: int, calls: int, numel: int, out: Any) -> None:
    common.join_gloo_group(rank, port, timeout_s=60)
    comm = TorchCommunicator()
    t = torch.ones(numel)
    times = _interleaved(
        {
            "bare in place": lambda: dist.all_reduce(t),
            "ours in place": lambda: comm.all_reduce_(t),
            "bare on a copy": lambda: dist.all_reduce(t.clone()),
            "ours (returns a new tensor)": lambda: comm.all_reduce(t),
        },
        repeats,
        calls,
    )
    if rank == 0:
        out.put(
            {
                "numel": numel,
                "all_reduce_ (in place) vs dist.all_reduce": _ratio_row(
                    times, "ours in place", "bare in place"
                ),
                "all_reduce (new tensor) vs dist.all_reduce on a clone": _ratio_row(
                    times, "ours (returns a new tensor)", "bare on a copy"
                ),
            }
        )
    dist.destroy_process_group()


def two_process_gloo(repeats: int, calls: int, numel: int) -> dict[str, Any]:
    result: dict[str, Any] = common.run_two_ranks(_group_worker, repeats, calls, numel)
    return result


def main() -> None:
    args = common.parse_args(__doc__ or "")
    repeats, calls = (3, 200) if args.quick else (15, 2000)
    gloo = [
        two_process_gloo(repeats, calls // 4, 4),
        two_process_gloo(repeats, max(calls // 100, 2), 2**20),
    ]
    in_place = gloo[1]["all_reduce_ (in place) vs dist.all_reduce"]["ratio_median"]
    results = {
        "benchmark": "communicator_overhead",
        "single_process_us_per_call": single_process(repeats, calls),
        "gloo_world2_all_reduce": gloo,
        "targets_met": {
            "all_reduce_ of 1M floats within 1.05x of dist.all_reduce": in_place <= 1.05
        },
    }
    common.report(results, args.out)


if __name__ == "__main__":
    main()
