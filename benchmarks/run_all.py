"""Run every benchmark, then write the report: what `make bench` calls.

    python benchmarks/run_all.py [--quick] [--jobs N] [--results DIR] [--report PATH]

Each benchmark runs as its own process (one thread per process: OMP_NUM_THREADS=1) and writes
DIR/<name>.json; report.py then renders them into PATH. ``--quick`` is the smoke mode the
tests use (about a minute in all, 40 s with ``--jobs 2``, which runs two scripts at once: only
for smoke runs, whose numbers mean nothing); the full mode takes 10-15 minutes on 2 cores.
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
    parser.add_argument("--jobs", type=int, default=1, help="scripts at once (smoke runs only)")
    args = parser.parse_args()
    if args.jobs > 1 and not args.quick:
        parser.error("--jobs > 1 runs scripts side by side, which skews timings: --quick only")
    args.results.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the child processes' own environment
    started = time.perf_counter()
    pending = list(args.only or report.ORDER)
    running: list[tuple[str, subprocess.Popen[bytes], float]] = []
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            script = os.path.relpath(HERE / f"{name}.py")  # recorded as run from the repo root
            out = os.path.relpath(args.results / f"{name}.json")
            command = [sys.executable, script, "--out", out] + (["--quick"] if args.quick else [])
            print(f"== {name}", flush=True)
            process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
            running.append((name, process, time.perf_counter()))
        name, process, start = running.pop(0)
        if process.wait():
            for _, other, _ in running:
                other.kill()
            raise SystemExit(f"{name}.py failed with exit code {process.returncode}")
        print(f"   {name}: {time.perf_counter() - start:.0f} s", flush=True)
    mode = "make bench" + (" (quick)" if args.quick else "")
    page = report.render(report.load(args.results), mode, report.shown(args.results))
    args.report.write_text(page)
    print(f"wrote {args.report} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
