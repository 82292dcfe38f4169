"""The Trainer's checkpoint format: its marker and version, the run configuration as plain
values, the check that a loaded object is a training checkpoint, and a rank's saved parts."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel

from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.errors import CheckpointError, ConfigError

FORMAT = "nn_handler.checkpoint"
VERSION = 1


def plain_config(config: BaseModel) -> dict[str, Any]:
    """A config as JSON-compatible values for a checkpoint; values JSON cannot hold (a callable
    in compile_kwargs, say) are stored as their repr."""
    try:
        return dict(config.model_dump(mode="json"))
    except Exception:  # pydantic's serialisation error for values it cannot convert
        dumped = config.model_dump()
        return json.loads(json.dumps(dumped, default=repr))  # type: ignore[no-any-return]


def check_checkpoint(checkpoint: Any, source: str) -> dict[str, Any]:
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        keys = sorted(checkpoint)[:10] if isinstance(checkpoint, dict) else type(checkpoint)
        raise CheckpointError(
            f"{source} is not an nn_handler training checkpoint (top level: {keys}). To load "
            f"bare weights use nn_handler.checkpoint.load_model_state(model, state) or "
            f"NNHandler.load."
        )
    if int(checkpoint.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{source} was written by a newer nn_handler (format version "
            f"{checkpoint['version']} > {VERSION}); upgrade nn_handler to load it."
        )
    return checkpoint


def rank_parts(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A rank's saved parts; the tracked states of the first writers (nested under
    ``tracked``) read as ``tracked.<name>``."""
    parts = {k: v for k, v in saved.items() if k != "tracked"}
    for name, state in (saved.get("tracked") or {}).items():
        parts[f"tracked.{name}"] = state
    return parts


def sharded_checkpoints(config: CheckpointConfig, sharded_model: bool) -> bool:
    """Whether checkpoints are sharded folders (``format``; 'auto': when the model is)."""
    sharded = config.format == "sharded" or (config.format == "auto" and sharded_model)
    if config.async_save and not sharded:
        raise ConfigError(
            "checkpoint.async_save writes sharded checkpoints in the background, and this run "
            "writes single files (format='auto' shards with strategy='fsdp' only): set "
            "checkpoint.format='sharded', or async_save=False."
        )
    return sharded


__all__ = [
    "FORMAT",
    "VERSION",
    "check_checkpoint",
    "plain_config",
    "rank_parts",
    "sharded_checkpoints",
]
