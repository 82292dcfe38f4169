"""Samples per second of NNHandler.train on the small CNN with 1 and 2 processes (gloo), and on
one GPU in bf16 against fp32 when there is one.

    python benchmarks/scaling.py [--quick] [--out results.json]

The same global data (N samples of 1x28x28, batch 32 per rank) is trained for one epoch per
repetition; samples/s is N divided by the epoch's wall time on rank 0 (median of the
repetitions after a warm-up epoch). Scaling efficiency is samples/s with 2 processes divided by
twice the samples/s of one. Each process uses one thread: on a machine with 2 cores the 2-rank
run has no idle core, so its efficiency is bounded by the cores, not the framework.
"""

from __future__ import annotations

import contextlib
import gc
import io
import statistics
import time
from typing import Any

import common
import torch
import torch.distributed as dist
from models import dataset as _dataset
from models import small_cnn
from torch import nn

from nn_handler import DistributedContext, NNHandler


def _samples_per_s(
    samples: int, batch: int, repeats: int, device: str | None = None, precision: str = "32"
) -> dict[str, Any]:
    data = _dataset((1, 28, 28), samples)
    torch.manual_seed(0)
    config: dict[str, Any] = {
        "loader": {"batch_size": batch},
        "trainer": {"progress_bar": False},
        "precision": precision,
    }
    if device is not None:
        config["distributed"] = {"device": device}
    handler = NNHandler(
        small_cnn(),
        lambda p: torch.optim.SGD(p, lr=0.01),
        nn.functional.cross_entropy,
        config=config,
        context=DistributedContext(),
    )
    times = []
    with contextlib.redirect_stderr(io.StringIO()):
        for repeat in range(repeats + 1):  # the first epoch is the warm-up
            if dist.is_initialized():
                dist.barrier()
            if device is not None and device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            handler.train(data, epochs=repeat + 1)
            if device is not None and device.startswith("cuda"):
                torch.cuda.synchronize()
            if repeat:
                times.append(time.perf_counter() - start)
    handler.close()
    seconds = statistics.median(times)
    return {"samples": samples, "epoch_s": seconds, "samples_per_s": samples / seconds}


def _worker(rank: int, port: int, world: int, samples: int, repeats: int, out: Any) -> None:
    torch.set_num_threads(1)
    if world > 1:
        common.join_gloo_group(rank, port, timeout_s=300, world_size=world)
    result = _samples_per_s(samples, 32, repeats)
    if rank == 0:
        out.put(result)
    gc.collect()
    if world > 1:
        dist.destroy_process_group()


def gpu_precision(samples: int, repeats: int) -> dict[str, Any]:
    """One GPU: samples/s in fp32 and bf16 (batch 256), or why it was skipped."""
    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device on this machine"}
    rows = {p: _samples_per_s(samples, 256, repeats, "cuda:0", p) for p in ("32", "bf16")}
    return {
        "device": torch.cuda.get_device_name(0),
        **rows,
        "bf16_speedup": rows["bf16"]["samples_per_s"] / rows["32"]["samples_per_s"],
    }


def main() -> None:
    args = common.parse_args(__doc__ or "")
    samples, repeats = (512, 1) if args.quick else (4096, 5)
    per_world = {
        world: common.run_ranks(world, _worker, world, samples, repeats, timeout=900)
        for world in (1, 2)
    }
    efficiency = per_world[2]["samples_per_s"] / (2 * per_world[1]["samples_per_s"])
    common.report(
        {
            "benchmark": "scaling",
            "cpu_small_cnn": {
                "world_1": per_world[1],
                "world_2": per_world[2],
                "speedup_2_over_1": per_world[2]["samples_per_s"] / per_world[1]["samples_per_s"],
                "efficiency": efficiency,
            },
            "gpu_bf16_vs_fp32": gpu_precision(samples * 4, repeats),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
