"""HandlerConfig: every section NNHandler needs, loadable from a dict, JSON or YAML."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, StrictBool, field_validator

from nn_handler.config.base import ConfigModel, validate_config
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.config.data import LoaderConfig
from nn_handler.config.distributed import DistributedConfig
from nn_handler.config.observability import TrackerConfig, tracker_shorthand
from nn_handler.config.training import EmaConfig, PrecisionConfig, TrainerConfig
from nn_handler.errors import ConfigError


class LoggingConfig(ConfigModel):
    """Logs of a run. NNHandler adds a stderr sink for its lifetime (see
    ``nn_handler.enable_logging``): one line per event, on rank 0 unless ``all_ranks``.
    The library itself (a Trainer used alone) adds none.

    Attributes:
        enabled: print nn_handler's logs (epoch summaries, skipped steps, loader settings);
            False leaves the application's own loguru sinks as the only output.
        level: the loguru level.
        all_ranks: every rank prints (default: rank 0 only); records carry the rank either way.
        file: also write to this file; '{rank}' in the name gives one file per rank
            (e.g. 'logs/rank{rank}.log'), otherwise rank 0 writes it.
        dir: the run folder the trackers write into by default.
        trackers: experiment trackers, by name with their defaults (``[csv, mlflow]``) or
            with options (``{type: wandb, mode: offline}``): csv, tensorboard, mlflow, wandb,
            trackio (see nn_handler/config/observability.py). Rank 0 logs to them.
        monitor: add a ThroughputMonitor: throughput, TFLOP/s and MFU, the step anatomy
            (data wait, compute, exposed communication, checkpoints) and peak memory in
            each epoch's record, and a verdict when a part other than compute dominates.
            Pass your own ``ThroughputMonitor`` in ``hooks`` to count tokens.
        flops_per_sample: the monitor's training FLOPs per sample (None: measured once).
        peak_tflops: the monitor's peak TFLOP/s per device for the MFU (None: looked up for
            known GPUs).
        log_lr: 'epoch': the learning rate is in each epoch's record (always); 'step': also
            every optimizer step's, to the trackers (a LearningRateMonitor: ``lr``, or
            ``lr-<Optimizer>[/pg<i>]`` with several optimizers or parameter groups).
    """

    enabled: StrictBool = True
    level: str = "INFO"
    all_ranks: StrictBool = False
    file: str | None = None
    dir: str = "runs"
    trackers: list[TrackerConfig] = Field(default_factory=list)
    monitor: StrictBool = True
    log_lr: Literal["epoch", "step"] = "epoch"
    flops_per_sample: float | None = Field(default=None, gt=0)
    peak_tflops: float | None = Field(default=None, gt=0)

    _trackers = field_validator("trackers", mode="before")(tracker_shorthand)


class HandlerConfig(ConfigModel):
    """Everything NNHandler needs, validated once at construction.

    Build it in code, or load it with ``from_dict`` / ``from_file`` (JSON or YAML);
    validation errors name the field (e.g. ``trainer.accumulate_grad_batches``).
    ``precision`` also accepts the bare name (``precision="bf16"``).
    """

    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig)
    ema: EmaConfig = Field(default_factory=EmaConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)

    @field_validator("precision", mode="before")
    @classmethod
    def _precision_shorthand(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # Lightning's precision=16 / 32: the error lists ours
        return {"precision": value} if isinstance(value, str) else value

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], source: str = "config") -> HandlerConfig:
        """Validate a (nested) dict; errors are ConfigErrors naming each bad field."""
        return validate_config(cls, data, source)

    @classmethod
    def from_file(cls, path: str | Path) -> HandlerConfig:
        """Load a JSON (.json) or YAML (.yaml/.yml) file."""
        target = Path(path)
        suffix = target.suffix.lower()
        if suffix not in (".json", ".yaml", ".yml"):
            raise ConfigError(
                f"config file {target} must end in .json, .yaml or .yml, not {suffix!r}."
            )
        try:
            text = target.read_text()
        except OSError as error:
            raise ConfigError(f"cannot read config file {target}: {error}") from error
        try:
            data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError) as error:
            kind = "JSON" if suffix == ".json" else "YAML"
            raise ConfigError(f"config file {target} is not valid {kind}: {error}") from error
        if data is None:
            data = {}
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"config file {target} must hold a mapping of sections, got {type(data).__name__}."
            )
        return cls.from_dict(data, source=str(target))


__all__ = ["HandlerConfig", "LoggingConfig"]
