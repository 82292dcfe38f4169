"""Run a function in N real processes joined by a real gloo process group, without ever hanging.

``run_group(fn, world_size)`` spawns ``world_size`` processes; each calls
``fn(rank, world_size, *args)`` and the list of return values (by rank) comes back. Every run
is bounded by a deadline. When a rank fails, the survivors get a short grace period, then are
killed; when the deadline passes, every live rank first dumps its Python stacks (faulthandler on
SIGUSR1). Either way the test fails with each rank's exit code, traceback and stacks.

Modes:
- ``init="harness"``: the harness joins a FileStore gloo group before ``fn`` and leaves it after.
- ``init="env"``: the harness exports RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE and
  MASTER_ADDR=127.0.0.1 / MASTER_PORT=<free port> in each child, as a launcher would, and ``fn``
  initialises the group itself (through the library under test).
- ``init="none"``: nothing; ``fn`` sees only the variables given in ``env``.
Each child gets OMP_NUM_THREADS=1 and GLOO_SOCKET_IFNAME=lo (loopback only).

Ranks fork from one forkserver per test process that has already imported torch and
nn_handler (``PRELOAD``): a rank starts in milliseconds instead of the 2 s of CPU a fresh
interpreter spends importing them (65 s of the process-group tier's 670). Each rank
still starts with the caller's environment as it is at the call (as a spawned one would), and
the forkserver never runs a collective or starts a thread pool, so nothing a rank inherits is
mid-operation.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import cloudpickle

from tests.timeouts import scaled

InitMode = Literal["harness", "env", "none"]
EnvSpec = Mapping[str, str] | Callable[[int], Mapping[str, str]] | None

#: Seconds the surviving ranks get to finish on their own after one rank failed.
FAILURE_GRACE_S = 3.0

#: What the forkserver imports once, so that no rank imports it again. ``torch._dynamo``: a
#: torch optimizer's first step imports it (with sympy and inductor: about 1.1 s of CPU, torch's
#: own cost in every process that trains), so a forked rank finds it imported.
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "numpy",
    "cloudpickle",
    "loguru",
    "pydantic",
    "nn_handler",
    "tests.harness",
    "tests.frozen_preload",  # last: freezes what the others made (gc.freeze)
]

_STACKS_FILE: Any = None  # kept open for faulthandler in each child


class GroupRunError(AssertionError):
    """A rank failed, died or hung; the message holds every rank's traceback and stacks."""


def _below_ephemeral() -> tuple[int, int]:
    """The ports below the kernel's ephemeral range (Linux: 32768 by default), from 20000
    (above Ray's worker ports, 10002-19999)."""
    try:
        first = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        first = 32768
    return 20000, max(first, 20001)


#: Ports this process handed out: never handed out twice (a port is free again the moment
#: free_port returns, until the rank it is meant for binds it, seconds later).
_GIVEN: set[int] = set()


def _worker_share(low: int, high: int) -> tuple[int, int]:
    """This pytest-xdist worker's own part of [low, high) (gw0 the first of as many parts as
    there are workers): two workers never pick the same port between picking and binding it
    (the stall watchdog's scenarios once lost a rendezvous so, its rank 0 unable to listen)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    if not worker.startswith("gw") or count <= 1 or not worker[2:].isdigit():
        return low, high
    index, width = int(worker[2:]) % count, (high - low) // count
    return low + index * width, low + (index + 1) * width


def free_port(low: int | None = None, high: int | None = None) -> int:
    """A TCP port free on 127.0.0.1 now, from [low, high) (by default: this xdist worker's
    share of the ports below the kernel's ephemeral range), tried from a random place in it:
    two suites running at once must not both take the lowest; never one this process handed
    out before. Never an ephemeral port: between this call and the rank that binds it, any
    process's outgoing connection can take one of those (two suites at once: a rendezvous
    failed on a MASTER_PORT that was free a moment before)."""
    if low is None or high is None:
        low, high = _worker_share(*_below_ephemeral())
    start = random.randrange(low, high)
    for port in [*range(start, high), *range(low, start)]:
        if port in _GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            _GIVEN.add(port)
            return int(sock.getsockname()[1])
    raise RuntimeError(f"no free port in [{low}, {high})")


def _worker(
    payload: bytes,
    rank: int,
    world_size: int,
    workdir: str,
    init: InitMode,
    env: dict[str, str],
    timeout_s: float,
) -> None:
    global _STACKS_FILE
    os.environ.clear()  # the caller's environment at the call, not the forkserver's at its start
    os.environ.update(env)
    # A forkserver's child would start its own processes (DataLoader workers) through a new
    # forkserver, each worker a fresh interpreter that imports torch again (and outlives a rank
    # that dies: its watchdog watches the forkserver); a torchrun rank forks them.
    mp.set_start_method(None, force=True)
    _STACKS_FILE = open(Path(workdir, f"rank{rank}.stacks"), "w")  # noqa: SIM115
    faulthandler.register(signal.SIGUSR1, file=_STACKS_FILE, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        fn, args = cloudpickle.loads(payload)
        if init == "harness":
            dist.init_process_group(
                "gloo",
                init_method=f"file://{Path(workdir, 'store')}",
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=timeout_s),
            )
        result = fn(rank, world_size, *args)
        tmp = Path(workdir, f"rank{rank}.result.tmp")
        tmp.write_bytes(cloudpickle.dumps(result))
        os.replace(tmp, Path(workdir, f"rank{rank}.result"))
    except BaseException:
        Path(workdir, f"rank{rank}.error").write_text(traceback.format_exc())
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    finally:
        if init == "harness" and dist.is_initialized():
            gc.collect()  # DDP objects in reference cycles must die before their group does
            dist.destroy_process_group()
    # The result is recorded and the group destroyed: leave without the interpreter's
    # finalisation, in which gloo's worker threads can still hold work whose tensors need the
    # GIL, which torch 2.13 answers with SIGABRT ("terminate called without an active
    # exception", pytorch/pytorch#190489 and #179291) about once in ten 4-rank runs. Exits that
    # hang or crash in users' scripts are covered by the torchrun-launched tests.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _child_env(
    rank: int, world_size: int, init: InitMode, port: int, env: EnvSpec
) -> dict[str, str]:
    child = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    if init == "env":
        child.update(
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    if env is not None:
        child.update(env(rank) if callable(env) else env)
    return child


def _report(workdir: Path, procs: list[Any], reason: str) -> str:
    sections = [reason]
    for rank, proc in enumerate(procs):
        error = workdir / f"rank{rank}.error"
        stacks = workdir / f"rank{rank}.stacks"
        lines = [f"===== rank {rank}: exit code {proc.exitcode} ====="]
        if error.exists():
            lines.append(error.read_text().rstrip())
        if stacks.exists() and stacks.read_text().strip():
            lines.append("-- stacks at the deadline / kill --")
            lines.append(stacks.read_text().rstrip())
        sections.append("\n".join(lines))
    return "\n".join(sections)


def run_group(
    fn: Callable[..., Any],
    world_size: int = 2,
    *,
    args: tuple[Any, ...] = (),
    init: InitMode = "harness",
    env: EnvSpec = None,
    timeout: float = 60.0,
    daemon: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` real processes; results by rank.

    ``daemon=False`` lets ranks start processes of their own (DataLoader workers); the
    deadline still kills them.

    Raises :class:`GroupRunError` with every rank's traceback (and stacks for ranks that were
    still running) when a rank fails, dies, or the run passes ``timeout`` seconds.
    """
    timeout = scaled(timeout)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    payload = cloudpickle.dumps((fn, args))
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="nnh-group-") as tmp:
        workdir = Path(tmp)
        procs = [
            ctx.Process(
                target=_worker,
                args=(
                    payload,
                    rank,
                    world_size,
                    tmp,
                    init,
                    _child_env(rank, world_size, init, port, env),
                    timeout,
                ),
                daemon=daemon,
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout
        first_failure: float | None = None
        reason = ""
        while True:
            codes = [proc.exitcode for proc in procs]
            if all(code is not None for code in codes):
                if any(codes):
                    reason = "a rank failed"
                break
            now = time.monotonic()
            if any(code not in (None, 0) for code in codes):
                first_failure = first_failure or now
                if now - first_failure > FAILURE_GRACE_S:
                    reason = "a rank failed; the others did not finish and were killed"
                    break
            if now > deadline:
                reason = f"deadline of {timeout:.0f}s passed; live ranks were killed"
                break
            time.sleep(0.02)
        if reason:
            live = [proc for proc in procs if proc.exitcode is None]
            for proc in live:
                os.kill(proc.pid, signal.SIGUSR1)
            time.sleep(0.5 if live else 0)
            for proc in live:
                proc.kill()
            for proc in procs:
                proc.join(5)
            raise GroupRunError(_report(workdir, procs, f"run_group({fn.__name__}): {reason}"))
        for proc in procs:
            proc.join()
        return [
            cloudpickle.loads((workdir / f"rank{rank}.result").read_bytes())
            for rank in range(world_size)
        ]


def slurm_env(port: int, world_size: int = 2) -> Callable[[int], dict[str, str]]:
    """Per-rank SLURM variables of a one-node allocation whose master is 127.0.0.1 and whose
    job id makes nn_handler derive ``port`` (12000 + id % 20000; pick it in [12000, 32000))."""

    def for_rank(rank: int) -> dict[str, str]:
        return {
            "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank),
            "SLURM_NTASKS": str(world_size),
            "SLURM_NODEID": "0",
            "SLURM_TASKS_PER_NODE": str(world_size),
            "SLURM_JOB_NODELIST": "127.0.0.[1-2]",  # the first host is the master
            "SLURM_JOB_ID": str(port - 12000),
        }

    return for_rank


def run_commands(
    commands: list[list[str]],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> list[tuple[int, str]]:
    """Run ``commands`` concurrently, each in its own session, all bounded by ``timeout``
    seconds; returns (exit code, output) for each.

    On timeout every session (a launcher and all its workers) is killed and the test fails
    with the output so far.
    """
    import subprocess

    child_env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **(env or {})}
    procs = [
        subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=child_env,
            cwd=cwd,
            start_new_session=True,
        )
        for command in commands
    ]
    timeout = scaled(timeout)
    end = time.monotonic() + timeout
    outputs: list[str] = []
    try:
        for proc in procs:
            output, _ = proc.communicate(timeout=max(0.1, end - time.monotonic()))
            outputs.append(output)
    except subprocess.TimeoutExpired:
        for proc in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        leftovers = [proc.communicate()[0] for proc in procs[len(outputs) :]]
        raise GroupRunError(
            f"{commands} passed {timeout:.0f}s and were killed:\n" + "\n".join(outputs + leftovers)
        ) from None
    return [(proc.returncode, output) for proc, output in zip(procs, outputs, strict=True)]


def run_command(
    command: list[str],
    *,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
) -> tuple[int, str]:
    """Run one command in its own session, bounded by ``timeout``; (exit code, output)."""
    return run_commands([command], timeout=timeout, env=env, cwd=cwd)[0]


def torchrun_command(script: str | Path, *args: str, nproc: int = 2) -> list[str]:
    """The command line of a single-machine torchrun job on 127.0.0.1 with a free port."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        "--nnodes=1",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]
