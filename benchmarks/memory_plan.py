"""The memory plan (TrainerConfig's, printed at the start) against each rank's measured peak.

    python benchmarks/memory_plan.py [--quick] [--out results.json]

A model built on the meta device (residual blocks of LayerNorm + Linear(W, W); W=2048 and 12
blocks: 50.4M parameters, 806 MB of fp32 weights + Adam state) trains 3 steps with Adam under
each layout (DDP over 2 and 4 ranks, FSDP2 over 2 and 4, HSDP 2 x 2, activation checkpointing,
and the reproducible mode's exact sum replicated, over FSDP2 and over HSDP: micro-batches of
4), in its own torchrun job on 127.0.0.1 (gloo, one thread per rank), with
MALLOC_MMAP_THRESHOLD_=131072 (glibc then returns freed blocks: the peak measures tensors, not
the allocator's cache). Measured per rank: Linux's VmHWM over the process's resident memory
after the libraries' own first-run memory (a tiny run of the same layout first); the plan's
total is compared with the largest rank's peak. The script is tests/scripts/large_model_memory.py
(the test of the same name runs it on a smaller model).

Target: the plan within 15% of the measured peak in every case.

``--quick``: W=512, 4 blocks, one case with activation checkpointing (a smoke test; small
models measure the baseline's noise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import common

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "large_model_memory.py"
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}

#: name -> (ranks, the script's options)
CASES: dict[str, tuple[int, list[str]]] = {
    "ddp 2": (2, ["--strategy", "ddp"]),
    "fsdp 2": (2, []),
    "ddp 4": (4, ["--strategy", "ddp"]),
    "fsdp 4": (4, []),
    "hsdp 2x2": (4, ["--replicate", "2"]),
    "fsdp 2, batch 512": (2, ["--batch", "512"]),
    "fsdp 2, batch 512, selective": (2, ["--batch", "512", "--checkpointing", "selective"]),
    "fsdp 2, batch 512, full": (2, ["--batch", "512", "--checkpointing", "full"]),
    "reproducible 2": (2, ["--strategy", "auto", "--micro", "4"]),
    "reproducible fsdp 2": (2, ["--micro", "4"]),
    "reproducible hsdp 2x2": (4, ["--replicate", "2", "--micro", "4"]),
}
QUICK = ("fsdp 2, batch 512, full",)


def _port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _case(ranks: int, options: list[str], size: list[str], folder: Path) -> dict[str, Any]:
    out = folder / "report"
    command = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
        "--nnodes=1", "--master-addr=127.0.0.1", f"--master-port={_port()}",
        str(SCRIPT), str(out), *size, *options,
    ]  # fmt: skip
    done = subprocess.run(
        command, env={**os.environ, **MALLOC}, capture_output=True, text=True, timeout=900
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
    reports = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(ranks)]
    peak = max(r["peak"] for r in reports)
    plan = reports[0]["plan"]
    return {
        "ranks": ranks,
        "options": " ".join(options),
        "plan_bytes": plan,
        "peak_bytes": peak,
        "peaks_bytes": [r["peak"] for r in reports],
        "setup_peak_bytes": max(r["setup_peak"] for r in reports),
        "plan_over_peak": plan / peak,
        "items_bytes": reports[0]["items"],
        "model_state_bytes": reports[0]["model_state"],
    }


def main() -> None:
    args = common.parse_args(__doc__ or "")
    size = (
        ["--width", "512", "--depth", "4"] if args.quick else ["--width", "2048", "--depth", "12"]
    )
    names = QUICK if args.quick else tuple(CASES)
    results: dict[str, Any] = {}
    for name in names:
        ranks, options = CASES[name]
        with tempfile.TemporaryDirectory() as folder:
            results[name] = _case(ranks, options, size, Path(folder))
    common.report(
        {
            "benchmark": "memory_plan",
            "model": " ".join(size),
            "results": results,
            "targets_met": {
                f"{name}: the plan within 15% of the measured peak": (
                    abs(r["plan_over_peak"] - 1) <= 0.15
                )
                for name, r in results.items()
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
