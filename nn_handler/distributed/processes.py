"""Run one task in N fresh Python processes and bring back every result, or every failure.

The runner is what ``launch`` and ``ParallelExecutor`` share. Children are started with
``python -m nn_handler.distributed._worker`` (never by re-importing the parent's ``__main__``),
so functions from scripts without a ``__main__`` guard, notebooks, lambdas and closures all work:
the task travels with cloudpickle and the parent's ``sys.path``.

Failure handling, the reason this exists:
- a worker that raises or dies (signal, ``os._exit``) is noticed within ~50 ms; the others get
  ``grace`` seconds to finish on their own, then are killed;
- past ``deadline`` every live worker dumps its stacks (SIGUSR1 + faulthandler) and is killed;
- the parent raises ``WorkerFailedError`` (or the subclass given) with each failed worker's
  traceback, or ``WorkerTimeoutError`` naming the workers still running with their stacks.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import cloudpickle

from nn_handler.errors import (
    DistributedError,
    RankFailedError,
    WorkerFailedError,
    WorkerTimeoutError,
)

#: Set in every worker to its position (0..count-1): the rank, or the index of its device.
WORKER_INDEX_VARIABLE = "NN_HANDLER_WORKER_INDEX"
#: Seconds the other workers get to finish on their own after one failed.
DEFAULT_GRACE_S = 2.0
_POLL_S = 0.05


@dataclass
class WorkerOutcome:
    """What one worker left behind."""

    index: int
    exitcode: int | None
    result_path: Path
    error_text: str | None = None
    exception: BaseException | None = None
    stacks: str = ""
    killed: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def succeeded(self) -> bool:
        return self.exitcode == 0 and self.result_path.exists()

    def describe_failure(self) -> str:
        if self.error_text:
            return self.error_text
        if self.exitcode is not None and self.exitcode < 0:
            try:
                name = signal.Signals(-self.exitcode).name
            except ValueError:
                name = f"signal {-self.exitcode}"
            return f"the process was killed by {name} (exit code {self.exitcode}) without raising"
        return f"the process exited with code {self.exitcode} without returning a result"


def _read_outcome(
    workdir: Path, index: int, proc: subprocess.Popen[bytes], killed: bool
) -> WorkerOutcome:
    outcome = WorkerOutcome(index, proc.returncode, workdir / f"{index}.result", killed=killed)
    error = workdir / f"{index}.error"
    if error.exists():
        outcome.error_text = error.read_text()
    exception = workdir / f"{index}.exception"
    if exception.exists():
        try:
            outcome.exception = cloudpickle.loads(exception.read_bytes())
        except Exception:
            outcome.exception = None
    stacks = workdir / f"{index}.stacks"
    if stacks.exists():
        outcome.stacks = stacks.read_text()
    return outcome


def run_in_processes(
    task: Callable[[int], Any],
    count: int,
    *,
    what: str,
    unit: str = "rank",
    env: Callable[[int, Path], Mapping[str, str]] | None = None,
    deadline: float | None = None,
    grace: float = DEFAULT_GRACE_S,
) -> list[Any]:
    """Call ``task(i)`` in ``count`` new processes; return the results in index order.

    ``env(i, workdir)`` gives extra environment variables for worker ``i`` (``workdir`` is a
    private temporary folder that lives for the run, e.g. for a FileStore). Raises
    ``RankFailedError`` (``unit='rank'``) or ``WorkerFailedError`` when a worker raises
    or dies, chaining the first failure's exception when it could be pickled, and
    ``WorkerTimeoutError`` when ``deadline`` seconds pass first.
    """
    envelope = {"sys_path": list(sys.path), "task": cloudpickle.dumps(task)}
    with tempfile.TemporaryDirectory(prefix="nn-handler-") as tmp:
        workdir = Path(tmp)
        (workdir / "payload").write_bytes(pickle.dumps(envelope))
        procs: list[subprocess.Popen[bytes]] = []
        try:
            for index in range(count):
                child_env = {
                    **os.environ,
                    WORKER_INDEX_VARIABLE: str(index),
                    **(env(index, workdir) if env else {}),
                }
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "nn_handler.distributed._worker", tmp, str(index)],
                        env=child_env,
                    )
                )
            killed, timed_out, first = _wait(procs, deadline, grace)
            outcomes = [
                _read_outcome(workdir, i, proc, i in killed) for i, proc in enumerate(procs)
            ]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        if timed_out:
            running = [o.index for o in outcomes if o.killed]
            raise WorkerTimeoutError(what, running, {o.index: o.stacks for o in outcomes}, unit)
        failed = [o for o in outcomes if not o.succeeded and not o.killed]
        if failed:
            root = next((o for o in failed if o.index == first), failed[0])
            note = f"The first to fail was {unit} {root.index}."
            survivors = [o.index for o in outcomes if o.killed]
            if survivors:
                note += f" {unit}(s) {survivors} were terminated after the failure."
            messages = {o.index: o.describe_failure() for o in failed}
            error = (
                RankFailedError(what, messages, note=note)
                if unit == "rank"
                else WorkerFailedError(what, messages, unit=unit, note=note)
            )
            raise error from root.exception
        return [_load_result(o, what, unit) for o in outcomes]


def _load_result(outcome: WorkerOutcome, what: str, unit: str) -> Any:
    try:
        return cloudpickle.loads(outcome.result_path.read_bytes())
    except Exception as error:
        raise DistributedError(
            f"{what}: {unit} {outcome.index} returned a value this process cannot unpickle "
            f"({type(error).__name__}: {error}); return plain types, tensors or arrays."
        ) from error


def _wait(
    procs: list[subprocess.Popen[bytes]], deadline: float | None, grace: float
) -> tuple[set[int], bool, int | None]:
    """Wait for every process; kill survivors after a failure (+grace) or at the deadline.

    Returns the indices killed here, whether the deadline was the reason, and the index of the
    first process seen failing (None if none failed).
    """
    end = None if deadline is None else time.monotonic() + deadline
    first_failure: float | None = None
    first: int | None = None
    while True:
        codes = [proc.poll() for proc in procs]
        now = time.monotonic()
        if first is None:
            first = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
            first_failure = now if first is not None else None
        if all(code is not None for code in codes):
            return set(), False, first
        if first_failure is not None and now - first_failure > grace:
            return _kill_live(procs, dump_stacks=True), False, first
        if end is not None and now > end:
            return _kill_live(procs, dump_stacks=True), True, first
        time.sleep(_POLL_S)


def _kill_live(procs: list[subprocess.Popen[bytes]], dump_stacks: bool) -> set[int]:
    live = {i for i, proc in enumerate(procs) if proc.poll() is None}
    if dump_stacks and hasattr(signal, "SIGUSR1"):
        for i in live:
            with contextlib.suppress(ProcessLookupError):
                procs[i].send_signal(signal.SIGUSR1)
        time.sleep(0.3)
    for i in live:
        procs[i].kill()
    for i in live:
        procs[i].wait()
    return live


__all__ = ["DEFAULT_GRACE_S", "WORKER_INDEX_VARIABLE", "WorkerOutcome", "run_in_processes"]
