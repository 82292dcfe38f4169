"""Surviving faults under the real torchrun: an elastic restart after a real SIGKILL, and a
real SIGTERM preemption followed by a relaunch. Both must end bit-identical to an
uninterrupted run (tests/scripts/torchrun_fault.py is the training script)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from nn_handler import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from nn_handler.checkpoint import load_file
from tests.forked import Script, run_scripts
from tests.harness import free_port, run_command, torchrun_command
from tests.interpreters import python_path

pytestmark = pytest.mark.distributed

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "torchrun_fault.py"
ROOT = SCRIPT.parents[2]
ENV = {"PYTHONPATH": python_path(ROOT)}
KILL_AFTER_STEP = 7
EVERY_N_STEPS = 3
TOTAL_STEPS = 24  # 64 samples, batch 4 on 2 ranks, 3 epochs


def _command(tmp: Path, name: str, mode: str, *extra: str, variant: str = "") -> list[str]:
    ckpt, out = tmp / name / "ckpt", tmp / name / "out"
    out.mkdir(parents=True, exist_ok=True)
    command = torchrun_command(SCRIPT, str(ckpt), str(out), mode, *([variant] if variant else []))
    command[3:3] = list(extra)  # torchrun options go before the script
    return command


def _run(
    tmp: Path, name: str, mode: str, *extra: str, timeout: float = 120, variant: str = ""
) -> tuple[int, str]:
    return run_command(_command(tmp, name, mode, *extra, variant=variant), timeout=timeout, env=ENV)


def _uninterrupted(tmp: Path, name: str, variant: str = "") -> Path:
    """The reference: the 'plain' run of both ranks, started by hand with torchrun's variables
    (forked from the preloaded forkserver: tests/forked.py; an uninterrupted run needs no
    agent, and its weights must not depend on one). Its output folder."""
    ckpt, out = tmp / name / "ckpt", tmp / name / "out"
    out.mkdir(parents=True)
    port = str(free_port())
    args = (str(ckpt), str(out), "plain", *([variant] if variant else []))
    scripts = [
        Script(
            SCRIPT,
            args,
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for rank in (0, 1)
    ]
    for code, output in run_scripts(scripts, timeout=120, env=ENV):
        assert code == 0, output
    return out


def _weights(out: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(out / f"rank{rank}.pt", weights_only=True)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    out = _uninterrupted(tmp_path_factory.mktemp("plain"), "plain")
    return [_weights(out, rank) for rank in (0, 1)]


def test_elastic_restart_after_sigkill_resumes_from_the_latest_checkpoint(
    tmp_path: Path, uninterrupted: list[dict[str, torch.Tensor]]
) -> None:
    code, output = _run(tmp_path, "killed", "sigkill", "--max-restarts=1")
    assert code == 0, output
    assert "(exitcode: -9) local_rank: 1" in output, output  # torchrun saw the SIGKILL
    out = tmp_path / "killed" / "out"
    for rank in (0, 1):
        report = json.loads((out / f"rank{rank}-attempt1.json").read_text())
        assert report["step"] == TOTAL_STEPS
        # Resumed from the last checkpoint before the kill: at most EVERY_N_STEPS steps redone.
        last_checkpoint = KILL_AFTER_STEP - KILL_AFTER_STEP % EVERY_N_STEPS
        assert report["first_step"] == last_checkpoint, report
        assert _same(_weights(out, rank), uninterrupted[rank])


@pytest.mark.parametrize("variant", ["gan", "multitask"])
def test_user_models_with_tracked_state_resume_bit_identical_after_sigkill(
    tmp_path: Path, variant: str
) -> None:
    """'gan': manual optimization (two optimizers) and a hook whose per-rank loss sum is
    tracked. 'multitask': examples/custom_trainer.py (two logged training losses, a
    torchmetrics F1 on its overridden validation_step, a hook with state) plus that sum. A
    SIGKILL mid-epoch on rank 1, torchrun restarts the group, and both ranks end with the
    weights, the sums, the hook state and the History of an uninterrupted run."""
    plain = _uninterrupted(tmp_path, "plain", variant)
    code, output = _run(
        tmp_path, "killed", "sigkill", "--max-restarts=1", timeout=180, variant=variant
    )
    assert code == 0, output
    assert "(exitcode: -9) local_rank: 1" in output, output
    killed = tmp_path / "killed" / "out"
    for rank in (0, 1):
        report = json.loads((killed / f"rank{rank}-attempt1.json").read_text())
        reference = json.loads((plain / f"rank{rank}-attempt0.json").read_text())
        assert report["first_step"] == KILL_AFTER_STEP - KILL_AFTER_STEP % EVERY_N_STEPS
        assert report["loss_total"] == reference["loss_total"], rank  # tracked state
        assert _same(_weights(killed, rank), _weights(plain, rank)), rank
        if variant == "multitask":
            assert report["best"] == reference["best"], rank  # the example hook's state
            assert report["history"] == reference["history"], rank
            assert {"train_classification", "train_reconstruction", "val_f1"} <= set(
                report["history"][-1]
            )


def _progress(out: Path, rank: int) -> dict[str, Any] | None:
    try:
        return dict(json.loads((out / f"progress{rank}.json").read_text()))
    except (OSError, ValueError):
        return None


def _signal_slow_run(ckpt: Path, out: Path, send: Any) -> tuple[int, str]:
    """Start the 'slow' run under torchrun, call ``send(job, progress)`` once rank 1 passed
    step 4, and return torchrun's status and output."""
    out.mkdir(parents=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", **ENV}
    job = subprocess.Popen(
        torchrun_command(SCRIPT, str(ckpt), str(out), "slow"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        progress = _progress(out, 1)
        while (progress is None or progress["step"] < 4) and time.monotonic() < deadline:
            time.sleep(0.1)
            progress = _progress(out, 1)
        assert progress is not None and progress["step"] >= 4, "the run never got going"
        send(job, progress)
        output, _ = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    return job.returncode, output


def _relaunch_ends_like_the_uninterrupted_run(
    ckpt: Path, out: Path, stopped: int, uninterrupted: list[dict[str, torch.Tensor]]
) -> None:
    code, output = run_command(
        torchrun_command(SCRIPT, str(ckpt), str(out), "slow"), timeout=120, env=ENV
    )
    assert code == 0, output
    for rank in (0, 1):
        report = json.loads((out / f"rank{rank}-attempt0.json").read_text())
        assert report["first_step"] == stopped and report["step"] == TOTAL_STEPS
        assert _same(_weights(out, rank), uninterrupted[rank])


def test_sigterm_to_one_rank_stops_both_with_a_checkpoint_and_the_relaunch_resumes(
    tmp_path: Path, uninterrupted: list[dict[str, torch.Tensor]]
) -> None:
    ckpt, out = tmp_path / "term" / "ckpt", tmp_path / "term" / "out"

    def sigterm_rank_1(job: Any, progress: dict[str, Any]) -> None:
        os.kill(progress["pid"], signal.SIGTERM)  # rank 1 only: rank 0 must follow it

    returncode, output = _signal_slow_run(ckpt, out, sigterm_rank_1)
    # What a job script sees (docs/checkpoints.md, "Exit status"): torchrun reports any
    # non-zero worker exit as a failure, status 1, so a preemption is told apart by
    # latest.json; every worker finished its own shutdown (no worker cut by SIGTERM).
    assert returncode == 1, output
    assert f"exitcode  : {PREEMPTED_EXIT_CODE}" in output, output
    assert "exitcode  : -15" not in output and "Signal 15" not in output, output
    assert json.loads((ckpt / "latest.json").read_text())["reason"] == "preempted"
    (out / "job-output.txt").write_text(output)
    reports = [json.loads((out / f"rank{r}-attempt0.json").read_text()) for r in (0, 1)]
    assert reports[0]["preempted"] == reports[1]["preempted"] == PREEMPTED_EXIT_CODE
    stopped = reports[0]["step"]
    assert reports[1]["step"] == stopped and 4 <= stopped < TOTAL_STEPS
    checkpoint = load_file(reports[0]["checkpoint"])
    assert checkpoint["trainer"]["global_step"] == stopped
    assert json.loads((ckpt / "latest.json").read_text())["global_step"] == stopped
    _relaunch_ends_like_the_uninterrupted_run(ckpt, out, stopped, uninterrupted)


def test_ctrl_c_to_torchrun_stops_every_rank_with_a_checkpoint_and_the_relaunch_resumes(
    tmp_path: Path, uninterrupted: list[dict[str, torch.Tensor]]
) -> None:
    """What a terminal does on Ctrl-C: SIGINT to torchrun's process group (torchrun forwards
    it to its workers)."""
    ckpt, out = tmp_path / "int" / "ckpt", tmp_path / "int" / "out"

    def ctrl_c(job: Any, progress: dict[str, Any]) -> None:
        os.killpg(job.pid, signal.SIGINT)

    _, output = _signal_slow_run(ckpt, out, ctrl_c)
    assert "received Ctrl-C: stopping after this step with a checkpoint" in output, output
    assert "KeyboardInterrupt" not in output, output
    reports = [json.loads((out / f"rank{r}-attempt0.json").read_text()) for r in (0, 1)]
    assert reports[0]["preempted"] == reports[1]["preempted"] == INTERRUPTED_EXIT_CODE
    stopped = reports[0]["step"]
    assert reports[1]["step"] == stopped and 4 <= stopped < TOTAL_STEPS
    latest = json.loads((ckpt / "latest.json").read_text())
    assert latest["reason"] == "interrupted" and latest["global_step"] == stopped
    _relaunch_ends_like_the_uninterrupted_run(ckpt, out, stopped, uninterrupted)


def test_three_handlers_in_a_row_under_torchrun(tmp_path: Path) -> None:
    script = SCRIPT.with_name("torchrun_handlers.py")
    code, output = run_command(torchrun_command(script, str(tmp_path)), timeout=120, env=ENV)
    assert code == 0, output
    runs = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert runs[0] == runs[1], "the ranks disagree on a handler's loss"
    assert [run["world"] for run in runs[0]] == [2, 2, 2]
    assert len({run["loss"] for run in runs[0]}) == 3  # three separate runs, each trained


def test_an_emergency_save_over_its_budget_exits_75_with_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    """The writer thread is cancelled and joined: no SIGABRT (134) from a thread left inside
    torch.save at exit, no new file, and latest.json still names the step-2 checkpoint."""
    script = SCRIPT.with_name("preempt_over_budget.py")
    ckpt = tmp_path / "ckpt"
    code, output = run_command([sys.executable, str(script), str(ckpt)], timeout=120, env=ENV)
    assert code == PREEMPTED_EXIT_CODE, output
    assert sorted(p.name for p in ckpt.iterdir()) == ["ckpt-e0000-s00000002.pt", "latest.json"]
    latest = json.loads((ckpt / "latest.json").read_text())
    assert latest["checkpoint"] == "ckpt-e0000-s00000002.pt" and latest["reason"] == "preempted"
    assert load_file(ckpt / "ckpt-e0000-s00000002.pt")["trainer"]["global_step"] == 2
    assert "did not finish within its budget" in output
