"""Experiment trackers, each read back through its real package (no network): CSV, MLflow
(SQLite store, MlflowClient), W&B (offline run file), Trackio (its SQLite database); the
protocol's calls; config by name; a missing package names the extra to install."""

from __future__ import annotations

import csv
import glob
import json
import os
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import (
    CSVLogger,
    ExperimentLogger,
    HandlerConfig,
    History,
    Hook,
    MLflowLogger,
    NNHandler,
    TrackioLogger,
    Trainer,
    WandbLogger,
)
from nn_handler.errors import ConfigError
from nn_handler.tracking import build_trackers
from tests.interpreters import python_path
from tests.training_helpers import mlp, regression_data, sgd

ROOT = Path(__file__).resolve().parents[2]
# 40 samples in batches of 8: 5 optimizer steps an epoch.
STEPS_PER_EPOCH = 5


def _train(
    tmp_path: Path,
    trackers: list[Any] | None = None,
    hooks: tuple[Any, ...] = (),
    epochs: int = 2,
    **config: Any,
) -> NNHandler:
    data: dict[str, Any] = {
        "loader": {"batch_size": 8, "shuffle": False},
        "trainer": {"progress_bar": False},
        "logging": {"dir": str(tmp_path / "runs"), "trackers": trackers or []},
        **config,
    }
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=data, hooks=hooks) as handler:
        handler.train(regression_data(), regression_data(n=16, seed=1), epochs=epochs)
    return handler


def _resumable(tmp_path: Path, trackers: list[Any], keep_last: int = 1) -> NNHandler:
    """A handler with a checkpoint folder (one checkpoint per epoch) and ``trackers``."""
    return NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config={
            "loader": {"batch_size": 8, "shuffle": False},
            "trainer": {"progress_bar": False},
            "checkpoint": {"dir": str(tmp_path / "ckpt"), "keep_last": keep_last},
            "logging": {"dir": str(tmp_path / "runs"), "trackers": trackers},
        },
    )


def _epoch_rows(history: History) -> list[tuple[int, dict[str, float]]]:
    """(optimizer steps done, record) of each epoch: where the trackers log it."""
    return [(STEPS_PER_EPOCH * (i + 1), record) for i, record in enumerate(history.records)]


# --------------------------------------------------------------------------- protocol
class Recording(ExperimentLogger):
    """Every call the Trainer makes, in order."""

    def __init__(self, every_n_steps: int = 2) -> None:
        super().__init__(every_n_steps=every_n_steps)
        self.calls: list[tuple[str, Any, Any]] = []

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.calls.append(("hyperparams", params, None))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.calls.append(("metrics", dict(metrics), step))

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        self.calls.append(("figure", name, step))

    def finish(self, status: str) -> None:
        self.calls.append(("finish", status, None))


def test_the_protocol_hyperparams_once_steps_epochs_a_figure_then_finish(tmp_path: Path) -> None:
    recording = Recording(every_n_steps=2)
    handler = _train(tmp_path, hooks=(recording,))
    kinds = [kind for kind, _, _ in recording.calls]
    assert kinds[0] == "hyperparams" and kinds.count("hyperparams") == 1
    assert kinds[-2:] == ["figure", "finish"] and recording.calls[-1][1] == "success"
    params = recording.calls[0][1]
    assert params["world_size"] == 1 and params["precision"] == "32"
    assert params["loader.batch_size"] == 8 and params["optimizer"] == "SGD"
    steps = [(m, s) for kind, m, s in recording.calls if kind == "metrics"]
    # train_loss_step at steps 2, 4, 6, 8, 10 and each epoch record at 5 and 10.
    assert [s for m, s in steps if "train_loss_step" in m] == [2, 4, 6, 8, 10]
    epochs = [(s, m) for m, s in steps if "epoch" in m]
    assert epochs == _epoch_rows(handler.history)
    assert "samples_per_sec" in epochs[0][1] and "data_wait_pct" in epochs[0][1]


def test_the_hyperparameters_are_the_values_the_run_used(tmp_path: Path) -> None:
    """train(..., epochs=3) with the config's default epochs (1): the trackers log 3."""
    recording = Recording()
    _train(tmp_path, hooks=(recording,), epochs=3)
    params = recording.calls[0][1]
    assert params["trainer.epochs"] == 3


def test_a_failed_run_finishes_failed_without_curves(tmp_path: Path) -> None:
    class Boom(nn.Module):
        calls = 0

        def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            Boom.calls += 1
            if Boom.calls == 7:
                raise RuntimeError("boom at step 7")
            return nn.functional.cross_entropy(out, target)

    recording = Recording()
    config = {"loader": {"batch_size": 8}, "trainer": {"progress_bar": False}}
    handler = NNHandler(mlp(), sgd, Boom(), config=config, hooks=[recording])
    with handler, pytest.raises(RuntimeError, match="boom at step 7"):
        handler.train(regression_data(), epochs=2)
    assert recording.calls[-1] == ("finish", "failed", None)
    assert "figure" not in [kind for kind, _, _ in recording.calls]


def test_trackers_log_on_rank_zero_only() -> None:
    from nn_handler.distributed.communicator import run_in_threads

    recordings = [Recording(), Recording()]

    def rank(comm: Any) -> None:
        config = {"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}}
        hooks = [recordings[comm.rank]]
        with NNHandler(
            mlp(), sgd, nn.CrossEntropyLoss(), config=config, communicator=comm, hooks=hooks
        ) as handler:
            handler.train(regression_data(), epochs=1)

    run_in_threads(rank, 2)
    assert [kind for kind, _, _ in recordings[0].calls][-1] == "finish"
    assert recordings[1].calls == []


class ReturnsAccuracy(Trainer):
    """Returns the batch's accuracy beside its loss."""

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        x, y = batch
        out = self.forward(x)
        return {"loss": self.compute_loss(out, y), "acc": (out.argmax(1) == y).float().mean()}


class LogsGradientNorm(Hook):
    """Logs the gradient norm and the learning rate after every optimizer step."""

    def __init__(self) -> None:
        self.logged: list[float] = []

    def after_optimizer_step(self) -> None:
        trainer = self.trainer
        norm = torch.stack([p.grad.norm() for p in trainer.module.parameters()]).norm()
        self.logged.append(float(norm))
        trainer.log_metrics(
            {"grad_norm": norm, "lr_x10": 10 * trainer.optimizer.param_groups[0]["lr"]}
        )


def _scalars_run(tmp_path: Path, comm: Any = None, hooks: tuple[Any, ...] = ()) -> NNHandler:
    config = {
        "loader": {"batch_size": 8, "shuffle": False},
        "trainer": {"progress_bar": False},
        "logging": {
            "dir": str(tmp_path / "runs"),
            "trackers": [{"type": "csv", "every_n_steps": 2}],
        },
    }
    extra = {} if comm is None else {"communicator": comm}
    with NNHandler(
        mlp(), sgd, nn.CrossEntropyLoss(), config=config, trainer_class=ReturnsAccuracy,
        hooks=list(hooks), **extra,
    ) as handler:  # fmt: skip
        handler.train(regression_data(), epochs=2)
    return handler


def _csv_rows(tmp_path: Path) -> list[dict[str, str]]:
    files = glob.glob(str(tmp_path / "runs" / "**" / "metrics.csv"), recursive=True)
    assert len(files) == 1, files
    with open(files[0], newline="") as handle:
        return list(csv.DictReader(handle))


def test_the_scalars_a_step_returns_reach_the_trackers_per_step(tmp_path: Path) -> None:
    """Every ``every_n_steps`` optimizer steps, each scalar training_step returned is logged
    as train_<key>_step beside train_loss_step (the epoch's mean stays train_<key>)."""
    recording = Recording(every_n_steps=2)
    handler = _scalars_run(tmp_path, hooks=(recording,))
    steps = [(m, s) for kind, m, s in recording.calls if kind == "metrics" and "epoch" not in m]
    per_step = [(s, sorted(m)) for m, s in steps if "train_loss_step" in m]
    assert per_step == [(s, ["train_acc_step", "train_loss_step"]) for s in (2, 4, 6, 8, 10)]
    values = [m["train_acc_step"] for m, _ in steps if "train_acc_step" in m]
    assert all(v in {i / 8 for i in range(9)} for v in values), values  # a batch's accuracy
    assert "train_acc" in handler.history.last and "train_acc_step" not in handler.history.last


def test_log_metrics_writes_the_training_codes_scalars_at_the_step(tmp_path: Path) -> None:
    hook = LogsGradientNorm()
    _scalars_run(tmp_path, hooks=(hook,))
    rows = [r for r in _csv_rows(tmp_path) if r.get("grad_norm")]
    assert [int(r["step"]) for r in rows] == list(range(1, 11))  # every step, as called
    assert [float(r["grad_norm"]) for r in rows] == pytest.approx(hook.logged)
    assert [float(r["lr_x10"]) for r in rows] == pytest.approx([1.0] * 10)  # sgd: lr 0.1


def test_log_metrics_on_other_ranks_writes_nothing_and_bad_values_name_the_key() -> None:
    from nn_handler.distributed.communicator import run_in_threads

    recordings = [Recording(), Recording()]
    errors: dict[int, str] = {}

    def rank(comm: Any) -> None:
        config = {"loader": {"batch_size": 4}, "trainer": {"progress_bar": False}}
        with NNHandler(
            mlp(), sgd, nn.CrossEntropyLoss(), config=config, communicator=comm,
            hooks=[recordings[comm.rank]],
        ) as handler:  # fmt: skip
            handler.trainer.log_metrics({"custom": torch.tensor(2.5)}, step=7)
            try:
                handler.trainer.log_metrics({"weights": torch.ones(3)})
            except ConfigError as error:
                errors[comm.rank] = str(error)

    run_in_threads(rank, 2)
    assert recordings[0].calls == [("metrics", {"custom": 2.5}, 7)]
    assert recordings[1].calls == []  # rank 1: nothing written, nothing checked
    assert list(errors) == [0]
    assert "'weights' is a tensor of shape (3,), not a number" in errors[0]


# --------------------------------------------------------------------------- CSV
def test_csv_round_trip_matches_the_history(tmp_path: Path) -> None:
    handler = _train(tmp_path, ["csv"])
    folder = tmp_path / "runs" / "csv"
    with (folder / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    epoch_rows = [row for row in rows if row["epoch"] != ""]
    assert len(epoch_rows) == 2
    for row, (step, record) in zip(epoch_rows, _epoch_rows(handler.history), strict=True):
        assert int(row["step"]) == step
        for key, value in record.items():
            assert float(row[key]) == pytest.approx(value, rel=1e-12), key
    params = json.loads((folder / "hparams.json").read_text())
    assert params["loader.batch_size"] == 8 and params["world_size"] == 1
    assert (folder / "curves.png").stat().st_size > 0


def test_a_resumed_csv_log_keeps_the_rows_up_to_its_checkpoint(tmp_path: Path) -> None:
    trackers: list[Any] = [{"type": "csv", "every_n_steps": 1}]
    with _resumable(tmp_path, trackers, keep_last=2) as handler:
        handler.train(regression_data(), regression_data(n=16, seed=1), epochs=2)
    # Back to the end of epoch 1 (step 5): the rows of steps 6-10 are logged again, not twice.
    with _resumable(tmp_path, trackers, keep_last=2) as handler:
        handler.resume(tmp_path / "ckpt" / "ckpt-e0001-s00000005.pt")
        handler.train(regression_data(), regression_data(n=16, seed=1), epochs=2)
    with (tmp_path / "runs" / "csv" / "metrics.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    step_rows = [int(r["step"]) for r in rows if r["train_loss_step"] != ""]
    assert step_rows == list(range(1, 11))  # each step once, across the two runs
    assert [float(r["epoch"]) for r in rows if r["epoch"] != ""] == [1.0, 2.0]


# --------------------------------------------------------------------------- MLflow
def test_mlflow_round_trip_through_mlflow_client(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    handler = _train(tmp_path, [{"type": "mlflow", "experiment": "exp", "run_name": "r1"}])
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("exp")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "r1" and run.info.status == "FINISHED"
    assert run.data.params["loader.batch_size"] == "8"
    assert run.data.params["optimizer"] == "SGD"
    for key in ("train_loss", "val_loss", "samples_per_sec", "compute_pct"):
        logged = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        expected = [(step, record[key]) for step, record in _epoch_rows(handler.history)]
        assert [s for s, _ in logged] == [s for s, _ in expected], key
        assert [v for _, v in logged] == pytest.approx([v for _, v in expected], rel=1e-12), key
    assert [a.path for a in client.list_artifacts(run.info.run_id)] == ["curves.png"]
    # The artifacts live beside the database, not in ./mlruns of whatever the cwd is.
    (curves,) = (tmp_path / "runs" / "mlruns").rglob("curves.png")
    assert run.info.artifact_uri.startswith((tmp_path / "runs" / "mlruns").as_uri())
    assert curves.stat().st_size > 0


def test_a_resumed_training_continues_its_mlflow_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    def run_once(epochs: int, resume: bool) -> None:
        with _resumable(tmp_path, ["mlflow"]) as handler:
            if resume:
                handler.resume("latest")
            handler.train(regression_data(), epochs=epochs)

    run_once(1, resume=False)
    run_once(3, resume=True)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("nn_handler")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    epochs = client.get_metric_history(run.info.run_id, "epoch")
    assert [(m.step, m.value) for m in epochs] == [(5, 1.0), (10, 2.0), (15, 3.0)]
    assert run.info.status == "FINISHED"


def test_a_second_train_call_continues_the_same_runs(tmp_path: Path, monkeypatch: Any) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    trackers = ["csv", "mlflow", {"type": "wandb", "mode": "offline"}]
    config = {
        "loader": {"batch_size": 8, "shuffle": False},
        "trainer": {"progress_bar": False},
        "logging": {"dir": str(tmp_path / "runs"), "trackers": trackers},
    }

    def halve(optimizer: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), halve, config=config) as handler:
        handler.train(regression_data(), epochs=1)
        # The learning rate moved: MLflow refuses to change a logged parameter, so the
        # continuing run keeps the first value (and warns) instead of failing the call.
        handler.train(regression_data(), epochs=2)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("nn_handler")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["lr"] == "0.1"
    epochs = client.get_metric_history(run.info.run_id, "epoch")
    assert [(m.step, m.value) for m in epochs] == [(5, 1.0), (10, 2.0)]
    # W&B writes one offline folder per init; both belong to one run (`wandb sync` joins them).
    files = _wandb_files(tmp_path / "runs")
    assert len(files) == 2 and files[0].name == files[1].name  # run-<id>.wandb, the same id
    rows = [row for path in files for row in _wandb_rows(path) if "epoch" in row]
    assert [(row["_step"], row["epoch"]) for row in rows] == [(5, 1), (10, 2)]
    with (tmp_path / "runs" / "csv" / "metrics.csv").open(newline="") as handle:
        assert [row["epoch"] for row in csv.DictReader(handle)] == ["1.0", "2.0"]


# --------------------------------------------------------------------------- W&B
def _wandb_files(folder: Path) -> list[Path]:
    """The offline run files under ``folder``, oldest first (one per ``wandb.init``)."""
    return sorted(Path(p) for p in glob.glob(str(folder / "wandb" / "offline-run-*" / "*.wandb")))


def _wandb_history(folder: Path, wait_s: float = 30.0) -> list[dict[str, Any]]:
    """The history rows of the one offline run under ``folder``. W&B's service process
    writes the file: on a loaded machine its last records can land a moment after
    ``run.finish()`` returned, so the file is read until it holds an epoch's row (bounded)."""
    (path,) = _wandb_files(folder)
    deadline = time.monotonic() + wait_s
    while True:
        rows = _wandb_rows(path)
        if any("epoch" in row for row in rows) or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def _wandb_rows(path: Path) -> list[dict[str, Any]]:
    """History rows of a W&B run file: a LevelDB-style log (7-byte header, 32 KiB blocks of
    records) of protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    block, position, pending, payloads = 32768, 7, b"", []
    while position + 7 <= len(raw):
        if block - position % block < 7:  # a block's tail too short for a header: padding
            position += block - position % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        data = raw[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 0 and length == 0:
            break
        if kind == 1:
            payloads.append(data)
        elif kind in (2, 3):
            pending = data if kind == 2 else pending + data
        elif kind == 4:
            payloads.append(pending + data)
    rows = []
    for payload in payloads:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        if record.WhichOneof("record_type") == "history":
            items = record.history.item
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in items})
    return rows


def test_wandb_offline_run_holds_the_metrics(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.setenv("WANDB_SILENT", "true")
    handler = _train(tmp_path, [{"type": "wandb", "mode": "offline", "project": "p"}])
    rows = _wandb_history(tmp_path / "runs")
    epoch_rows = [row for row in rows if "epoch" in row]
    assert len(epoch_rows) == 2
    for row, (step, record) in zip(epoch_rows, _epoch_rows(handler.history), strict=True):
        assert row["_step"] == step
        for key in ("train_loss", "val_loss", "lr", "samples_per_sec", "step_ms"):
            assert row[key] == pytest.approx(record[key], rel=1e-12), key
    assert rows[-1]["curves/_type"] == "image-file"  # the curves, at the last step


# --------------------------------------------------------------------------- Trackio
TRACKIO_SCRIPT = """
import json, sys
from torch import nn
from nn_handler import NNHandler
from tests.training_helpers import mlp, regression_data, sgd
config = {
    "loader": {"batch_size": 8, "shuffle": False},
    "trainer": {"progress_bar": False},
    "logging": {"enabled": False, "trackers": [{"type": "trackio", "project": "p", "name": "r"}]},
}
with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as handler:
    handler.train(regression_data(), epochs=2)
from trackio.sqlite_storage import SQLiteStorage
logs = SQLiteStorage.get_logs("p", "r")
print("RESULT", json.dumps({"history": handler.history.records, "logs": logs}, default=str))
"""


def test_trackio_round_trip_in_its_database(tmp_path: Path) -> None:
    # Trackio reads TRACKIO_DIR when imported: a process of its own keeps it in tmp_path.
    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "PYTHONPATH": python_path(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(TRACKIO_SCRIPT)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    assert (tmp_path / "trackio" / "p.db").exists()
    logged = [row for row in out["logs"] if "epoch" in row]
    assert [row["step"] for row in logged] == [5, 10]
    for row, record in zip(logged, out["history"], strict=True):
        assert row["train_loss"] == pytest.approx(record["train_loss"], rel=1e-12)


# --------------------------------------------------------------------------- config
def test_trackers_by_name_or_with_options_in_the_config(tmp_path: Path) -> None:
    config = HandlerConfig.from_dict(
        {
            "logging": {
                "trackers": [
                    "csv",
                    {"type": "mlflow", "experiment": "e", "every_n_steps": 7},
                    {"type": "wandb", "mode": "disabled"},
                    "trackio",
                ]
            }
        }
    )
    built = build_trackers(config.logging.trackers, tmp_path)
    assert [type(t) for t in built] == [CSVLogger, MLflowLogger, WandbLogger, TrackioLogger]
    assert isinstance(built[0], CSVLogger) and built[0].dir == tmp_path / "csv"
    assert built[1].every_n_steps == 7
    assert isinstance(built[1], MLflowLogger) and built[1].experiment == "e"
    assert built[1].tracking_uri == f"sqlite:///{(tmp_path / 'mlflow.db').resolve()}"


def test_an_unknown_tracker_is_a_config_error_naming_the_known_ones() -> None:
    with pytest.raises(ConfigError) as error:
        HandlerConfig.from_dict({"logging": {"trackers": ["neptune"]}})
    text = str(error.value)
    assert "logging.trackers" in text and "neptune" in text
    for name in ("csv", "tensorboard", "mlflow", "wandb", "trackio"):
        assert name in text


@pytest.mark.parametrize(
    ("tracker", "module"),
    [
        ("mlflow", "mlflow"),
        ("wandb", "wandb"),
        ("trackio", "trackio"),
        ("tensorboard", "tensorboard"),
    ],
)
def test_a_tracker_whose_package_is_missing_names_the_extra(
    tracker: str, module: str, tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # import raises ImportError
    with pytest.raises(ConfigError) as error:
        NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            config={"logging": {"dir": str(tmp_path), "trackers": [tracker]}},
        )
    assert f"pip install 'nn_handler[{tracker}]'" in str(error.value)


def test_a_tracker_logging_every_zero_steps_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="every_n_steps must be at least 1, got 0"):
        CSVLogger(tmp_path, every_n_steps=0)
    with pytest.raises(ConfigError, match="every_n_steps"):
        HandlerConfig.from_dict({"logging": {"trackers": [{"type": "csv", "every_n_steps": 0}]}})
