"""How long `nn-handler plan` takes for a large run, as a user runs it (by hand, about a minute).

    python benchmarks/plan_scale.py [--quick] [--out results.json]

The command of docs/planning.md: a 1.1-billion-parameter language model
(examples/plan/model.py, with one micro-batch's inputs for the activations) at 512 ranks, HSDP
8 x 64, the reproducible mode, a budget, a resume at 256 ranks; each run a fresh interpreter
pinned to one core (``taskset -c 0`` where there is one), timed from its start to its exit
(wall and CPU: the imports of torch and nn_handler included).

Target: every run under 60 s on one core (issue 75). ``--quick``: one run.
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parents[1]
COMMAND = [
    "-m", "nn_handler.cli", "plan", "examples/plan/hsdp_512.yaml", "--world", "512",
    "--nodes", "64", "--model", "examples.plan.model:language_model",
    "--device-memory", "80GiB", "--samples", "1000000", "--resume-world", "256", "--json",
]  # fmt: skip
TARGET_S = 60.0


def one_run() -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of the command in a fresh interpreter."""
    pin = ["taskset", "-c", "0"] if shutil.which("taskset") else []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    subprocess.run(
        [*pin, sys.executable, *COMMAND],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        check=True,
        stdout=subprocess.DEVNULL,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main() -> None:
    args = common.parse_args(__doc__ or "")
    runs = [one_run() for _ in range(1 if args.quick else 5)]
    walls = [wall for wall, _ in runs]
    results = {
        "what": "nn-handler plan, 1.1B parameters, 512 ranks (HSDP 8 x 64), one core",
        "runs_wall_s": [round(wall, 2) for wall in walls],
        "runs_cpu_s": [round(cpu, 2) for _, cpu in runs],
        "median_wall_s": round(statistics.median(walls), 2),
        "target_s": TARGET_S,
        "met": max(walls) < TARGET_S,
    }
    common.report(results, args.out)


if __name__ == "__main__":
    main()
