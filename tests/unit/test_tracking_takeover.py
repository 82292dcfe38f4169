"""One run in the trackers of a fault-tolerant run (docs/fault-tolerance.md): the members
agree on a run id, the first member of a step writes the trackers, and when it is lost the
next one takes the same tracker run over: it opens it by the run key, writes the points of the
last step it kept (which the lost member may have written already: skipped then), and goes
on; a member that stops reporting lets go of its handle, not of the run. Members here are
fake Trainers driving real trackers (CSV, MLflow on SQLite) and a recording one."""

from __future__ import annotations

import csv
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from nn_handler.tracking.base import ExperimentLogger


class Member:
    """What a tracker reads of its Trainer: one member of a fault-tolerant run."""

    def __init__(self, run_key: str | None = "run-7") -> None:
        self.run_key = run_key
        self.is_reporting_process = False
        self.automatic_optimization = True
        self.training_failed = False
        self.history = SimpleNamespace(last={})
        self.state = SimpleNamespace(
            global_step=0, epoch=0, step_synced=True, last_loss=None, last_scalars={}
        )

    def hyperparameters(self) -> dict[str, Any]:
        return {"lr": 0.1}

    def committed(self, step: int, reporting: bool) -> None:
        """Step ``step`` committed with this member first (``reporting``) or not."""
        self.state.global_step, self.is_reporting_process = step, reporting
        self.state.last_loss = torch.tensor(1.0 / step)


class Recording(ExperimentLogger):
    def __init__(self) -> None:
        super().__init__(every_n_steps=1, log_curves=False)
        self.calls: list[tuple[Any, ...]] = []

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.calls.append(("open",))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append(("point", step))

    def release(self) -> None:
        self.calls.append(("release",))

    def finish(self, status: str) -> None:
        self.calls.append(("finish", status))


def _pair(make: Any) -> tuple[tuple[Any, Member], tuple[Any, Member]]:
    members = []
    for _ in range(2):
        tracker, member = make(), Member()
        tracker.attach(member)
        members.append((tracker, member))
    return members[0], members[1]


def _step(step: int, *members: tuple[Any, Member], first: Member) -> None:
    for tracker, member in members:
        member.committed(step, member is first)
        tracker.after_step()


def test_the_first_member_reports_a_lost_one_is_taken_over_and_the_kept_step_replayed() -> None:
    (a, ma), (b, mb) = _pair(Recording)
    for tracker, member in ((a, ma), (b, mb)):
        member.is_reporting_process = member is ma
        tracker.before_train()
    _step(1, (a, ma), (b, mb), first=ma)
    mb.committed(2, False)  # step 2 committed; a is lost before it writes it
    b.after_step()
    _step(3, (b, mb), first=mb)  # b is first now: it takes the run over
    c, mc = Recording(), Member()  # a restarted: it joined, and is first again
    c.attach(mc)
    _step(4, (b, mb), (c, mc), first=mc)
    b.after_train()
    c.after_train()
    assert a.calls == [("open",), ("point", 1)]
    assert b.calls == [("open",), ("point", 2), ("point", 3), ("release",)]
    assert c.calls == [("open",), ("point", 4), ("finish", "success")]


def test_without_a_run_key_a_process_that_does_not_report_keeps_nothing() -> None:
    """Ranks of a torchrun group: rank 0 reports; the others compute no point (no host
    sync) and keep none."""
    tracker, member = Recording(), Member(run_key=None)
    tracker.attach(member)
    member.committed(1, False)
    member.state.last_loss = None  # never read
    tracker.after_step()
    tracker.after_train()
    assert tracker.calls == [] and tracker._kept == []


def _rows(path: Path) -> list[tuple[int, str]]:
    with path.open(newline="") as handle:
        return [(int(row["step"]), row["train_loss_step"]) for row in csv.DictReader(handle)]


def test_members_sharing_a_csv_folder_write_each_step_once(tmp_path: Path) -> None:
    from nn_handler.tracking.csv_logger import CSVLogger

    (a, ma), (b, mb) = _pair(lambda: CSVLogger(tmp_path, every_n_steps=1, log_curves=False))
    ma.is_reporting_process = True
    a.before_train()
    _step(1, (a, ma), (b, mb), first=ma)
    _step(2, (a, ma), (b, mb), first=ma)  # a wrote step 2, then was lost
    _step(3, (b, mb), first=mb)  # b replays step 2 (held: skipped), writes step 3
    b.after_train()
    assert _rows(a.metrics_file) == [(1, "1.0"), (2, "0.5"), (3, "0.3333333432674408")]


def test_members_continue_one_mlflow_run_by_their_run_key(tmp_path: Path) -> None:
    pytest.importorskip("mlflow")
    from nn_handler.tracking.mlflow_logger import MLflowLogger

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (a, ma), (b, mb) = _pair(lambda: MLflowLogger(uri, log_curves=False, every_n_steps=1))
    ma.is_reporting_process = True
    a.before_train()
    _step(1, (a, ma), (b, mb), first=ma)
    mb.committed(2, False)  # a is lost between step 2's commit and its write
    b.after_step()
    _step(3, (b, mb), first=mb)
    b.after_train()
    runs = a.client.search_runs([a.client.get_experiment_by_name("nn_handler").experiment_id])
    assert len(runs) == 1 and b.run_id == a.run_id == runs[0].info.run_id
    history = a.client.get_metric_history(a.run_id, "train_loss_step")
    assert sorted(m.step for m in history) == [1, 2, 3]
    assert runs[0].data.params == {"lr": "0.1"} and runs[0].info.status == "FINISHED"


def test_members_sharing_a_tensorboard_folder_write_each_step_once(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nn_handler.tracking.tensorboard import TensorBoardLogger

    (a, ma), (b, mb) = _pair(lambda: TensorBoardLogger(tmp_path, 1, log_curves=False))
    ma.is_reporting_process = True
    a.before_train()
    _step(1, (a, ma), (b, mb), first=ma)
    _step(2, (a, ma), (b, mb), first=ma)  # a wrote step 2, then was lost
    a.finish("success")  # its events on disk, as a killed writer's flushed ones
    _step(3, (b, mb), first=mb)  # b replays step 2 (held: skipped), writes step 3
    b.after_train()
    steps = []
    for folder in {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}:
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        steps += [e.step for e in events.Scalars("train_loss_step")]
    assert sorted(steps) == [1, 2, 3]


def test_a_tracker_not_attached_has_no_run_key() -> None:
    tracker = Recording()
    assert tracker.attached_trainer is None and tracker.run_key is None
    member = Member()
    tracker.attach(member)
    assert tracker.attached_trainer is member and tracker.run_key == "run-7"
