"""Cost of one EMA update: nn_handler's ModelEma against a bare torch._foreach_lerp_ over the
same tensors, a naive per-parameter loop, and torch.optim.swa_utils.AveragedModel.

    python benchmarks/ema_update.py [--quick] [--out results.json]

The model has about 25M parameters in 200 tensors (--quick: 2.5M). Each repetition times every
variant back to back (A B A B ..., warm-up excluded); the report gives the median time per
update and the median and spread of per-repetition ratios to the bare foreach kernel.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import common
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from nn_handler.config import EmaConfig
from nn_handler.training import ModelEma

DECAY = 0.9999


def model_of(total: int, tensors: int) -> nn.Module:
    per = total // tensors
    return nn.ParameterList([nn.Parameter(torch.randn(per)) for _ in range(tensors)])


def variants(model: nn.Module) -> dict[str, Callable[[], None]]:
    params = list(model.parameters())
    bare_targets = [p.detach().clone() for p in params]
    sources = [p.detach() for p in params]
    ema = ModelEma(model, EmaConfig(enabled=True, decay=DECAY))
    naive_targets = [p.detach().clone() for p in params]
    averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY))

    def bare() -> None:
        torch._foreach_lerp_(bare_targets, sources, 1.0 - DECAY)

    def naive() -> None:
        with torch.no_grad():
            for target, source in zip(naive_targets, sources, strict=True):
                target.mul_(DECAY).add_(source, alpha=1.0 - DECAY)

    return {
        "foreach_lerp (bare)": bare,
        "nn_handler ModelEma.update": ema.update,
        "naive per-parameter loop": naive,
        "swa_utils AveragedModel": lambda: averaged.update_parameters(model),
    }


def measure(fn: Callable[[], None], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    args = common.parse_args(__doc__ or "")
    total, repeats, calls = (2_500_000, 5, 5) if args.quick else (25_000_000, 15, 10)
    torch.manual_seed(0)
    cases = variants(model_of(total, 200))
    for fn in cases.values():  # warm-up, and AveragedModel's first update (a copy)
        fn()
        fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(measure(fn, calls))
    bare = times["foreach_lerp (bare)"]
    results = {}
    for name, values in times.items():
        ratios = [v / b for v, b in zip(values, bare, strict=True)]
        results[name] = {
            "ms_per_update": statistics.median(values),
            "ratio_to_bare_median": statistics.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)],
        }
    common.report(
        {
            "benchmark": "ema_update",
            "parameters": total,
            "tensors": 200,
            "repeats": repeats,
            "calls_per_repeat": calls,
            "threads": torch.get_num_threads(),
            "results": results,
            "targets_met": {
                "ModelEma.update within 1.15x of bare _foreach_lerp_": results[
                    "nn_handler ModelEma.update"
                ]["ratio_to_bare_median"]
                <= 1.15
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
