"""Rank-cached loading against DistributedSampler loaders, world size 2 on gloo.

    python benchmarks/loader_cache.py [--quick] [--out results.json]

Each rank iterates its training loader over a dataset whose __getitem__ does ~50 us of Python
work and returns a (3, 32, 32) float tensor and a label: first epoch (including building the
loader, and so the caching pass) and later epochs, for DistributedSampler with num_workers 0
and 1, and for rank-cached loading. Ratios are taken within one run, on each rank.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import common
import torch
from torch.utils.data import Dataset

from nn_handler import DistributedContext, LoaderConfig, LoaderFactory, launch

VARIANTS = {
    "distributed_w0": {"mode": "distributed", "num_workers": 0},
    "distributed_w1": {"mode": "distributed", "num_workers": 1},
    "rank_cached": {"mode": "rank_cached", "num_workers": 0},
}


class SlowDataset(Dataset[tuple[torch.Tensor, int]]):
    """``n`` samples of shape (3, 32, 32); each __getitem__ busy-waits ``work_us`` in Python."""

    def __init__(self, n: int, work_us: float = 50.0) -> None:
        self.n = n
        self.work_s = work_us / 1e6
        self.base = torch.linspace(0, 1, 3 * 32 * 32).reshape(3, 32, 32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        end = time.perf_counter() + self.work_s
        while time.perf_counter() < end:
            pass
        return self.base * (index % 7), index % 10


def _rank_worker(n: int, later_epochs: int, batch_size: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    ctx = DistributedContext().setup()  # adopts the group that launch created
    dataset = SlowDataset(n)
    results: dict[str, dict[str, float]] = {}
    for name, options in VARIANTS.items():
        ctx.communicator.barrier()  # both ranks measure the same variant at the same time
        config = LoaderConfig(batch_size=batch_size, **options)  # type: ignore[arg-type]
        start = time.perf_counter()
        loader = LoaderFactory.from_context(config, ctx).train_loader(dataset)
        loader.set_epoch(0)
        batches = sum(1 for _ in loader)
        first = time.perf_counter() - start
        later = []
        for epoch in range(1, later_epochs + 1):
            start = time.perf_counter()
            loader.set_epoch(epoch)
            for _ in loader:
                pass
            later.append(time.perf_counter() - start)
        results[name] = {
            "first_epoch_s": first,
            "later_epoch_s": statistics.median(later),
            "later_epoch_spread_s": [min(later), max(later)],
            "batches_per_epoch": batches,
        }
        del loader
    return results


def main() -> None:
    args = common.parse_args(__doc__ or "")
    n, later_epochs = (2000, 2) if args.quick else (20000, 5)
    per_rank = launch(_rank_worker, 2, n, later_epochs, 64, backend="gloo", deadline=600)
    ratios: list[dict[str, Any]] = []
    for rank, timings in enumerate(per_rank):
        cached = timings["rank_cached"]["later_epoch_s"]
        ratios.append(
            {
                "rank": rank,
                "later_epoch_speedup_vs_distributed_w0": timings["distributed_w0"]["later_epoch_s"]
                / cached,
                "later_epoch_speedup_vs_distributed_w1": timings["distributed_w1"]["later_epoch_s"]
                / cached,
                "later_epoch_speedup_vs_distributed_w0_spread": [
                    timings["distributed_w0"]["later_epoch_spread_s"][0]
                    / timings["rank_cached"]["later_epoch_spread_s"][1],
                    timings["distributed_w0"]["later_epoch_spread_s"][1]
                    / timings["rank_cached"]["later_epoch_spread_s"][0],
                ],
                "first_epoch_ratio_cached_vs_w0": timings["rank_cached"]["first_epoch_s"]
                / timings["distributed_w0"]["first_epoch_s"],
            }
        )
    worst = min(r["later_epoch_speedup_vs_distributed_w0"] for r in ratios)
    results = {
        "benchmark": "loader_cache",
        "targets_met": {"later epochs >= 20x faster than DistributedSampler": worst >= 20},
        "samples": n,
        "world_size": 2,
        "batch_size": 64,
        "per_rank": per_rank,
        "ratios": ratios,
    }
    common.report(results, args.out)


if __name__ == "__main__":
    main()
