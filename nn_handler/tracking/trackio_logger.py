"""TrackioLogger: the protocol on a Trackio run (a local SQLite database, a dashboard)."""

from __future__ import annotations

from typing import Any

from nn_handler.tracking.base import ExperimentLogger, plain_params, require


class TrackioLogger(ExperimentLogger):
    """One Trackio run: the config and metrics by step; on the reporting process only (rank
    0). Trackio stores runs in ``TRACKIO_DIR`` (default ``~/.cache/huggingface/trackio``);
    ``trackio show`` opens them.

    Args:
        project: the Trackio project; name: the run's name (Trackio picks one when None).

    Needs ``pip install 'nn_handler[trackio]'``.
    """

    def __init__(
        self,
        project: str = "nn_handler",
        name: str | None = None,
        every_n_steps: int = 50,
        log_curves: bool = False,
    ) -> None:
        super().__init__(every_n_steps, log_curves)
        require("trackio", "trackio", "trackio")
        self.project = project
        self.name = name
        self.run: Any = None

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        import trackio

        # A fault-tolerant run's members write one trackio run in turn, named by their key.
        key = self.run_key
        name = self.name or (f"nn_handler-{key}" if key is not None else None)
        self.run = trackio.init(
            project=self.project,
            name=name,
            config=plain_params(params),
            resume="allow" if name is not None else "never",
            auto_log_cpu=False,
            auto_log_gpu=False,
        )
        self.name = str(self.run.name)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=step)

    def release(self) -> None:
        self.finish("success")

    def finish(self, status: str) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


__all__ = ["TrackioLogger"]
