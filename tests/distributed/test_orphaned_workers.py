"""``kill -9`` of torchrun's agent: its workers stop within seconds with one clear error and
write no checkpoint after it, instead of training on as orphans (and writing into the folder
a relaunched job takes over)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.harness import torchrun_command

SCRIPT = Path(__file__).parents[1] / "scripts" / "orphaned_worker.py"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
#: How long the workers may take to notice and stop (the training thread looks before each
#: collective, the watchdog every 2 s here; the bound is for a loaded machine, the usual time
#: is well under a second).
STOP_WITHIN_S = 20.0


def _alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's exit is reaped by whoever adopted it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state != "Z"


def _wait_for(condition: object, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


@pytest.mark.distributed
def test_killing_the_agent_stops_its_workers_with_nothing_written_after(tmp_path: Path) -> None:
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    command = torchrun_command(SCRIPT, str(out), str(ckpt))
    with (tmp_path / "job.txt").open("w") as log:
        job = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True
        )
    pids: list[int] = []
    try:
        markers = [out / f"rank{rank}.json" for rank in (0, 1)]
        started = _wait_for(lambda: all(m.exists() for m in markers), 120)
        assert started, (tmp_path / "job.txt").read_text()
        pids = [json.loads(m.read_text())["pid"] for m in markers]
        assert _wait_for(lambda: len(list(ckpt.glob("ckpt-*"))) >= 2, 60), "no checkpoints yet"
        job.send_signal(signal.SIGKILL)  # the agent alone, as `kill -9 <torchrun pid>`
        job.wait(10)
        killed_at = time.time()
        stopped = _wait_for(lambda: not any(_alive(pid) for pid in pids), STOP_WITHIN_S)
        output = (tmp_path / "job.txt").read_text()
        assert stopped, f"workers {pids} still train {STOP_WITHIN_S} s after the kill\n{output}"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    for rank in (0, 1):
        error = (out / f"rank{rank}-error.txt").read_text()
        assert "LauncherGoneError" in error and "the launcher that started this worker" in error
        assert error.count("Traceback") == 1, error  # one clear error, no chain behind it
    # The training thread checks its parent before every collective: the batch in flight at
    # the kill may end, no later one (it trained ~6 more, one more checkpoint, when only the
    # watchdog's thread looked, held up by the agent's dead store).
    for rank in (0, 1):
        ends = (out / f"rank{rank}-steps.txt").read_text().split()[1::2]
        after = [float(t) for t in ends if float(t) > killed_at]
        assert len(after) <= 1, (rank, len(after))
    # A save in flight when the agent died may finish (within a step); nothing starts later.
    newest = max(p.stat().st_mtime for p in ckpt.glob("ckpt-*"))
    assert newest <= killed_at + 1.0, (newest - killed_at, sorted(p.name for p in ckpt.iterdir()))
