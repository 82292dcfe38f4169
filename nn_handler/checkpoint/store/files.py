"""A local file system's commits, the only place checkpoint code renames: a file or folder is
written into a staging path beside its target, fsynced, then made the target by one rename
(a kill at any moment leaves the old one or the new one), and the folder is fsynced. With
the links, deletions and leftovers' cleanup that the local stores use."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nn_handler.checkpoint.io import SaveCancelled, write_file
from nn_handler.errors import CheckpointError

#: In the name of every staging file or folder (what ``remove_orphans`` deletes).
TMP_MARKER = ".tmp-"
_FOLDER_STAGING = f"{TMP_MARKER}sharded"


def staging_path(target: Path, folder: bool = False) -> Path:
    """Where ``target`` is written before its commit: a file is this process's own, a folder
    every rank's."""
    suffix = _FOLDER_STAGING if folder else f"{TMP_MARKER}{os.getpid()}"
    return target.with_name(f".{target.name}{suffix}")


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - Windows
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some network file systems
        pass
    finally:
        os.close(fd)


def commit_file(staging: Path, target: Path, cancel: threading.Event | None = None) -> None:
    """The fsynced file ``staging`` becomes ``target`` (one rename, made durable); with
    ``cancel`` set, it is removed instead and SaveCancelled raised."""
    try:
        if cancel is not None and cancel.is_set():
            raise SaveCancelled(f"the save to {target} was cancelled before it was committed")
        os.replace(staging, target)
    except BaseException:
        with contextlib.suppress(OSError):
            staging.unlink()
        raise
    fsync_dir(target.parent)


def commit_folder(staging: Path, target: Path) -> None:
    """The staging folder becomes ``target`` in one rename (an older folder of that name is
    moved aside first and removed after)."""
    old = target.with_name(f".{target.name}{TMP_MARKER}replaced")
    if target.exists():
        if old.exists():
            shutil.rmtree(old)
        os.replace(target, old)
    os.replace(staging, target)
    fsync_dir(target.parent)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _atomic(target: Path) -> Iterator[Path]:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_path(target)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    commit_file(tmp, target)


def atomic_save(obj: Any, path: str | Path, cancel: threading.Event | None = None) -> Path:
    """``torch.save(obj)`` to ``path`` atomically and durably; returns the path. With
    ``cancel`` (set from another thread) the save stops at its next write, ``path`` is
    untouched and SaveCancelled is raised."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(target)
    write_file(obj, staging, cancel, name=target)
    commit_file(staging, target, cancel)
    return target


def atomic_write_json(data: Any, path: str | Path) -> Path:
    """Write ``data`` as JSON to ``path`` atomically and durably."""
    return atomic_write_bytes((json.dumps(data, indent=1) + "\n").encode(), path)


def atomic_write_bytes(data: bytes, path: str | Path) -> Path:
    """Write ``data`` to ``path`` atomically and durably."""
    target = Path(path)
    with _atomic(target) as tmp:
        tmp.write_bytes(data)
    return target


def atomic_link(source: str | Path, path: str | Path) -> Path:
    """Make ``path`` name the same file as ``source`` (a hard link, replaced atomically; a
    copy where hard links are not supported)."""
    target = Path(path)
    with _atomic(target) as tmp:
        try:
            os.link(source, tmp)
        except OSError:
            shutil.copyfile(source, tmp)
    return target


def link_tree(source: Path, target: Path) -> Path:
    """Make the folder ``target`` hold the same files as the folder ``source`` (hard links;
    copies where links are not supported), replacing ``target`` as one rename."""
    staging = staging_path(target, folder=True)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        for item in source.iterdir():
            try:
                os.link(item, staging / item.name)
            except OSError:
                shutil.copyfile(item, staging / item.name)
        commit_folder(staging, target)
    except OSError as error:
        raise CheckpointError(f"cannot link {source} as {target}: {error}") from error
    return target


def remove_tree(path: Path) -> None:
    """Delete a checkpoint file or folder (missing is fine)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def remove_orphans(folder: str | Path) -> list[Path]:
    """Delete the staging files and folders left in ``folder`` by writers killed mid-save.
    Call it only when no save into ``folder`` is in flight (the store's start does, on rank
    0). Returns the removed paths."""
    base = Path(folder)
    if not base.is_dir():
        return []
    removed = []
    for candidate in base.iterdir():
        if candidate.name.startswith(".") and TMP_MARKER in candidate.name:
            with contextlib.suppress(OSError):
                remove_tree(candidate)
                removed.append(candidate)
    return removed


__all__ = [
    "TMP_MARKER",
    "atomic_link",
    "atomic_save",
    "atomic_write_bytes",
    "atomic_write_json",
    "commit_file",
    "commit_folder",
    "fsync_dir",
    "link_tree",
    "remove_orphans",
    "remove_tree",
    "staging_path",
]
