"""Trackers after a kill (the fault campaign's item 7), with real processes SIGKILLed by
tests/scripts/tracked_kill.py and relaunched with resume: auto: every step and every epoch
record is in the CSV, MLflow and TensorBoard exactly once, although the killed job logged epoch
2's record just before it died and the relaunch does that epoch's end again; a run killed
before its first checkpoint is marked KILLED in MLflow when the next run starts."""

from __future__ import annotations

import csv
import importlib.util
import signal
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.forked import Script, run_script_split

# Looked up, not imported: importorskip would import MLflow (1.5 s of CPU) in every worker
# that collects the suite; the scripts and the checks below import it where it is used.
for _package in ("mlflow", "tensorboard"):
    if importlib.util.find_spec(_package) is None:
        pytest.skip(f"{_package} is not installed", allow_module_level=True)

SCRIPT = Path(__file__).parents[1] / "scripts" / "tracked_kill.py"
STEPS = list(range(1, 16))  # 3 epochs of 5 steps, every step logged


def _launch(run: Path, when: str) -> subprocess.CompletedProcess[str]:
    """``python tracked_kill.py RUN WHEN`` (forked from the preloaded forkserver:
    tests/forked.py)."""
    script = Script(SCRIPT, (str(run), when))
    code, out, err = run_script_split(script, timeout=240, env={"OMP_NUM_THREADS": "1"})
    return subprocess.CompletedProcess(["python", str(SCRIPT), str(run), when], code, out, err)


def _client(run: Path) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=f"sqlite:///{run / 'logs' / 'mlflow.db'}")


def _runs(run: Path) -> list[Any]:
    client = _client(run)
    experiment = client.get_experiment_by_name("killed")
    return list(client.search_runs([experiment.experiment_id]))


def _tensorboard(run: Path, tag: str) -> list[int]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    steps: list[int] = []
    for folder in {p.parent for p in (run / "logs").rglob("events.out.tfevents.*")}:
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        if tag in events.Tags()["scalars"]:
            steps += [e.step for e in events.Scalars(tag)]
    return sorted(steps)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("resumed")
    killed = _launch(run, "epoch-record")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    done = _launch(run, "none")
    assert done.returncode == 0, done.stderr
    assert "resumed from" in done.stderr and "s00000010" in done.stderr, done.stderr
    return run


def test_the_csv_holds_every_step_and_epoch_once(resumed: Path) -> None:
    (metrics,) = list((resumed / "logs").rglob("metrics.csv"))
    with metrics.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    steps = [int(r["step"]) for r in rows if r.get("train_loss_step")]
    epochs = [int(float(r["epoch"])) for r in rows if r.get("epoch")]
    assert steps == STEPS and epochs == [1, 2, 3], (steps, epochs)


def test_mlflow_holds_every_step_and_epoch_once(resumed: Path) -> None:
    (only,) = _runs(resumed)  # the relaunch continued the killed job's run
    client = _client(resumed)
    steps = [m.step for m in client.get_metric_history(only.info.run_id, "train_loss_step")]
    epochs = [m.step for m in client.get_metric_history(only.info.run_id, "train_loss")]
    assert sorted(steps) == STEPS, Counter(steps)
    assert sorted(epochs) == [5, 10, 15], epochs
    assert only.info.status == "FINISHED"


def test_tensorboard_holds_every_step_and_epoch_once(resumed: Path) -> None:
    assert _tensorboard(resumed, "train_loss_step") == STEPS
    assert _tensorboard(resumed, "train_loss") == [5, 10, 15]


def test_a_run_killed_before_its_first_checkpoint_is_marked_killed(tmp_path: Path) -> None:
    killed = _launch(tmp_path, "before-checkpoint")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    (orphan,) = _runs(tmp_path)
    assert orphan.info.status == "RUNNING"  # what MLflow shows until someone ends it
    done = _launch(tmp_path, "none")  # no checkpoint: a new run, which ends the orphan
    assert done.returncode == 0, done.stderr
    statuses = {r.info.run_id: r.info.status for r in _runs(tmp_path)}
    assert statuses.pop(orphan.info.run_id) == "KILLED"
    assert list(statuses.values()) == ["FINISHED"]
    assert "was still RUNNING, but its process" in done.stderr
