"""A checkpoint opened for loading: single file or sharded folder, decided once, here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch

from nn_handler.checkpoint.io import load_file
from nn_handler.checkpoint.sharded import REST, is_sharded


class Opened(NamedTuple):
    """A checkpoint read from disk.

    Attributes:
        path: where it is.
        contents: a single file's whole checkpoint, or a sharded folder's unsharded parts
            (``trainer.pt``), read ``weights_only``.
        folder: the sharded folder whose DCP shards hold the other parts; None for a file.
        where: where it lives, as the user names it (an object store's URL, not the local
            copy ``path``): what logs and errors say.
        verified: every byte was checked against its manifest as it was fetched (an object
            store's): nothing checksums it again.
    """

    path: Path
    contents: Any
    folder: Path | None
    where: str
    verified: bool = False


def top_file(path: Path) -> Path:
    """The file holding the checkpoint ``path``'s top level: the file itself, or a sharded
    folder's unsharded parts (REST)."""
    return path / REST if is_sharded(path) else path


def open_checkpoint(
    path: str | Path,
    map_location: torch.device | str | None = None,
    where: str | None = None,
    verified: bool = False,
) -> Opened:
    """Read the local checkpoint at ``path`` (a file, or a committed sharded folder); raises
    CheckpointError when it cannot be read. ``where``: where it lives (an object store's
    copy: its URL); ``verified``: its bytes were checked as they were fetched, so reading
    does not checksum them again. (A URL: checkpoint/store/urls.py ``open_url``.)"""
    target = Path(path)
    where = where or str(target)
    contents = load_file(top_file(target), map_location, verify=not verified)
    return Opened(target, contents, target if is_sharded(target) else None, where, verified)


__all__ = ["Opened", "open_checkpoint", "top_file"]
