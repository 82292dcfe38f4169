"""Per-step fault tolerance (trainer.fault_tolerance) against torchrun's restart from the
latest checkpoint: the committed steps per minute of one job under one kill schedule.

    python benchmarks/fault_tolerance.py [--quick] [--out results.json]

The job (benchmarks/ft_job.py): an MLP in the reproducible mode, 3 workers, 600 optimizer
steps (a micro-batch's compute a 30 ms sleep, so that 3 workers on 2 cores do not measure the
cores' sharing), a periodic checkpoint every 20 steps, launched two ways:

- fault tolerant: ``nn-handler supervise --members 3`` (a Lighthouse, 3 members; a member
  killed is restarted alone and joins the run, the others go on);
- torchrun restart: ``torchrun --nproc-per-node 3 --max-restarts 50`` with
  ``checkpoint.resume: on_restart`` (a worker killed stops them all; all restart and load the
  latest checkpoint, and the steps since are done again).

Kill schedules: none, one kill every 20 s and one every 5 s (the issue's one a minute and one
every 15 s, scaled to this machine's one-minute job): SIGKILL of a random live worker, seeded,
the first one period after the 3 workers are up. The number: ``steps * 60 / wall``, the wall
time from the launch to the job's end, its last step committed (the first worker done; every
worker's start included, as a restart pays it).

``--quick``: 20 steps, 2 workers, no kill (a smoke test of both launches; the kills' paths are
tested in tests/distributed/: test_step_fault_tolerance.py, test_fault_tolerance.py).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common

HERE = Path(__file__).resolve().parent
JOB = HERE / "ft_job.py"
WORKERS = 3


def _launch(mode: str, run: Path, steps: int, workers: int) -> subprocess.Popen[bytes]:
    job = [sys.executable, str(JOB), str(run), str(steps)]
    if mode == "fault_tolerant":
        command = [sys.executable, "-m", "nn_handler.cli", "supervise", "--members",
                   str(workers), "--max-restarts", "50", "--join-timeout-s", "10", "--", *job,
                   "{lighthouse}", "{member}"]  # fmt: skip
    else:
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        command = [torchrun, "--standalone", "--nproc-per-node", str(workers),
                   "--max-restarts", "50", *job[1:]]  # fmt: skip
    path = [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "error", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join(path)}  # fmt: skip
    with open(run / "launcher.log", "wb") as log:  # the launcher's and the workers' output
        return subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _live(run: Path) -> list[int]:
    """The workers up now (their pid files, whose process is alive)."""
    pids = []
    for marker in (run / "pids").glob("*-*") if (run / "pids").exists() else []:
        pid = int(marker.name.rsplit("-", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        pids.append(pid)
    return sorted(pids)


def measure(
    mode: str,
    steps: int,
    period: float | None,
    seed: int,
    most: int = 1_000,
    workers: int = WORKERS,
) -> dict[str, Any]:
    """One run of the job under ``mode`` with a kill every ``period`` s (None: none), at most
    ``most`` kills."""
    rng = random.Random(seed)
    run = Path(tempfile.mkdtemp(prefix=f"ft-bench-{mode}-"))
    started = time.monotonic()
    launcher = _launch(mode, run, steps, workers)
    up, kills, end = None, 0, None
    try:
        while end is None and launcher.poll() is None:
            time.sleep(0.05)
            if any(run.glob("done-*")):  # the job's last step is committed
                end = time.monotonic()
                break
            if time.monotonic() - started > 900:
                raise RuntimeError(f"{mode}: the job did not end in 900 s ({run})")
            if up is None and len(_live(run)) >= workers:
                up = time.monotonic()
            if up is None or period is None or time.monotonic() < up + period * (kills + 1):
                continue
            if kills >= most:
                continue
            live = _live(run)
            if live:
                os.kill(rng.choice(live), signal.SIGKILL)
                kills += 1
        code = launcher.wait(timeout=120)  # the others end their last step too
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
    done = {p.name: int(p.read_text()) for p in run.glob("done-*")}
    if end is None or code != 0 or set(done.values()) != {steps}:
        raise RuntimeError(f"{mode}: exit {code}, done {done} ({run}/launcher.log)")
    wall = end - started
    return {"wall_s": wall, "steps_per_minute": steps * 60 / wall, "kills": kills}


def main() -> None:
    args = common.parse_args(__doc__ or "")
    steps, workers = (20, 2) if args.quick else (600, WORKERS)
    schedules: dict[str, tuple[float | None, int]] = (
        {"no kill": (None, 0)}
        if args.quick
        else {
            "no kill": (None, 0),
            "a kill every 20 s": (20.0, 1_000),
            "a kill every 5 s": (5.0, 1_000),
        }
    )
    results: dict[str, dict[str, Any]] = {}
    for n, (name, (period, most)) in enumerate(schedules.items()):
        results[name] = {
            mode: measure(mode, steps, period, seed=51 + n, most=most, workers=workers)
            for mode in ("fault_tolerant", "torchrun_restart")
        }
    worst = results[list(schedules)[-1]]
    target = (
        f"fault tolerance commits more steps per minute than torchrun's restart "
        f"({list(schedules)[-1]})"
    )
    common.report(
        {
            "benchmark": "fault_tolerance",
            "steps": steps,
            "workers": workers,
            "micro_batch_s": 0.03,
            "checkpoint_every": 20,
            "results": results,
            "targets_met": {
                target: worst["fault_tolerant"]["steps_per_minute"]
                > worst["torchrun_restart"]["steps_per_minute"]
            },
        },
        args.out,
    )


if __name__ == "__main__":
    main()
