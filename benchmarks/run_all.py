"""Run every benchmark, then write the report: what `make bench` calls.

    python benchmarks/run_all.py [--quick] [--jobs N] [--results DIR] [--report PATH]

Each benchmark runs as its own process (one thread per process: OMP_NUM_THREADS=1) and writes
DIR/<name>.json; report.py then renders them into PATH. ``--quick`` is the smoke mode the
tests use (about a minute in all, 40 s with ``--jobs 2``, which runs two scripts at once: only
for smoke runs, whose numbers mean nothing); the full mode takes 10-15 minutes on 2 cores.
In the smoke mode each script's process forks from one server that imported torch and
nn_handler once (as the scripts' own ranks do then: common.py), instead of spending 2 s of CPU
on those imports in a fresh interpreter each; a measurement always starts fresh ones.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import runpy
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Union

import report

HERE = Path(__file__).parent

#: What the smoke mode's server imports once for every script (``torch._dynamo``: a torch
#: optimizer's first step imports it, about 1.1 s of CPU).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "numpy", "nn_handler"]


#: A started script: a fresh interpreter, or a process forked from the smoke mode's server.
Running = Union["subprocess.Popen[bytes]", mp.process.BaseProcess]


def _as_main(command: list[str], env: dict[str, str]) -> None:
    """In a process forked from the smoke mode's server: run ``python script args`` as the
    interpreter would (argv, __main__, the script's folder first on sys.path, stdout
    discarded), then leave with its exit status."""
    os.environ.clear()
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    script = command[1]
    sys.argv = command[1:]
    sys.path.insert(0, str(Path(script).resolve().parent))
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _start(command: list[str], env: dict[str, str], forked: bool) -> Running:
    if not forked:
        return subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    child = ctx.Process(target=_as_main, args=(command, env))
    child.start()
    return child


def _wait(running: Running) -> int:
    """The script's exit status (negative: the signal that killed it)."""
    if isinstance(running, subprocess.Popen):
        return running.wait()
    running.join()
    return running.exitcode or 0


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
    running: list[tuple[str, Running, float]] = []
    while pending or running:
        while pending and len(running) < args.jobs:
            name = pending.pop(0)
            script = os.path.relpath(HERE / f"{name}.py")  # recorded as run from the repo root
            out = os.path.relpath(args.results / f"{name}.json")
            command = [sys.executable, script, "--out", out] + (["--quick"] if args.quick else [])
            print(f"== {name}", flush=True)
            running.append((name, _start(command, env, args.quick), time.perf_counter()))
        name, process, start = running.pop(0)
        code = _wait(process)
        if code:
            for _, other, _ in running:
                other.kill()
            raise SystemExit(f"{name}.py failed with exit code {code}")
        print(f"   {name}: {time.perf_counter() - start:.0f} s", flush=True)
    mode = "make bench" + (" (quick)" if args.quick else "")
    page = report.render(report.load(args.results), mode, report.shown(args.results))
    args.report.write_text(page)
    print(f"wrote {args.report} in {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
