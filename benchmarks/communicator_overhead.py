"""Per-call cost of the Communicator against raw torch.distributed.

    python benchmarks/communicator_overhead.py [--quick] [--out results.json]

1. In one process: NullCommunicator calls (what a single-process training step pays).
2. In a 2-process gloo group on 127.0.0.1: TorchCommunicator.all_reduce vs dist.all_reduce on
   the same tensor, interleaved A B A B per repetition (warm-up excluded), reported as the median
   and spread of per-repetition ratios, because absolute times on shared machines drift.
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


def _group_worker(rank: int, port: int, repeats: int, calls: int, numel: int, out: Any) -> None:
    common.join_gloo_group(rank, port, timeout_s=60)
    comm = TorchCommunicator()
    t = torch.ones(numel)

    def raw() -> None:
        buffer = t.clone()  # ours returns a new tensor; give raw the same copy
        dist.all_reduce(buffer)

    def ours() -> None:
        comm.all_reduce(t)

    for fn in (raw, ours):  # warm-up
        _per_call_us(fn, calls)
    ratios, raw_us, ours_us = [], [], []
    for _ in range(repeats):
        a = _per_call_us(raw, calls)
        b = _per_call_us(ours, calls)
        raw_us.append(a)
        ours_us.append(b)
        ratios.append(b / a)
    if rank == 0:
        out.put(
            {
                "numel": numel,
                "raw_us_median": statistics.median(raw_us),
                "ours_us_median": statistics.median(ours_us),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
        )
    dist.destroy_process_group()


def two_process_gloo(repeats: int, calls: int, numel: int) -> dict[str, float]:
    result: dict[str, float] = common.run_two_ranks(_group_worker, repeats, calls, numel)
    return result


def main() -> None:
    args = common.parse_args(__doc__ or "")
    repeats, calls = (3, 200) if args.quick else (15, 2000)
    results = {
        "single_process_us_per_call": single_process(repeats, calls),
        "gloo_world2_all_reduce": [two_process_gloo(repeats, calls // 4, n) for n in (4, 65536)],
    }
    common.report(results, args.out)


if __name__ == "__main__":
    main()
