"""What ``NNHandler`` reads from a checkpoint it loads, and records of the run it builds, in
the Trainer's checkpoint format (the handler knows no checkpoint internals)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from nn_handler.checkpoint.consolidate import loadable_in_one_process
from nn_handler.checkpoint.opening import Opened, open_checkpoint
from nn_handler.training.checkpoint_format import check_checkpoint, plain_config


def open_saved(path: str | Path) -> Opened:
    """The checkpoint ``path`` names, on the CPU (a folder of checkpoints, local or a URL:
    its newest complete, verified one, as a resume chooses it)."""
    return open_checkpoint(path, "cpu")


def saved_handler_config(opened: Opened, source: str, alone: bool) -> Any:
    """The handler configuration the checkpoint was written with (None: none recorded);
    ``alone``: made loadable in one process (an FSDP run's model as it is). A
    CheckpointError when it is no training checkpoint."""
    saved = check_checkpoint(opened.contents, source).get("config") or {}
    if alone and isinstance(saved, Mapping):
        saved = loadable_in_one_process(saved)
    return saved.get("handler") if isinstance(saved, Mapping) else None


def run_config_of(config: BaseModel) -> dict[str, Any]:
    """The run configuration stored in every checkpoint of a handler with ``config``."""
    return {"handler": plain_config(config)}


__all__ = ["open_saved", "run_config_of", "saved_handler_config"]
