"""CSVLogger: metrics.csv and hparams.json in a folder, no dependency."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from nn_handler.tracking.base import ExperimentLogger, plain_params


class CSVLogger(ExperimentLogger):
    """``dir/metrics.csv`` (one row per ``log_metrics`` call: ``step`` then every key seen,
    empty where a row has none), ``dir/hparams.json`` and ``dir/curves.png``; the reporting
    process only.

    The file is rewritten whole (atomically) at each call. A resumed run keeps the rows up to
    the position it resumed from (the rows logged after its checkpoint are dropped, since the
    run does them again: a later step, or an epoch's record the checkpoint had not closed);
    a new run (step 0) starts the file anew. A process that takes the run over (a
    fault-tolerant run's member) reads the rows written so far, so a folder the members share
    holds one run.
    """

    def __init__(self, dir: str | Path, every_n_steps: int = 50, log_curves: bool = True) -> None:
        super().__init__(every_n_steps, log_curves)
        self.dir = Path(dir)
        self.rows: list[dict[str, float]] = []
        self._keys: list[str] = ["step"]

    @property
    def metrics_file(self) -> Path:
        return self.dir / "metrics.csv"

    def open_run(self) -> None:
        state = self.trainer.state
        self._keep_rows_until(state.global_step, state.epoch)
        super().open_run()

    def _keep_rows_until(self, step: int, epochs: int) -> None:
        """Keep the rows of steps up to ``step`` and of epochs up to ``epochs`` (the epoch's
        record shares its last step with a step checkpoint taken before the epoch closed)."""
        self.rows, self._keys = [], ["step"]
        if step == 0 or not self.metrics_file.exists():
            return
        with self.metrics_file.open(newline="") as handle:
            for row in csv.DictReader(handle):
                values = {k: float(v) for k, v in row.items() if v != ""}
                if values["step"] <= step and values.get("epoch", 0.0) <= epochs:
                    self._add(values)

    def _add(self, row: dict[str, float]) -> None:
        self.rows.append(row)
        self._keys.extend(key for key in row if key not in self._keys)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        text = json.dumps(plain_params(params), indent=2, sort_keys=True)
        _write_atomically(self.dir / "hparams.json", text + "\n")

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._add({"step": float(step), **metrics})
        self.dir.mkdir(parents=True, exist_ok=True)
        temporary = self.metrics_file.with_suffix(".csv.tmp")
        with temporary.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self._keys, restval="")
            writer.writeheader()
            for row in self.rows:
                writer.writerow({k: (int(v) if k == "step" else v) for k, v in row.items()})
        os.replace(temporary, self.metrics_file)

    def replay(self, metrics: dict[str, float], step: int) -> None:
        held = {k for row in self.rows if row["step"] == step for k in row}
        if not set(metrics) <= held:
            self.log_metrics(metrics, step)

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        figure.savefig(self.dir / f"{name}.png", dpi=100)


def _write_atomically(path: Path, text: str) -> None:
    temporary = path.with_suffix(path.suffix + ".tmp")
    temporary.write_text(text)
    os.replace(temporary, path)


__all__ = ["CSVLogger"]
