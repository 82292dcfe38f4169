"""What every benchmark script shares: its command line, the machine facts, the JSON output."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from importlib import metadata
from math import comb
from queue import Empty
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

#: How ranks start: fresh interpreters ("spawn") in a measurement; in a --quick smoke run,
#: whose numbers mean nothing, forks of one server that imported torch and the script once
#: (a rank then starts in milliseconds instead of 2 s of imports: the test suite runs them all).
_RANKS_START = {"method": "spawn"}


#: The peers' packages that the training benchmarks' ranks import (run_ranks' ``preload``).
PEER_PACKAGES = ("lightning_fabric", "accelerate")


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help="a few seconds, for smoke tests")
    parser.add_argument("--out", help="write the results as JSON to this path")
    args = parser.parse_args()
    if args.quick:
        _RANKS_START["method"] = "forkserver"
    return args


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The facts a reader needs to compare runs: versions, cores, platform, GPU if any."""
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "nn_handler": _version("nn_handler"),
        "lightning_fabric": _version("lightning-fabric"),
        "accelerate": _version("accelerate"),
        "numpy": _version("numpy"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def report(results: dict[str, Any], out: str | None) -> None:
    """Print the results (with the machine and command first) and write them to ``out``."""
    script = os.path.relpath(sys.argv[0])  # as run from the repository root: benchmarks/x.py
    command = " ".join(["python", script, *sys.argv[1:]])
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    full = {"machine": machine(), "command": command, "date": date, **results}
    print(json.dumps(full, indent=2))
    if out:
        with open(out, "w") as handle:
            json.dump(full, handle, indent=2)


def join_gloo_group(rank: int, port: int, timeout_s: float, world_size: int = 2) -> None:
    """In a benchmark worker: one thread, gloo on loopback, rank ``rank`` of ``world_size``."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # the worker's own process: benchmarks stay local
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def join_as_launcher(rank: int, port: int, world_size: int, timeout_s: float) -> None:
    """:func:`join_gloo_group`, with the launcher's variables set first: Fabric and Accelerate
    read them, and in a benchmark worker this process is the launcher."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    join_gloo_group(rank, port, timeout_s, world_size)


def run_two_ranks(worker: Callable[..., None], *args: Any, timeout: float = 300) -> Any:
    """Spawn ``worker(rank, port, *args, queue)`` on ranks 0 and 1 (a free port on 127.0.0.1
    for their gloo rendezvous); return the first result rank 0 puts on the queue."""
    return run_ranks(2, worker, *args, timeout=timeout)


def run_ranks(
    world_size: int,
    worker: Callable[..., None],
    *args: Any,
    timeout: float,
    fresh: bool = False,
    preload: Sequence[str] = (),
) -> Any:
    """:func:`run_two_ranks` for ``world_size`` new processes (1 for a clean single process):
    fresh interpreters in a measurement or when ``fresh`` (a benchmark of the start itself).
    ``preload``: what the ranks import (the peers' packages), imported once by the smoke mode's
    server instead of by every rank; a package that is not installed is skipped."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    method = "spawn" if fresh else _RANKS_START["method"]
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(
            ["__main__", "torch", "torch.distributed", "torch._dynamo", "nn_handler", *preload]
        )
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, *args, queue)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + timeout
    while True:  # a rank that dies fails the run at once, with its exit code
        try:
            result = queue.get(timeout=1)
            break
        except Empty:
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for proc in procs:
                    proc.kill()
                raise RuntimeError(f"benchmark ranks failed or timed out: {dead}") from None
    for proc in procs:
        proc.join(60)
    return result


def meets(value: float, op: str, bound: float) -> bool:
    """Whether ``value op bound`` holds, for the targets each benchmark records."""
    return value <= bound if op == "<=" else value >= bound


def median_ci(values: Sequence[float], level: float = 0.95) -> list[float]:
    """A distribution-free confidence interval for the median of ``values``: the order
    statistics x(k) and x(n+1-k) with the largest k whose binomial tail P(B <= k-1), B ~
    Binomial(n, 1/2), stays within (1 - level) / 2. With too few values for ``level`` it is
    the whole range. A bound inside this interval cannot be told apart from noise."""
    ordered, n = sorted(values), len(values)
    tail, k = 0.0, 0
    while k < n and tail + comb(n, k) / 2**n <= (1 - level) / 2:
        tail += comb(n, k) / 2**n
        k += 1
    k = max(k, 1)
    return [ordered[k - 1], ordered[n - k]]


def ratio_summary(values: Sequence[float], baseline: Sequence[float]) -> dict[str, Any]:
    """The per-repetition ratios ``values[i] / baseline[i]``: median, spread (min-max) and the
    95% confidence interval of the median."""
    ratios = [v / b for v, b in zip(values, baseline, strict=True)]
    return {
        "ratio_median": statistics.median(ratios),
        "ratio_spread": [min(ratios), max(ratios)],
        "ratio_ci95": median_ci(ratios),
    }


def svg_axes(
    width: int, height: int, left: int, bottom: int, x_label: str, y_label: str
) -> list[str]:
    """The opening of a plot as SVG (no plotting package needed): the element, its two axes
    (the x axis ``bottom`` above the foot, the y axis ``left`` from the side) and their
    labels; a caller appends its lines and ``</svg>``."""
    axis = height - bottom
    return [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        'font-family="sans-serif" font-size="12">',
        f'<line x1="{left}" y1="{axis}" x2="{width - 10}" y2="{axis}" stroke="black"/>',
        f'<line x1="{left}" y1="20" x2="{left}" y2="{axis}" stroke="black"/>',
        f'<text x="{width / 2}" y="{height - 8}" text-anchor="middle">{x_label}</text>',
        f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" '
        f'text-anchor="middle">{y_label}</text>',
    ]
