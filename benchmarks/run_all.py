"""Run every benchmark, then write the report: what `make bench` calls.

    python benchmarks/run_all.py [--quick] [--results DIR] [--report PATH]

Each benchmark runs as its own process (one thread per process: OMP_NUM_THREADS=1) and writes
DIR/<name>.json; report.py then renders them into PATH. ``--quick`` is the smoke mode the
tests use (about a minute in all); the full mode takes about 10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import report

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smoke mode: every script, briefly")
    parser.add_argument("--results", type=Path, default=HERE / "results")
    parser.add_argument("--report", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument("--only", nargs="*", choices=report.ORDER, help="a subset to run")
    args = parser.parse_args()
    args.results.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the child processes' own environment
    started = time.perf_counter()
    for name in args.only or report.ORDER:
        script = os.path.relpath(HERE / f"{name}.py")  # recorded as run from the repo root
        out = os.path.relpath(args.results / f"{name}.json")
        command = [sys.executable, script, "--out", out]
        if args.quick:
            command.append("--quick")
        start = time.perf_counter()
        print(f"== {name}", flush=True)
        completed = subprocess.run(command, env=env, stdout=subprocess.DEVNULL, check=False)
        if completed.returncode:
            raise SystemExit(f"{name}.py failed with exit code {completed.returncode}")
        print(f"   {time.perf_counter() - start:.0f} s", flush=True)
    mode = "make bench" + (" (quick)" if args.quick else "")
    page = report.render(report.load(args.results), mode, report.shown(args.results))
    args.report.write_text(page)
    print(f"wrote {args.report} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
