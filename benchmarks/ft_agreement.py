"""The fault-tolerant step's agreement against torchft's, failure-free, at 2 to 16 members: the
time a step takes above the same job in one process, for nn_handler's mode
(trainer.fault_tolerance over the reproducible mode) and for torchft's own Manager-based loop.

    python benchmarks/ft_agreement.py [--quick] [--out results.json]

The job (benchmarks/ft_agreement_member.py): a tiny MLP, a global batch of 64, a step whose
compute is mostly a 0.3-s sleep (so that 16 members on 2 cores measure the agreement, not the
cores' sharing). Each configuration runs STEPS steps; the number is the median of a member's
step times (the intervals between its optimizer steps, the first WARMUP left out) minus the
median of the same job alone in one process (its own baseline, same session). The plot of
overhead against members: benchmarks/results/ft_agreement.svg. Members are
processes of their own with one Lighthouse (nn_handler's, which serves torchft's quorum too).

``--quick``: 2 members, 12 steps (a smoke test of every launch; the numbers mean nothing).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import common

HERE = Path(__file__).resolve().parent
MEMBER = HERE / "ft_agreement_member.py"
KINDS = ("nn_handler", "torchft")
MEMBERS = (2, 4, 8, 16)
STEPS, WARMUP = 125, 15


def _environment() -> dict[str, str]:
    path = [str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "OMP_NUM_THREADS": "1", "RUST_LOG": "error",
            "GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": os.pathsep.join(path)}  # fmt: skip


def step_times(kind: str, members: int, steps: int, folder: Path) -> list[float]:
    """The step times of member 0 (or of the job alone, ``members`` 0), in seconds."""
    from nn_handler.training.fault_tolerance.lighthouse import Lighthouse

    folder.mkdir(parents=True)
    command = [sys.executable, str(MEMBER), kind]
    if members == 0:
        processes = [
            _start([*command, str(folder / "alone.json"), str(steps), "1"], folder, "alone")
        ]
        _wait(processes, steps)
        return _intervals(folder / "alone.json")
    minimum = members if kind == "torchft" else 1
    with Lighthouse(min_members=minimum, join_timeout_s=60.0) as lighthouse:
        processes = [
            _start(
                [
                    *command,
                    str(folder / f"m{i}.json"),
                    str(steps),
                    str(members),
                    lighthouse.address,
                    f"m{i}",
                ],
                folder,
                f"m{i}",
            )
            for i in range(members)
        ]
        _wait(processes, steps)
    return _intervals(folder / "m0.json")


def _start(command: list[str], folder: Path, name: str) -> subprocess.Popen[bytes]:
    with open(folder / f"{name}.log", "wb") as log:
        return subprocess.Popen(command, env=_environment(), stdout=log, stderr=subprocess.STDOUT)


def _wait(processes: list[subprocess.Popen[bytes]], steps: int) -> None:
    deadline = time.monotonic() + 120 + steps * 2.0
    try:
        for process in processes:
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
            if code != 0:
                raise RuntimeError(f"a member exited {code}: see {process.args}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()


def _intervals(path: Path) -> list[float]:
    ends = json.loads(path.read_text())
    warmup = min(WARMUP, len(ends) // 3)
    return [b - a for a, b in itertools.pairwise(ends)][max(0, warmup - 1) :]


def overhead_svg(rows: list[dict[str, Any]]) -> str:
    """A plot of the overhead (ms per step) against members, one line per kind (an SVG: no
    plotting package needed)."""
    width, height, left, bottom = 480, 300, 60, 40
    top = max(max(row[kind]["overhead_ms"] for kind in KINDS) for row in rows) * 1.15 or 1.0
    xs = [row["members"] for row in rows]

    def x(members: int) -> float:
        return left + (width - left - 20) * (xs.index(members) / max(1, len(xs) - 1))

    def y(ms: float) -> float:
        return height - bottom - (height - bottom - 20) * max(0.0, ms) / top

    axis = height - bottom
    parts = common.svg_axes(width, height, left, bottom, "members", "ms per step above one process")
    for members in xs:
        parts.append(
            f'<text x="{x(members)}" y="{axis + 16}" text-anchor="middle">{members}</text>'
        )
    for tick in range(5):
        ms = top * tick / 4
        parts.append(f'<text x="{left - 6}" y="{y(ms) + 4}" text-anchor="end">{ms:.0f}</text>')
    for kind, colour in zip(KINDS, ("#1f77b4", "#d62728"), strict=True):
        points = " ".join(f"{x(row['members'])},{y(row[kind]['overhead_ms'])}" for row in rows)
        parts.append(
            f'<polyline points="{points}" fill="none" stroke="{colour}" stroke-width="2"/>'
        )
        last = rows[-1]
        parts.append(f'<text x="{x(last["members"]) - 4}" y="{y(last[kind]["overhead_ms"]) - 6}" '
                     f'text-anchor="end" fill="{colour}">{kind}</text>')  # fmt: skip
    return "\n".join([*parts, "</svg>"]) + "\n"


def main() -> None:
    args = common.parse_args(__doc__ or "")
    plot = None if args.quick else HERE / "results" / "ft_agreement.svg"
    sizes, steps = ((2,), 12) if args.quick else (MEMBERS, STEPS)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ft_agreement_") as tmp:
        alone = {kind: statistics.median(step_times(kind, 0, steps, Path(tmp) / f"{kind}-1"))
                 for kind in KINDS}  # fmt: skip
        for members in sizes:
            row: dict[str, Any] = {"members": members}
            for kind in KINDS:
                times = step_times(kind, members, steps, Path(tmp) / f"{kind}-{members}")
                median = statistics.median(times)
                row[kind] = {
                    "steps_measured": len(times),
                    "step_median_s": median,
                    "step_median_ci95_s": common.median_ci(times),
                    "overhead_ms": 1000 * (median - alone[kind]),
                }
            row["at_most_torchft"] = (
                row["nn_handler"]["overhead_ms"] <= row["torchft"]["overhead_ms"]
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
    if plot:
        Path(plot).write_text(overhead_svg(rows))
    common.report(
        {
            "benchmark": "ft_agreement",
            "step_sleep_s": 0.3,
            "steps_per_run": steps,
            "warmup_steps": WARMUP,
            "alone_step_median_s": alone,
            "rows": rows,
            "target": "nn_handler's overhead <= torchft's at 4, 8 and 16 members",
            "met": all(row["at_most_torchft"] for row in rows if row["members"] >= 4),
        },
        args.out,
    )


if __name__ == "__main__":
    main()
