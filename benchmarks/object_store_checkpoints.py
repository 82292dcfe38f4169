"""Checkpoints on an object store: a ~100 MB checkpoint saved to the local disk, to a local S3
server, and with plain torch.save, and the training loop's stall when the upload runs in the
background.

    python benchmarks/object_store_checkpoints.py [--quick] [--out results.json]

The S3 server is moto's on 127.0.0.1 (tests/object_store.py), reached through s3fs exactly as
a job reaches S3: what it measures is nn_handler's own cost (the local write, the CRC-32 of
every object, the upload with 8 objects at once, the manifest and latest.json), not a
network's. Variants run back to back in each repetition (one warm-up round excluded):

- ``torch.save``: the plain call to a local file (the reference);
- ``save_periodic, local folder``: CheckpointManager's atomic, fsynced save and latest.json;
- ``save_periodic, s3:// (upload waited for)``: the same into the working copy, uploaded and
  committed before it returns;
- ``save_periodic, s3:// async_save: the loop's stall``: what the training loop waits for
  with ``async_save`` (the local write; the upload runs in the background), and
  ``... background upload done`` the time until the upload was committed.

Target: the stall with background upload within 2x of torch.save (the local atomic save's own
target).

``--quick``: 10 MB and 2 repetitions (a smoke test, not a measurement).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nn_handler.checkpoint import CheckpointManager
from nn_handler.checkpoint.single_file import FileWriter
from nn_handler.config import CheckpointConfig
from nn_handler.distributed.communicator import NullCommunicator

STALL = "save_periodic, s3:// async_save: the loop's stall"
DONE = "save_periodic, s3:// async_save: background upload done"


def state_dict(megabytes: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        f"layer{i}.weight": torch.randn(256, 1024, generator=generator) for i in range(megabytes)
    }


def measure(megabytes: int, repeats: int) -> tuple[dict[str, list[float]], float]:
    from tests.object_store import serving

    state = state_dict(megabytes)
    size_mb = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    with serving() as server, tempfile.TemporaryDirectory(prefix="nnh-bench-") as folder:
        os.environ.update(server.env())
        import fsspec

        fsspec.filesystem("s3", skip_instance_cache=True).mkdir("bench")
        base = Path(folder)
        comm = NullCommunicator()

        def manager(name: str, url: str | None, background: bool) -> CheckpointManager:
            config = CheckpointConfig(
                dir=url or str(base / name), staging_dir=str(base / f"{name}-copy"),
                async_save=background,
            )  # fmt: skip
            return CheckpointManager(config, comm)

        local = manager("local", None, False)
        remote = manager("remote", "s3://bench/sync", False)
        background = manager("background", "s3://bench/async", True)
        step = [0]

        def periodic(target: CheckpointManager) -> Callable[[], Any]:
            def save() -> None:
                step[0] += 1
                target.save_periodic(FileWriter(target.comm), state, 0, step[0])

            return save

        variants: dict[str, Callable[[], Any]] = {
            "torch.save": lambda: torch.save(state, base / "plain.pt"),
            "save_periodic, local folder": periodic(local),
            "save_periodic, s3:// (upload waited for)": periodic(remote),
        }
        times: dict[str, list[float]] = {name: [] for name in (*variants, STALL, DONE)}
        for round_index in range(repeats + 1):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                if round_index:  # round 0 warms the page cache, the allocator, connections
                    times[name].append(time.perf_counter() - start)
            start = time.perf_counter()
            periodic(background)()
            stall = time.perf_counter() - start
            background.flush()
            if round_index:
                times[STALL].append(stall)
                times[DONE].append(time.perf_counter() - start)
        for each in (local, remote, background):
            each.release()
    return times, size_mb


def main() -> None:
    args = common.parse_args(__doc__ or "")
    megabytes, repeats = (10, 2) if args.quick else (100, 7)
    times, size_mb = measure(megabytes, repeats)
    results = {}
    for name, seconds in times.items():
        ratios = [a / b for a, b in zip(seconds, times["torch.save"], strict=True)]
        median = statistics.median(seconds)
        results[name] = {
            "seconds_median": median,
            "mb_per_s": size_mb / median,
            "ratio_to_torch_median": statistics.median(ratios),
            "ratio_spread": [min(ratios), max(ratios)],
        }
    stall = results[STALL]["ratio_to_torch_median"]
    common.report(
        {
            "benchmark": "object_store_checkpoints",
            "state_dict_mb": size_mb,
            "repeats": repeats,
            "results": results,
            "targets_met": {
                "the loop's stall with background upload within 2x of torch.save": stall <= 2.0
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
