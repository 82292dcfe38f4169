"""Configuration of experiment trackers (``logging.trackers``) and the profiler
(``trainer.profile``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StrictBool, field_validator

from nn_handler.config.base import ConfigModel


class TrackerOptions(ConfigModel):
    """What every tracker takes.

    Attributes:
        every_n_steps: log the training loss every this many optimizer steps.
        log_curves: log the History's curves as a figure when training ends.
    """

    every_n_steps: int = Field(default=50, ge=1, strict=True)
    log_curves: StrictBool = True


class CsvTracker(TrackerOptions):
    """``csv``: metrics.csv and hparams.json in ``dir`` (default: ``<logging.dir>/csv``)."""

    type: Literal["csv"] = "csv"
    dir: str | None = None


class TensorBoardTracker(TrackerOptions):
    """``tensorboard``: event files in ``dir`` (default: ``<logging.dir>/tensorboard``)."""

    type: Literal["tensorboard"] = "tensorboard"
    dir: str | None = None


class MlflowTracker(TrackerOptions):
    """``mlflow``: a run of ``experiment`` at ``tracking_uri`` (default:
    ``sqlite:///<logging.dir>/mlflow.db`` with the artifacts in ``<logging.dir>/mlruns``; a
    server's ``http://host:5000`` works too)."""

    type: Literal["mlflow"] = "mlflow"
    tracking_uri: str | None = None
    experiment: str = "nn_handler"
    run_name: str | None = None
    tags: dict[str, str] = Field(default_factory=dict)


class WandbTracker(TrackerOptions):
    """``wandb``: a run of ``project``; ``mode`` 'offline' writes it under ``dir`` (default:
    ``<logging.dir>``) for ``wandb sync``; None: W&B's own choice (WANDB_MODE, then online)."""

    type: Literal["wandb"] = "wandb"
    project: str = "nn_handler"
    name: str | None = None
    entity: str | None = None
    mode: Literal["online", "offline", "disabled"] | None = None
    dir: str | None = None
    tags: list[str] = Field(default_factory=list)


class TrackioTracker(TrackerOptions):
    """``trackio``: a run of ``project`` in Trackio's local database (TRACKIO_DIR)."""

    type: Literal["trackio"] = "trackio"
    project: str = "nn_handler"
    name: str | None = None
    log_curves: StrictBool = False


TrackerConfig = Annotated[
    CsvTracker | TensorBoardTracker | MlflowTracker | WandbTracker | TrackioTracker,
    Field(discriminator="type"),
]

TRACKER_NAMES = ("csv", "tensorboard", "mlflow", "wandb", "trackio")


def tracker_shorthand(value: Any) -> Any:
    """``[csv, {type: mlflow, ...}]``: a bare name is a tracker with its defaults."""
    if isinstance(value, (list, tuple)):
        return [{"type": item} if isinstance(item, str) else item for item in value]
    return value


class ProfileConfig(ConfigModel):
    """torch.profiler over a few training steps (``trainer.profile``).

    Steps are training batches (micro-batches under accumulation), counted from the start of
    ``fit``: ``skip_first`` are not profiled, then per cycle ``wait`` idle, ``warmup`` traced
    and dropped, ``active`` recorded; ``repeat`` cycles. Each rank writes one Chrome trace
    per cycle, ``dir/rank{rank}.step{step}.trace.json`` (open in chrome://tracing or
    Perfetto); rank 0 logs a table of the top ``row_limit`` operators sorted by ``sort_by``.

    Attributes:
        dir: the traces' folder.
        record_shapes, profile_memory, with_stack: torch.profiler's options.
        memory_snapshot: on CUDA, record the allocator's history and write
            ``dir/rank{rank}.memory.pickle`` at the end of the profiled steps and on an
            out-of-memory error (open in pytorch.org/memory_viz).
    """

    dir: str = "runs/profile"
    skip_first: int = Field(default=1, ge=0, strict=True)
    wait: int = Field(default=0, ge=0, strict=True)
    warmup: int = Field(default=1, ge=0, strict=True)
    active: int = Field(default=3, ge=1, strict=True)
    repeat: int = Field(default=1, ge=1, strict=True)
    record_shapes: StrictBool = False
    profile_memory: StrictBool = False
    with_stack: StrictBool = False
    sort_by: str = "self_cpu_time_total"
    row_limit: int = Field(default=15, ge=1, strict=True)
    memory_snapshot: StrictBool = False

    @field_validator("sort_by")
    @classmethod
    def _check_sort(cls, value: str) -> str:
        known = {
            "cpu_time_total",
            "self_cpu_time_total",
            "cuda_time_total",
            "self_cuda_time_total",
            "device_time_total",
            "self_device_time_total",
            "cpu_memory_usage",
            "self_cpu_memory_usage",
            "count",
        }
        if value not in known:
            raise ValueError(f"sort_by must be one of {sorted(known)}")
        return value


__all__ = [
    "TRACKER_NAMES",
    "CsvTracker",
    "MlflowTracker",
    "ProfileConfig",
    "TensorBoardTracker",
    "TrackerConfig",
    "TrackerOptions",
    "TrackioTracker",
    "WandbTracker",
    "tracker_shorthand",
]
