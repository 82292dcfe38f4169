"""One place knows what a checkpoint is on disk: the format's names and its two decisions:
saving one file or a folder of shards (``sharded_checkpoints``), and what a path holds
(``kind_of``: a file, a folder, a folder of checkpoints, a URL). Nothing else decides
file-or-folder (a structure test pins it).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Literal

from nn_handler.checkpoint.run_identity import RUN
from nn_handler.config.checkpoint import is_url
from nn_handler.errors import ConfigError

if TYPE_CHECKING:
    from nn_handler.config.checkpoint import CheckpointConfig

#: The file of a sharded checkpoint holding its unsharded parts.
REST = "trainer.pt"
#: The entry of REST naming the parts that are in the shards.
SHARDED = "sharded"
#: The entry of REST naming the folder's checksum file (absent: written before checksums).
CHECKSUMS = "checksums"
#: Top-level keys of a training checkpoint that are not parts (training/checkpointing.py).
META = ("format", "version", "world_size", "config", "ranks", SHARDED, CHECKSUMS,
        "consolidated_without", RUN)  # fmt: skip

#: What a path names: ``file`` a checkpoint file, ``folder`` a checkpoint folder (sharded),
#: ``checkpoints`` a local folder of checkpoints, ``url`` a place on an object store.
Kind = Literal["file", "folder", "checkpoints", "url"]


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a (committed) sharded checkpoint folder."""
    folder = Path(path)
    return folder.is_dir() and (folder / REST).is_file()


def is_checkpoint(path: Path) -> bool:
    """A complete local checkpoint: a file, or a committed sharded folder."""
    return path.is_file() or is_sharded(path)


def top_file(path: Path) -> Path:
    """The file holding the checkpoint ``path``'s top level: the file itself, or a sharded
    folder's unsharded parts (REST)."""
    return path / REST if is_sharded(path) else path


def kind_of(path: str | Path) -> Kind:
    """What ``path`` names (see ``Kind``); decided once, here, for every reader."""
    if is_url(path):
        return "url"
    if is_sharded(path):
        return "folder"
    return "checkpoints" if Path(path).is_dir() else "file"


def sharded_checkpoints(config: CheckpointConfig, sharded_model: bool) -> bool:
    """Whether a run's checkpoints are sharded folders (``format``; 'auto': when the model
    is sharded)."""
    sharded = config.format == "sharded" or (config.format == "auto" and sharded_model)
    if config.async_save and not sharded and not is_url(config.dir):
        raise ConfigError(
            "checkpoint.async_save writes sharded checkpoints in the background, and this run "
            "writes single files (format='auto' shards with strategy='fsdp' only): set "
            "checkpoint.format='sharded', or async_save=False."
        )
    return sharded


__all__ = [
    "CHECKSUMS",
    "META",
    "REST",
    "SHARDED",
    "Kind",
    "is_checkpoint",
    "is_sharded",
    "kind_of",
    "sharded_checkpoints",
    "top_file",
]
