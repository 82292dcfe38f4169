"""Checkpoint saves against the loop: what an asynchronous sharded save blocks training for, what
a synchronous one reaches of the disk's bandwidth, and 200 steps with a save at every step.

    python benchmarks/async_saves.py [--quick] [--out results.json]

On the weights of a ~50M-parameter model (12 x Linear(2048, 2048), 201 MB in float32), in one
process and on 2 gloo ranks (each rank stages its whole replicated state; DCP writes each
tensor once), back to back in each repetition (one warm-up round excluded):

- ``memcpy``: copying the state into CPU buffers kept between copies (the least an
  asynchronous save must block for);
- ``async save, local folder`` / ``async save, s3://``: what ``SaveRoute.save(...,
  background=True)`` blocks the loop for (the write and, for the local S3 server, the
  upload run in the background; waited for outside the measure), and, for the local folder,
  what the next save's wait adds once the background write is done: the agreement on the
  writes, the manifest and the rename that commit it (no target: reported beside);
- ``synchronous save`` against ``fsync'd write``: the same bytes written to one file and
  fsynced (the disk's bandwidth as a save can reach it);
- beside: a small model's training step (1 thread) while an async save writes in the
  background (a thread of the training process: it shares the GIL), against the same step
  alone; no target.

Targets (the checkpoint-protocol issue's): blocked per async save <= 1.2x the memcpy; a
synchronous save >= 85% of the fsync'd write bandwidth; 200 steps of a small model on 2 ranks
with an async sharded save after every step finish (no deadlock) within the run's bound.

``--quick``: a 2M-parameter model, 2 repetitions, 20 steps (a smoke test, not a measurement).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from queue import Queue
from typing import Any

import common
import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nn_handler.checkpoint.saving import SaveRoute
from nn_handler.checkpoint.sharded import ShardedWriter
from nn_handler.distributed.communicator import NullCommunicator, TorchCommunicator

LOCAL, S3 = "async save, local folder: blocked", "async save, s3://: blocked"
COMMIT = "async save, local folder: its commit at the next wait"
MEMCPY, SYNC, FSYNC = "memcpy", "synchronous save", "fsync'd write"


def model(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(12)))


def nbytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def fsynced_write(path: Path, size: int) -> None:
    chunk = bytes(8 << 20)
    with open(path, "wb") as handle:
        for start in range(0, size, len(chunk)):
            handle.write(chunk[: min(len(chunk), size - start)])
        handle.flush()
        os.fsync(handle.fileno())


def measure(comm: Any, group: Any, width: int, repeats: int, url: str | None) -> dict[str, Any]:
    """Every variant's seconds per repetition on this rank."""
    from nn_handler.checkpoint.store import LocalStore
    from nn_handler.checkpoint.store.object_store import ObjectStore
    from nn_handler.config import CheckpointConfig

    state = {k: v.detach() for k, v in model(width).state_dict().items()}
    buffers = {k: torch.empty_like(v) for k, v in state.items()}
    times: dict[str, list[float]] = {MEMCPY: [], LOCAL: [], COMMIT: [], SYNC: [], FSYNC: []}
    with tempfile.TemporaryDirectory(prefix="nnh-bench-") as scratch:
        base = Path(comm.broadcast_object(scratch if comm.rank == 0 else None))
        writer = ShardedWriter(comm, lambda: group)
        local = SaveRoute(comm, LocalStore(base))
        remote = None
        if url is not None:
            times[S3] = []
            store = ObjectStore(CheckpointConfig(dir=url, staging_dir=str(base / "copy")))
            remote = SaveRoute(comm, store, store.where)
            if comm.rank == 0:
                store.store.check()
        rest = {"format": "bench"} if comm.rank == 0 else None
        for index in range(repeats + 1):
            for values in state.values():
                values.add_(1.0)  # a new step's weights
            start = time.perf_counter()
            for key, values in state.items():
                buffers[key].copy_(values)
            spent = {MEMCPY: time.perf_counter() - start}
            start = time.perf_counter()
            contents = (rest, {"model": state})
            local.save(base / f"async-{index}", writer, contents, background=True)
            spent[LOCAL] = time.perf_counter() - start
            while local.writing:  # the background write: what the next wait adds is the commit
                time.sleep(0.002)
            comm.barrier()
            start = time.perf_counter()
            local.wait()
            spent[COMMIT] = time.perf_counter() - start
            if remote is not None:
                start = time.perf_counter()
                target = remote.store.dir / f"ckpt-e0000-s{index:08d}"
                remote.save(target, writer, contents, background=True)
                spent[S3] = time.perf_counter() - start
                remote.wait()
            start = time.perf_counter()
            local.save(base / f"sync-{index}", writer, contents)
            spent[SYNC] = time.perf_counter() - start
            comm.barrier()
            start = time.perf_counter()
            fsynced_write(base / f"plain-{comm.rank}-{index}", nbytes(state) // comm.world_size)
            comm.barrier()
            spent[FSYNC] = time.perf_counter() - start
            if index:  # round 0 warms the page cache, the allocator and the staging buffers
                for name, seconds in spent.items():
                    times[name].append(seconds)
        local.close()
        comm.barrier()
    return {"times": times, "bytes": nbytes(state)}


def summary(times: dict[str, list[float]], size: int) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    for name, values in times.items():
        row: dict[str, Any] = {"seconds_median": statistics.median(values), "seconds": values}
        if name in (SYNC, FSYNC):
            row["mb_per_s"] = size / 2**20 / row["seconds_median"]
        if name in (LOCAL, S3, COMMIT):
            row.update(common.ratio_summary(values, times[MEMCPY]))
        rows[name] = row
    # The synchronous save's share of the fsync'd write's bandwidth (per repetition).
    rows[SYNC]["bandwidth_share"] = common.ratio_summary(times[FSYNC], times[SYNC])
    return rows


def one_process(width: int, repeats: int, url: str | None) -> dict[str, Any]:
    measured = measure(NullCommunicator(), None, width, repeats, url)
    return summary(measured["times"], measured["bytes"])


def beside(width: int, saves: int) -> dict[str, Any]:
    """A training step's median time while an async save of the state writes in the
    background, against alone (1 process, the step on 1 thread)."""
    from nn_handler.checkpoint.store import LocalStore

    state = {k: v.detach() for k, v in model(width).state_dict().items()}
    small = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    optimizer = torch.optim.SGD(small.parameters(), lr=0.01)
    inputs = torch.randn(64, 256)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)

    def steps(seconds: float, writer: SaveRoute | None = None) -> list[float]:
        times: list[float] = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:  # at least one step (it starts while writing)
            start = time.perf_counter()
            optimizer.zero_grad()
            small(inputs).pow(2).mean().backward()
            optimizer.step()
            times.append(time.perf_counter() - start)
            if writer is not None and not writer.writing:
                break
        return times

    try:
        steps(0.5)
        alone = steps(2.0)
        during: list[float] = []
        with tempfile.TemporaryDirectory(prefix="nnh-bench-") as scratch:
            base = Path(scratch)
            writer = ShardedWriter(NullCommunicator(), lambda: None)
            route = SaveRoute(NullCommunicator(), LocalStore(base))
            for index in range(saves + 1):
                target = base / f"ckpt-e0000-s{index:08d}"
                route.save(target, writer, ({"format": "bench"}, {"model": state}),
                           background=True)  # fmt: skip
                measured = steps(60.0, route)
                route.wait()
                if index:  # the first save warms the staging buffers
                    during += measured
            route.close()
    finally:
        torch.set_num_threads(threads)
    return {
        "step_ms_alone": statistics.median(alone) * 1e3,
        "step_ms_during": statistics.median(during) * 1e3,
        "steps_during": len(during),
        "ratio_median": statistics.median(during) / statistics.median(alone),
    }


def _ranks(rank: int, port: int, width: int, repeats: int, url: str | None, queue: Queue) -> None:
    common.join_gloo_group(rank, port, timeout_s=600)
    group = dist.new_group(backend="gloo")  # the checkpoint's own, as the strategies' is
    comm = TorchCommunicator()
    measured = measure(comm, group, width, repeats, url)
    slowest = {
        name: [max(per_rank) for per_rank in zip(*every, strict=True)]
        for name, every in (
            (name, comm.all_gather_object(values)) for name, values in measured["times"].items()
        )
    }
    if rank == 0:
        queue.put(summary(slowest, measured["bytes"]))
    dist.destroy_process_group()


def _every_step(rank: int, port: int, steps: int, queue: Queue) -> None:
    """A small model trained ``steps`` steps on 2 ranks with an async sharded save after
    every step (keep_last 2): it must finish."""
    from torch.utils.data import TensorDataset

    from nn_handler import NNHandler

    common.join_gloo_group(rank, port, timeout_s=120)
    scratch = Path(tempfile.gettempdir()) / f"nnh-bench-every-step-{port}"
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(steps * 4, 16, generator=generator),
                         torch.randint(0, 4, (steps * 4,), generator=generator))  # fmt: skip
    config = {
        "loader": {"batch_size": 2, "shuffle": False},
        "trainer": {"progress_bar": False},
        "checkpoint": {"dir": str(scratch), "format": "sharded", "async_save": True,
                       "every_n_steps": 1, "keep_last": 2, "resume": "never"},
    }  # fmt: skip
    start = time.perf_counter()
    sgd = lambda p: torch.optim.SGD(p, lr=0.01)  # noqa: E731
    with NNHandler(nn.Linear(16, 4), sgd, nn.CrossEntropyLoss(), config=config) as h:
        h.train(data, epochs=1)
        done = h.trainer.state.global_step
    seconds = time.perf_counter() - start
    if rank == 0:
        import shutil

        shutil.rmtree(scratch, ignore_errors=True)
        queue.put({"steps": done, "seconds": seconds})


def main() -> None:
    args = common.parse_args(__doc__ or "")
    width, repeats, steps = (128, 2, 20) if args.quick else (2048, 5, 200)
    from tests.object_store import serving

    with serving() as server:
        os.environ.update(server.env())
        bucket = f"bench-{os.getpid()}"
        import boto3

        boto3.client("s3").create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/run"
        alone = one_process(width, repeats, url)
        two = common.run_two_ranks(_ranks, width, repeats, f"{url}-2", timeout=1200)
    stall = beside(width, 1 if args.quick else 3)
    every = common.run_two_ranks(_every_step, steps, timeout=600)
    state_mb = sum(p.numel() * 4 for p in model(width).parameters()) / 2**20
    params = sum(p.numel() for p in model(width).parameters())
    targets = {}
    for label, rows in (("1 process", alone), ("2 ranks", two)):
        for name in (LOCAL, S3):
            ratio = rows[name]["ratio_median"]
            targets[f"{label}, {name} <= 1.2x memcpy"] = common.meets(ratio, "<=", 1.2)
        share = rows[SYNC]["bandwidth_share"]["ratio_median"]
        targets[f"{label}, synchronous save >= 85% of the fsync'd write"] = common.meets(
            share, ">=", 0.85
        )
    targets[f"{steps} steps, an async save at each, 2 ranks, finish"] = every["steps"] == steps
    common.report(
        {
            "benchmark": "async_saves",
            "quick": args.quick,
            "parameters": params,
            "state_dict_mb": state_mb,
            "repeats": repeats,
            "results": {"1 process": alone, "2 ranks": two},
            "every_step": every,
            "beside": stall,
            "targets_met": targets,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
