"""WandbLogger: the protocol on a Weights & Biases run (online, or offline into a folder)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from nn_handler.tracking.base import ExperimentLogger, plain_params, require

WandbMode = Literal["online", "offline", "disabled"]


class WandbLogger(ExperimentLogger):
    """One W&B run: the config, metrics by step, the curves as an image; on the reporting
    process only (rank 0).

    Args:
        project: the W&B project.
        name: the run's display name (W&B picks one when None).
        dir: the folder W&B writes its files into (``dir/wandb/...``); None: W&B's default.
        mode: 'online', 'offline' (``wandb sync`` uploads it later) or 'disabled'; None:
            W&B's own choice (``WANDB_MODE``, then online).
        entity: the team or user; tags: the run's tags.

    The run's id is kept in checkpoints: a resumed training continues the same W&B run.
    Needs ``pip install 'nn_handler[wandb]'``.
    """

    def __init__(
        self,
        project: str = "nn_handler",
        name: str | None = None,
        dir: str | Path | None = None,
        mode: WandbMode | None = None,
        entity: str | None = None,
        tags: list[str] | None = None,
        every_n_steps: int = 50,
        log_curves: bool = True,
    ) -> None:
        super().__init__(every_n_steps, log_curves)
        require("wandb", "wandb", "wandb")
        self.project = project
        self.name = name
        self.dir = Path(dir) if dir is not None else None
        self.mode = mode
        self.entity = entity
        self.tags = list(tags or [])
        self.run_id: str | None = None
        self.run: Any = None

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.run_id = state.get("run_id")

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        import wandb

        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
        # A fault-tolerant run's members write one W&B run in turn: its id is their run key.
        run_id = self.run_id or self.run_key
        self.run = wandb.init(
            project=self.project,
            name=self.name,
            dir=str(self.dir) if self.dir is not None else None,
            mode=self.mode,
            entity=self.entity,
            tags=self.tags or None,
            id=run_id,
            resume="allow" if run_id is not None else None,
            config=plain_params(params),
            reinit="create_new",
            settings=wandb.Settings(console="off", silent=True),
        )
        self.run_id = str(self.run.id)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.run is not None:
            self.run.log(dict(metrics), step=step)

    def replay(self, metrics: dict[str, float], step: int) -> None:
        # A resumed W&B run continues after its last step and refuses earlier ones.
        if self.run is not None and step >= int(getattr(self.run, "step", 0)):
            self.log_metrics(metrics, step)

    def log_figure(self, name: str, figure: Any, step: int) -> None:
        import wandb

        if self.run is not None:
            self.run.log({name: wandb.Image(figure)}, step=step)

    def release(self) -> None:
        self.finish("success")

    def finish(self, status: str) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status == "success" else 1)
            self.run = None


__all__ = ["WandbLogger"]
