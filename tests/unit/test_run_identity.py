"""Checkpoints belong to a run (the fault campaign's item 9), with real processes launched
by hand on one folder (tests/scripts/shared_folder.py): a second experiment started on the
first's checkpoint folder deletes and replaces none of its checkpoints; the first, relaunched
with resume: auto, refuses the second's state naming the differing field, unless resume:
force; a folder held by a live job is refused at start naming the holder, and a dead
holder's lock is taken over. The pure parts (fingerprints) are tested at the end."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nn_handler.checkpoint.io import load_file
from nn_handler.checkpoint.run_identity import differences, fingerprint, run_of
from nn_handler.checkpoint.store.lease import LOCK
from tests.forked import Script, run_script_split

SCRIPT = Path(__file__).parents[1] / "scripts" / "shared_folder.py"


def _command(run: Path, lr: float, resume: str, epochs: int, *hold: str) -> list[str]:
    return [sys.executable, str(SCRIPT), str(run), str(lr), resume, str(epochs), *hold]


def _launch(run: Path, lr: float, resume: str, epochs: int) -> subprocess.CompletedProcess[str]:
    """``python shared_folder.py ...`` (forked from the preloaded forkserver: tests/forked.py)."""
    command = _command(run, lr, resume, epochs)
    script = Script(SCRIPT, command[2:])
    code, out, err = run_script_split(script, timeout=180, env={"OMP_NUM_THREADS": "1"})
    return subprocess.CompletedProcess(command, code, out, err)


def _owners(folder: Path) -> dict[str, str | None]:
    return {p.name: run_of(load_file(p))[0] for p in sorted(folder.glob("ckpt-*.pt"))}


def test_two_runs_in_one_folder_keep_their_checkpoints_and_their_state(tmp_path: Path) -> None:
    first = _launch(tmp_path, 0.1, "never", 3)  # 5 steps an epoch; keeps s10 and s15
    assert first.returncode == 0, first.stdout + first.stderr
    folder = tmp_path / "ckpt"
    owners = _owners(folder)
    assert sorted(owners) == ["ckpt-e0002-s00000010.pt", "ckpt-e0003-s00000015.pt"]
    (a,) = set(owners.values())
    second = _launch(tmp_path, 0.01, "never", 2)  # another experiment, by mistake
    assert second.returncode == 0, second.stdout + second.stderr
    owners = _owners(folder)
    mine = {name for name, run in owners.items() if run == a}
    assert mine == {"ckpt-e0002-s00000010.pt", "ckpt-e0003-s00000015.pt"}, owners  # all kept
    (b,) = set(owners.values()) - {a}
    theirs = sorted(name for name, run in owners.items() if run == b)
    assert theirs == ["ckpt-e0001-s00000005.pt", f"ckpt-e0002-s00000010-r{b}.pt"], owners
    latest = json.loads((folder / "latest.json").read_text())["checkpoint"]
    assert latest == f"ckpt-e0002-s00000010-r{b}.pt"
    # The first experiment, relaunched to continue: the latest is the second's.
    refused = _launch(tmp_path, 0.1, "auto", 4)
    assert refused.returncode == 1
    assert "ERROR: CheckpointError:" in refused.stdout, refused.stdout + refused.stderr
    assert "lr: 0.01 in the checkpoint, 0.1 in this run" in refused.stdout
    assert "checkpoint.resume='force'" in refused.stdout
    forced = _launch(tmp_path, 0.1, "force", 3)
    assert forced.returncode == 0, forced.stdout + forced.stderr
    assert "trained to epoch 3" in forced.stdout
    assert "written by another run configuration (lr: 0.01" in forced.stderr


def test_a_live_job_holds_its_folder_and_a_dead_ones_lock_is_taken_over(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    holder = subprocess.Popen(
        _command(tmp_path, 0.1, "never", 2, "60"), stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
        refused = _launch(tmp_path, 0.1, "auto", 2)
        assert refused.returncode == 1
        host = socket.gethostname()
        assert (
            f"is in use by another live job: a job (pid {holder.pid} on {host}" in refused.stdout
        ), refused.stdout + refused.stderr
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    assert json.loads((tmp_path / "ckpt" / LOCK).read_text())["pid"] == holder.pid  # left over
    after = _launch(tmp_path, 0.1, "auto", 2)  # the holder is gone: its lock is stale
    assert after.returncode == 0, after.stdout + after.stderr
    assert f"taking over the lock of a job (pid {holder.pid} on" in after.stderr
    assert "its process is gone" in after.stderr
    assert not (tmp_path / "ckpt" / LOCK).exists()  # released when the handler closed


def test_a_fingerprint_keeps_what_defines_a_run_and_names_its_differences() -> None:
    saved = fingerprint({"lr": 0.1, "optimizer": "SGD", "loader.seed": 1, "trainer.epochs": 3})
    assert saved == {"optimizer": "SGD", "lr": 0.1, "loader.seed": 1}  # epochs may change
    current = fingerprint({"lr": 0.1, "optimizer": "Adam", "loader.seed": 2})
    assert differences(saved, current) == [
        "optimizer: 'SGD' in the checkpoint, 'Adam' in this run",
        "loader.seed: 1 in the checkpoint, 2 in this run",
    ]
    assert differences(saved, {"lr": 0.1}) == []  # fields one side lacks are not compared
    assert run_of({"format": "x"}) == (None, {})  # written before runs had identities


@pytest.mark.parametrize("job", ["SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"])
def test_a_live_process_on_this_host_holds_the_folder_even_with_this_jobs_id(
    tmp_path: Path, job: str
) -> None:
    """Two srun steps of one allocation (one SLURM_JOB_ID) or a reused --rdzv-id: the second
    was taken for a restart of the first, deleted its temporary files and trained into its
    folder. A live pid on this host is never a restart; a dead one's lock is taken over."""
    from nn_handler.checkpoint.store.lease import FileLock, Lease
    from nn_handler.errors import CheckpointError

    env = {job: "4242"}
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        holder = {"host": socket.gethostname(), "pid": live.pid, "job": f"{job}=4242",
                  "time": 0.0}  # fmt: skip
        (tmp_path / LOCK).write_text(json.dumps(holder))
        with pytest.raises(CheckpointError, match=rf"in use by another live job: {job}=4242"):
            Lease(FileLock(tmp_path), str(tmp_path)).acquire(env)
    finally:
        live.kill()
        live.wait(timeout=30)
    lease = Lease(FileLock(tmp_path), str(tmp_path))
    lease.acquire(env)  # its process is gone: a restart takes it over
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    lease.release()
    assert not (tmp_path / LOCK).exists()
