"""Per-step cost of NNHandler.train against a hand-written DDP loop (world size 2, gloo).

    python benchmarks/training_step.py [--quick] [--out results.json]

Both run in the same 2-process gloo group on 127.0.0.1, on the same model, data, seed and
number of steps: a tiny MLP (32->64->10, batch 64: overhead-dominated) and a small CNN on
1x28x28 (compute-dominated). NNHandler runs with its defaults on (progress bar on rank 0, epoch
metrics, the NaN guard). Each repetition times one epoch of each, back to back (A B A B ...,
warm-up excluded); the report gives the median seconds per step and the median and spread of
per-repetition ratios NNHandler / raw.
"""

from __future__ import annotations

import contextlib
import gc
import io
import shutil
import statistics
import tempfile
import time
from typing import Any

import common
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from nn_handler import DistributedContext, NNHandler


def tiny_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 10),
    )


CASES = {
    "tiny_mlp": (tiny_mlp, (32,), 64),
    "small_cnn": (small_cnn, (1, 28, 28), 32),
}


def _dataset(shape: tuple[int, ...], samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, *shape, generator=generator)
    y = torch.randint(0, 10, (samples,), generator=generator)
    return TensorDataset(x, y)


def _raw_epoch(model: nn.Module, optimizer: Any, loader: Any, epoch: int) -> None:
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        optimizer.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()


def _worker(rank: int, port: int, case: str, steps: int, repeats: int, out: Any) -> None:
    common.join_gloo_group(rank, port, timeout_s=120)
    result = _measure(rank, case, steps, repeats)
    if rank == 0:
        out.put(result)
    # Every DDP wrapper is gone with _measure's frame; collect it before the group goes, or a
    # reducer freed after destroy_process_group can hang the process at exit.
    gc.collect()
    dist.destroy_process_group()


def _measure(rank: int, case: str, steps: int, repeats: int) -> dict[str, Any]:
    build, shape, batch = CASES[case]
    dataset = _dataset(shape, steps * batch * 2)
    torch.manual_seed(0)
    raw_model = DistributedDataParallel(build())
    raw_optimizer = torch.optim.SGD(raw_model.parameters(), lr=0.01)
    sampler: DistributedSampler[Any] = DistributedSampler(dataset, 2, rank, seed=0)
    raw_loader = DataLoader(dataset, batch_size=batch, sampler=sampler)
    torch.manual_seed(0)
    handler = NNHandler(
        build(),
        lambda p: torch.optim.SGD(p, lr=0.01),
        nn.CrossEntropyLoss(),
        config={"loader": {"batch_size": batch}},
        context=DistributedContext(),
    )
    folder = tempfile.mkdtemp(prefix="nnh-bench-")
    torch.manual_seed(0)
    guarded = NNHandler(  # SIGTERM handling on: the preemption check runs (nothing is saved)
        build(),
        lambda p: torch.optim.SGD(p, lr=0.01),
        nn.CrossEntropyLoss(),
        config={
            "loader": {"batch_size": batch},
            "checkpoint": {"dir": folder, "save_last": False, "every_n_epochs": None},
        },
        context=DistributedContext(),
    )
    raw_s: list[float] = []
    ours_s: list[float] = []
    guarded_s: list[float] = []
    sink = io.StringIO()  # the rank-0 progress bar draws here, not on the terminal
    with contextlib.redirect_stderr(sink):
        for repeat in range(repeats + 1):  # repetition 0 is the warm-up
            dist.barrier()
            start = time.perf_counter()
            _raw_epoch(raw_model, raw_optimizer, raw_loader, repeat)
            raw_time = (time.perf_counter() - start) / steps
            dist.barrier()
            start = time.perf_counter()
            handler.train(dataset, epochs=repeat + 1)
            ours_time = (time.perf_counter() - start) / steps
            dist.barrier()
            start = time.perf_counter()
            guarded.train(dataset, epochs=repeat + 1)
            guarded_time = (time.perf_counter() - start) / steps
            if repeat:
                raw_s.append(raw_time)
                ours_s.append(ours_time)
                guarded_s.append(guarded_time)
    handler.close()
    guarded.close()
    shutil.rmtree(folder, ignore_errors=True)
    ratios = [o / r for o, r in zip(ours_s, raw_s, strict=True)]
    guarded_ratios = [g / r for g, r in zip(guarded_s, raw_s, strict=True)]
    return {
        "case": case,
        "steps_per_epoch": steps,
        "batch_per_rank": batch,
        "raw_ms_per_step": statistics.median(raw_s) * 1e3,
        "nn_handler_ms_per_step": statistics.median(ours_s) * 1e3,
        "ratio_median": statistics.median(ratios),
        "ratio_spread": [min(ratios), max(ratios)],
        "with_preemption_check_ms_per_step": statistics.median(guarded_s) * 1e3,
        "with_preemption_check_ratio_median": statistics.median(guarded_ratios),
        "with_preemption_check_ratio_spread": [min(guarded_ratios), max(guarded_ratios)],
    }


def run_case(case: str, steps: int, repeats: int) -> dict[str, Any]:
    result: dict[str, Any] = common.run_two_ranks(_worker, case, steps, repeats, timeout=900)
    return result


def main() -> None:
    args = common.parse_args(__doc__ or "")
    plan = (
        {"tiny_mlp": (20, 3), "small_cnn": (5, 2)}
        if args.quick
        else {
            "tiny_mlp": (200, 15),
            "small_cnn": (40, 9),
        }
    )
    results = [run_case(case, steps, repeats) for case, (steps, repeats) in plan.items()]
    common.report({"benchmark": "training_step", "world_size": 2, "results": results}, args.out)


if __name__ == "__main__":
    main()
