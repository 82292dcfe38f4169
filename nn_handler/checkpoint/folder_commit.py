"""A folder checkpoint's local commit: written into a staging folder beside its target, then
made the target by one rename (a kill at any moment leaves the old folder or the new one), and
the tree helpers the stores use to link and delete folders."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from nn_handler.checkpoint.io import TMP_MARKER, fsync_dir
from nn_handler.errors import CheckpointError

_STAGING = f"{TMP_MARKER}sharded"


def staging_path(target: Path) -> Path:
    """Where the folder ``target`` is written before its commit."""
    return target.with_name(f".{target.name}{_STAGING}")


def commit_folder(staging: Path, target: Path, then: Callable[[Path], None] | None) -> str | None:
    """Rank 0: the staging folder becomes ``target`` in one rename (an older folder of that
    name is moved aside first and removed after)."""
    old = target.with_name(f".{target.name}{TMP_MARKER}replaced")
    try:
        if target.exists():
            if old.exists():
                shutil.rmtree(old)
            os.replace(target, old)
        os.replace(staging, target)
        fsync_dir(target.parent)
        if old.exists():
            shutil.rmtree(old, ignore_errors=True)
        if then is not None:
            then(target)
    except Exception as caught:
        return f"{type(caught).__name__}: {caught}"
    return None


def remove_tree(path: Path) -> None:
    """Delete a checkpoint file or folder (missing is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def link_tree(source: Path, target: Path) -> Path:
    """Make the folder ``target`` hold the same files as the folder ``source`` (hard links;
    copies where links are not supported), replacing ``target`` as one rename."""
    staging = staging_path(target)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    for item in source.iterdir():
        try:
            os.link(item, staging / item.name)
        except OSError:
            shutil.copyfile(item, staging / item.name)
    error = commit_folder(staging, target, None)
    if error is not None:
        raise CheckpointError(f"cannot link {source} as {target}: {error}")
    return target


__all__ = ["commit_folder", "link_tree", "remove_tree", "staging_path"]
