"""FSDP2 against DDP on 2 CPU ranks (gloo) for a ~50M-parameter model trained with Adam:
memory per rank, step time, and sharded checkpoints against single files.

    python benchmarks/fsdp_sharding.py [--quick] [--out results.json]

The model is 12 blocks of Linear(2048, 2048) + ReLU and a Linear(2048, 10) head (50.4M
parameters), each Linear one FSDP2 unit, batch 8 per rank, one thread per process. Each
strategy runs in fresh processes (peak RSS never goes down within one).

- Memory per rank: the training state each rank holds during a step (its parameters, gradients
  and Adam moments, counted tensor by tensor; shards under FSDP2; a gradient has its
  parameter's layout, and lives from backward to the step), and the peak resident memory
  (ru_maxrss) over the process's baseline after imports and the process group. The state is
  what FSDP2 divides by the ranks; the peak also holds what it does not: the whole model
  built on every rank before ``fully_shard`` (this benchmark builds it on the CPU, not on the
  meta device), the gathered parameters of the blocks in flight, activations and gloo buffers.
  The peak is measured again (one epoch) with ``MALLOC_MMAP_THRESHOLD_=131072`` in the
  workers (see ``MALLOC``): freed blocks go back to the system, at the price of page faults.
- Step time: the median epoch time over the epochs after a warm-up, per optimizer step.
- Checkpoints (FSDP2 run): a sharded folder written by both ranks (DCP) against one file
  gathered to rank 0 (``checkpoint.format: file``), and loading each back; the checksums'
  cost: a sharded save through DCP's plain writer (no manifest) and a load that skips the
  verification, paired with the defaults in the same repetitions, and the verification
  timed alone (each rank reads its share of the folder and checks it); an asynchronous
  sharded save's stall, as a fraction of a synchronous sharded save (target <= 10%): the time
  until ``save_periodic`` returns to training (the state copied; after a first save, timed
  apart, which allocates the copy's buffers kept between saves), and (save + one epoch)
  minus one epoch alone (which also counts the background writer competing for the cores).

``--quick``: 4 blocks of Linear(256, 256), one repetition (a smoke test, not a measurement).
"""

from __future__ import annotations

import contextlib
import io
import os
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import common
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

from nn_handler import DistributedContext, NNHandler
from nn_handler.checkpoint import sharded as sharded_io
from nn_handler.checkpoint.opening import read
from nn_handler.checkpoint.saving import SaveRoute
from nn_handler.checkpoint.single_file import FileWriter
from nn_handler.checkpoint.store import LocalStore
from nn_handler.checkpoint.store import local as local_store

#: glibc's threshold above which an allocation is its own mmap (returned to the system when
#: freed). By default it grows to the size of any such block once freed, after which blocks of
#: that size come from the heap and freed ones stay in the process: FSDP2's per-block gather
#: and reduce buffers (16 MB here, allocated and freed every step) then pile up.
MALLOC = "MALLOC_MMAP_THRESHOLD_"


def model(width: int, blocks: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def state_bytes(handler: NNHandler) -> dict[str, float]:
    """MB of this rank's parameters, gradients and optimizer state (local shards)."""
    params = list(handler.trainer.module.parameters())
    optimizer = handler.trainer.optimizer
    moments = [
        value
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    ]
    mb = 2**20
    return {
        "parameters_mb": sum(_local_bytes(p) for p in params) / mb,
        # Held from backward to the optimizer step (freed by zero_grad after it), in the
        # parameters' own layout: each trainable parameter's (local) size.
        "gradients_mb": sum(_local_bytes(p) for p in params if p.requires_grad) / mb,
        "optimizer_mb": sum(_local_bytes(m) for m in moments) / mb,
    }


def _timed(fn: Any) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _worker(
    rank: int, port: int, strategy: str, quick: bool, folder: str, full: bool, out: Any
) -> None:
    common.join_gloo_group(rank, port, timeout_s=600)
    baseline = _rss_mb()
    width, blocks, batches, repeats = (256, 4, 4, 1) if quick else (2048, 12, 6, 2 if full else 1)
    generator = torch.Generator().manual_seed(0)
    samples = 2 * 8 * batches  # 2 ranks x batch 8 x batches per epoch
    data = TensorDataset(
        torch.randn(samples, width, generator=generator), torch.randint(0, 10, (samples,))
    )
    trainer: dict[str, Any] = {"progress_bar": False, "strategy": strategy}
    if strategy == "fsdp":
        trainer["fsdp"] = {"blocks": ["Linear"]}
    config = {
        "loader": {"batch_size": 8},
        "trainer": trainer,
        "checkpoint": {"dir": folder, "save_last": False, "async_save": strategy == "fsdp"},
        "logging": {"enabled": False},
    }
    result: dict[str, Any] = {"strategy": strategy}
    with (
        contextlib.redirect_stderr(io.StringIO()),
        NNHandler(
            model(width, blocks),
            lambda p: torch.optim.Adam(p, lr=1e-4),
            nn.functional.cross_entropy,
            config=config,
            context=DistributedContext(),
        ) as handler,
    ):
        result["parameters"] = blocks * (width * width + width) + width * 10 + 10
        result["rss_after_setup_over_baseline_mb"] = _rss_mb() - baseline
        epochs = [_timed(lambda e=e: handler.train(data, epochs=e + 1)) for e in range(repeats + 1)]
        result["step_s"] = statistics.median(epochs[1:]) / batches
        result["state"] = state_bytes(handler)
        result["peak_rss_over_baseline_mb"] = _rss_mb() - baseline
        if strategy == "fsdp" and full:
            result["checkpoints"] = _checkpoints(handler, data, Path(folder), repeats)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def _checkpoints(handler: NNHandler, data: Any, folder: Path, repeats: int) -> dict[str, Any]:
    trainer = handler.trainer
    rows: dict[str, list[float]] = {
        k: []
        for k in (
            "sharded",
            "file",
            "load_sharded",
            "load_file",
            "sharded_unchecked",
            "load_sharded_unverified",
            "verify",
            "epoch",
            "async_epoch",
            "async_return",
        )
    }
    sharded, single = folder / "sharded", folder / "single.pt"
    unchecked = folder / "unchecked"

    store = LocalStore(folder)

    def save_file() -> None:
        route = SaveRoute(trainer.comm, store)
        route.save(single, FileWriter(trainer.comm), trainer.state_dict())

    def save_unchecked() -> None:  # DCP's own writer: no checksums (the manifest sizes only)
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        plain, entry_of = sharded_io._writer, local_store.entry_of
        sharded_io._writer = lambda staging: FileSystemWriter(str(staging), sync_files=True)
        local_store.entry_of = lambda path: {"size": path.stat().st_size}
        try:
            trainer.save_checkpoint(unchecked)
        finally:
            sharded_io._writer, local_store.entry_of = plain, entry_of

    def load_unverified() -> None:
        rest = read(sharded).contents
        trainer.checkpointing.load(rest, str(sharded), None, sharded, verified=True)

    def verify() -> None:
        sharded_io.verify_sharded(sharded, trainer.comm, read(sharded).contents)

    def train_one_more() -> None:
        handler.train(data, epochs=trainer.state.epoch + 1)

    def async_save_then_train() -> None:  # fit's end waits for the background save
        start = time.perf_counter()
        trainer.save_periodic()
        rows["async_return"].append(time.perf_counter() - start)
        handler.train(data, epochs=trainer.state.epoch + 1)

    async_save_then_train()  # the first allocates the copy's buffers, kept between saves
    first_async_return = rows["async_return"].pop()
    for _ in range(repeats):
        rows["sharded"].append(_timed(lambda: trainer.save_checkpoint(sharded)))
        rows["file"].append(_timed(save_file))
        rows["load_sharded"].append(_timed(lambda: trainer.resume(sharded)))
        rows["load_file"].append(_timed(lambda: trainer.resume(single)))
        rows["sharded_unchecked"].append(_timed(save_unchecked))
        rows["load_sharded_unverified"].append(_timed(load_unverified))
        rows["verify"].append(_timed(verify))
        rows["epoch"].append(_timed(train_one_more))
        rows["async_epoch"].append(_timed(async_save_then_train))
        shutil.rmtree(sharded, ignore_errors=True)
        shutil.rmtree(unchecked, ignore_errors=True)
    median = {k: statistics.median(v) for k, v in rows.items()}
    size = sum(f.stat().st_size for f in (folder / "single.pt",)) / 2**20
    stall = median["async_epoch"] - median["epoch"]
    return {
        "single_file_mb": size,
        "seconds": median,
        "save_mb_per_s": {"sharded": size / median["sharded"], "file": size / median["file"]},
        "load_mb_per_s": {
            "sharded": size / median["load_sharded"],
            "file": size / median["load_file"],
        },
        "checksums": {
            "save_with_over_without": median["sharded"] / median["sharded_unchecked"],
            "load_with_over_without": median["load_sharded"] / median["load_sharded_unverified"],
            "verify_s": median["verify"],
        },
        "async_stall_s": stall,
        "async_stall_fraction_of_sync_save": stall / median["sharded"],
        "async_return_fraction_of_sync_save": median["async_return"] / median["sharded"],
        "first_async_return_s": first_async_return,
    }


def main() -> None:
    args = common.parse_args(__doc__ or "")
    results: dict[str, Any] = {}
    returned: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="nnh-bench-fsdp-") as base:
        for strategy in ("ddp", "fsdp"):
            folder = str(Path(base) / strategy)
            results[strategy] = common.run_ranks(
                2, _worker, strategy, args.quick, folder, True, timeout=1200
            )
            if not args.quick:  # one epoch with glibc returning freed blocks to the system
                os.environ[MALLOC] = "131072"  # read by the spawned workers when they start
                try:
                    returned[strategy] = common.run_ranks(
                        2, _worker, strategy, False, folder + "-mmap", False, timeout=1200
                    )["peak_rss_over_baseline_mb"]
                finally:
                    os.environ.pop(MALLOC)
    ddp, fsdp = results["ddp"], results["fsdp"]
    state = {k: fsdp["state"][k] / ddp["state"][k] for k in ddp["state"]}
    total = sum(fsdp["state"].values()) / sum(ddp["state"].values())
    stall = fsdp["checkpoints"]["async_return_fraction_of_sync_save"]
    common.report(
        {
            "benchmark": "fsdp_sharding",
            "results": results,
            "peak_rss_over_baseline_mb_mmap_threshold": returned,
            "fsdp_over_ddp": {
                "state_per_rank": total,
                "state_parts": state,
                "peak_rss": fsdp["peak_rss_over_baseline_mb"] / ddp["peak_rss_over_baseline_mb"],
                "step_time": fsdp["step_s"] / ddp["step_s"],
            },
            "targets_met": {
                "training state per rank <= 0.55x DDP's": total <= 0.55,
                "async save stall <= 10% of a synchronous save": stall <= 0.10,
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
