"""MLflowLogger: the protocol on MLflow's tracking client (no global state of mlflow's)."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

from loguru import logger

from nn_handler.distributed.faults.liveness import process_running
from nn_handler.tracking.base import ExperimentLogger, plain_params, require

#: MLflow's longest parameter value.
MAX_PARAM_LENGTH = 6000
_HOST, _PID = "nn_handler.host", "nn_handler.pid"
#: The tag of a run that several processes may write in turn (Trainer.run_key).
_KEY = "nn_handler.run_key"


def _process_tags() -> dict[str, str]:
    return {_HOST: socket.gethostname(), _PID: str(os.getpid())}


class MLflowLogger(ExperimentLogger):
    """One MLflow run: parameters, metrics by step, the curves as an artifact; on the
    reporting process only (rank 0).

    Args:
        tracking_uri: where MLflow stores runs (``sqlite:///runs/mlflow.db``, a server's
            ``http://...``); None: MLflow's own default (``MLFLOW_TRACKING_URI``).
        experiment: the experiment's name (created when missing).
        run_name: the run's name (MLflow picks one when None).
        tags: tags of the run.
        artifact_location: where a new experiment keeps its artifacts (the curves); None:
            MLflow's default, which for a SQLite store is ``./mlruns`` under the current
            directory (``logging.trackers`` puts it beside its database instead).

    The run's id is kept in checkpoints: a resumed training continues the same MLflow run and
    skips the (metric, step) points the run already holds (a killed run logged them before its
    last checkpoint's successor; the resumed run does those steps again, bit-identical). Each
    run is tagged with its host and process id: a new run marks the RUNNING runs of this
    experiment whose process on this host is gone (killed before its first checkpoint) KILLED.
    Needs ``pip install 'nn_handler[mlflow]'`` (mlflow-skinny with SQLite support).
    """

    def __init__(
        self,
        tracking_uri: str | Path | None = None,
        experiment: str = "nn_handler",
        run_name: str | None = None,
        tags: dict[str, str] | None = None,
        every_n_steps: int = 50,
        log_curves: bool = True,
        artifact_location: str | Path | None = None,
    ) -> None:
        super().__init__(every_n_steps, log_curves)
        require("mlflow", "mlflow", "mlflow")
        self.artifact_location = artifact_location
        self.tracking_uri = str(tracking_uri) if tracking_uri is not None else None
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.run_id: str | None = None
        self._client: Any = None
        #: When continuing a run: the steps it holds per metric (read once per metric).
        self._held: dict[str, set[int]] | None = None

    # ----------------------------------------------------------------- checkpoint state
    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    # ----------------------------------------------------------------- the run
    @property
    def client(self) -> Any:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def _start(self) -> str:
        """The run's id, creating the run on first use (or finding the run of the Trainer's
        ``run_key``, which another member of a fault-tolerant run created)."""
        if self.run_id is None:
            found = self.client.get_experiment_by_name(self.experiment)
            experiment = (
                found.experiment_id
                if found is not None
                else self.client.create_experiment(
                    self.experiment, artifact_location=self._artifact_uri()
                )
            )
            key = self.run_key
            if key is not None and (keyed := self._keyed(experiment, key)) is not None:
                self.run_id = keyed
                return keyed
            self._end_orphans(experiment)
            tags = {**self.tags, **_process_tags(), **({_KEY: key} if key else {})}
            run = self.client.create_run(experiment, tags=tags, run_name=self.run_name)
            self.run_id = str(run.info.run_id)
        return self.run_id

    def _keyed(self, experiment: str, key: str) -> str | None:
        """The id of the run tagged with ``key`` in ``experiment`` (None: none yet)."""
        query = f"tags.`{_KEY}` = '{key}'"
        runs = self.client.search_runs([experiment], filter_string=query, max_results=1)
        return str(runs[0].info.run_id) if runs else None

    def _end_orphans(self, experiment: str) -> None:
        """Mark KILLED the RUNNING runs of ``experiment`` started by a process of this host
        that no longer exists (a run killed before its first checkpoint is never resumed,
        so nothing else would end it)."""
        host = socket.gethostname()
        query = f"attributes.status = 'RUNNING' and tags.`{_HOST}` = '{host}'"
        for run in self.client.search_runs([experiment], filter_string=query, max_results=200):
            pid = run.data.tags.get(_PID, "")
            if pid.isdigit() and not process_running(int(pid)):
                self.client.set_terminated(run.info.run_id, "KILLED")
                logger.warning(
                    "MLflow run {} was still RUNNING, but its process (pid {} on {}) is gone: "
                    "marked KILLED",
                    run.info.run_id,
                    pid,
                    host,
                )

    def _artifact_uri(self) -> str | None:
        location = self.artifact_location
        if location is None or "://" in str(location):
            return None if location is None else str(location)
        return Path(location).resolve().as_uri()

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        # A run that exists already (resumed from a checkpoint, an earlier train() of this
        # handler, or another member's) continues: running again, its parameters kept as
        # first logged (MLflow refuses to change one; a learning rate a scheduler moved would
        # be one), the points it holds skipped.
        known = self.run_id
        run_id = self._start()
        continuing = known is not None or bool(self.client.get_run(run_id).data.params)
        values = {k: str(v)[:MAX_PARAM_LENGTH] for k, v in plain_params(params).items()}
        if continuing:
            self.client.update_run(run_id, status="RUNNING")
            for key, value in _process_tags().items():
                self.client.set_tag(run_id, key, value)
            self._held = {}
            logged = self.client.get_run(run_id).data.params
            changed = sorted(k for k, v in values.items() if k in logged and logged[k] != v)
            if changed:
                logger.warning(
                    "MLflow run {} continues with changed parameters {} (kept as first logged)",
                    run_id,
                    changed,
                )
            values = {k: v for k, v in values.items() if k not in logged}
        items = [Param(k, v) for k, v in values.items()]
        for start in range(0, len(items), 100):  # MLflow's batch limit
            self.client.log_batch(run_id, params=items[start : start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        run_id = self._start()
        stamp = int(time.time() * 1000)
        items = [
            Metric(k, float(v), stamp, step)
            for k, v in metrics.items()
            if not self._holds(run_id, k, step)
        ]
        if items:
            self.client.log_batch(run_id, metrics=items)

    def _holds(self, run_id: str, key: str, step: int) -> bool:
        """Whether the continued run already has ``key`` at ``step``."""
        if self._held is None:
            return False
        if key not in self._held:
            history = self.client.get_metric_history(run_id, key)
            self._held[key] = {int(m.step) for m in history}
        return step in self._held[key]

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        self.client.log_figure(self._start(), figure, f"{name}.png")

    def finish(self, status: str) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, "FINISHED" if status == "success" else "FAILED")


__all__ = ["MLflowLogger"]
