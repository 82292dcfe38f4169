"""CheckpointFolder: where one run's checkpoints live, a plain folder or an object store's
folder seen through its local working copy, with the storage operations the
CheckpointManager's policy (which to write, keep and resume) uses alike for both.

On a plain folder every change is a local rename, link or deletion. On an object store
(``config.dir`` a URL) the same change is made in the working copy and mirrored to the store
by a RemoteFolder (checkpoint/remote/folder.py): a checkpoint is uploaded and committed by its
manifest, ``latest.json`` follows; what the store has committed is what is trusted.
The operations that change the folder are rank 0's unless their docstring says otherwise.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from loguru import logger

from nn_handler.checkpoint import folder_lock
from nn_handler.checkpoint.io import atomic_link, atomic_write_json, remove_orphans
from nn_handler.checkpoint.sharded import is_sharded, link_tree, remove_tree
from nn_handler.checkpoint.source import Opened, open_checkpoint
from nn_handler.config.checkpoint import CheckpointConfig, is_url
from nn_handler.errors import CheckpointError

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from nn_handler.checkpoint.remote.folder import RemoteFolder

LATEST = "latest.json"


def is_checkpoint(path: Path) -> bool:
    """A complete checkpoint: a file, or a committed sharded folder."""
    return path.is_file() or is_sharded(path)


class CheckpointFolder:
    """The folder ``config.dir`` of one run's checkpoints (``dir``: the local folder, an object
    store's working copy when ``remote`` is set)."""

    def __init__(self, config: CheckpointConfig) -> None:
        #: The object store's folder when ``config.dir`` is a URL; None for a plain folder.
        self.remote = _remote_folder(config) if is_url(config.dir) else None
        self.dir = self.remote.local if self.remote is not None else Path(str(config.dir))
        self._locked = False
        #: latest.json as this process last read or wrote it (rank 0): another job moving it
        #: since is told from this.
        self._seen_latest: Any = None

    @property
    def where(self) -> str:
        """The folder as the user named it (a URL for an object store)."""
        return self.remote.url if self.remote is not None else str(self.dir)

    def location(self, path: Path) -> str:
        """Where the checkpoint ``path`` lives, as the user names it: on an object store its
        URL, not the working copy's path. What logs, errors and reports say."""
        return self.remote.store.url_of(path.name) if self.remote is not None else str(path)

    def start(self, is_checkpoint_name: Callable[[str], bool]) -> CheckpointError | None:
        """Rank 0, once: create the folder, take its lock, remove what killed saves left (on a
        store: check it can be written and delete uncommitted uploads). Returns the error."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            folder_lock.acquire(self.dir, os.environ)
            self._locked = True
            # Only once the folder is ours: another job's save may be in flight.
            for orphan in remove_orphans(self.dir):
                logger.bind(rank=0).warning("removed {} (left by an interrupted save)", orphan)
            if self.remote is not None:
                for stale in self.remote.start(is_checkpoint_name):
                    logger.bind(rank=0).warning(
                        "removed {} (an upload interrupted before its commit)",
                        self.remote.store.url_of(stale),
                    )
            self._seen_latest = self._stored_latest()
        except CheckpointError as caught:
            return caught
        except OSError as caught:
            return CheckpointError(
                f"cannot use the checkpoint folder {self.dir}: {caught.strerror or caught}."
            )
        return None

    def refresh(self) -> None:
        """Read again what the store holds (a plain folder is always read afresh). Every rank
        but 0 does at the start, so that every rank names checkpoints alike."""
        if self.remote is not None:
            self.remote.refresh()

    def release(self) -> None:
        """Wait for uploads still running and give up the lock. Every rank may call it."""
        if self.remote is not None:
            self.remote.close()
        if self._locked:
            folder_lock.release(self.dir)
            self._locked = False

    # ----------------------------------------------------------------- what is there
    def exists(self, path: Path) -> bool:
        """Whether ``path`` is a complete checkpoint (on a store: a committed one)."""
        if self.remote is not None:
            return path.name in self.remote.names()
        return is_checkpoint(path)

    def entries(self) -> list[Path]:
        """Every complete checkpoint of the folder."""
        if self.remote is not None:
            return [self.dir / name for name in self.remote.names()]
        if not self.dir.is_dir():
            return []
        return [path for path in self.dir.iterdir() if is_checkpoint(path)]

    def read_latest(self) -> Any:
        """latest.json's contents (None: there is none); raises OSError or ValueError when it
        cannot be read."""
        if self.remote is not None:
            return self.remote.latest()
        try:
            return json.loads((self.dir / LATEST).read_text())
        except FileNotFoundError:
            return None

    def owner(self, path: Path) -> tuple[bool, str | None]:
        """(known, the run id) of the checkpoint at ``path`` where the store's manifest says;
        (False, None): read it from the checkpoint itself."""
        if self.remote is not None and path.name in self.remote.names():
            return True, self.remote.owner(path.name)
        return False, None

    def open(self, path: str | Path, map_location: torch.device | str | None = None) -> Opened:
        """Read the checkpoint at ``path`` (on a store: the committed one of that name,
        downloaded into the working copy where missing or changed, every object checked).
        Any rank."""
        if self.remote is not None:
            local = self.remote.fetch(Path(path).name)
            return open_checkpoint(local, map_location, where=self.location(local), verified=True)
        return open_checkpoint(path, map_location)

    # ----------------------------------------------------------------- changing it
    def write_latest(self, pointer: Mapping[str, Any]) -> None:
        """Point latest.json at ``pointer`` (rank 0), never backwards over another job's: a
        pointer that another writer moved since this process last saw it, to a later step
        than ``pointer``'s, is a CheckpointError (on a store, at the next flush)."""
        if self.remote is not None:
            atomic_write_json(dict(pointer), self.dir / LATEST)  # the working copy's
            self.remote.point_latest(pointer, lambda current: self._forward(current, pointer))
            return
        self._forward(self._stored_latest(), pointer)
        atomic_write_json(dict(pointer), self.dir / LATEST)

    def _stored_latest(self) -> Any:
        """latest.json as stored now (None: none, or unreadable)."""
        try:
            if self.remote is not None:
                data = self.remote.store.read(LATEST)
                return None if data is None else json.loads(data)
            return json.loads((self.dir / LATEST).read_text())
        except (OSError, ValueError):
            return None

    def _forward(self, current: Any, pointer: Mapping[str, Any]) -> None:
        """Raise when ``current`` (latest.json now) was written by another job since this
        process last saw it and names a later step than ``pointer``; else remember
        ``pointer``. The pointer moving back by this process's own choice (a resume past a
        damaged checkpoint, ``resume: never`` over an older run) is allowed: it was seen."""
        seen, self._seen_latest = self._seen_latest, dict(pointer)
        if not isinstance(current, dict) or current == seen:
            return
        theirs, ours = current.get("global_step"), pointer.get("global_step")
        if isinstance(theirs, int) and isinstance(ours, int) and theirs > ours:
            self._seen_latest = seen
            raise CheckpointError(
                f"{self.where}/{LATEST} names {current.get('checkpoint')} (step {theirs}), "
                f"written by another job since this one started; this run's step {ours} would "
                f"move it backwards. Two jobs are writing into {self.where}: stop one "
                f"(a checkpoint folder is one job's)."
            )

    def upload(self, path: Path, run_id: str | None) -> None:
        """On a store, upload and commit the single-file checkpoint ``path``."""
        if self.remote is not None:
            self.remote.publish(path, run_id)

    def flush(self) -> None:
        """Wait for the store's changes still running in the background; raises the first
        failure as CheckpointError. Any rank."""
        if self.remote is not None:
            self.remote.flush()

    def remove(self, path: Path) -> None:
        """Delete a checkpoint (on a store too: its manifest first)."""
        remove_tree(path)
        if self.remote is not None:
            self.remote.remove(path.name)

    def link(self, source: Path, target: Path) -> None:
        """``target`` becomes the checkpoint ``source`` too: hard links (copies where links are
        not supported); on a store, a server-side copy committed by its own manifest."""
        if source.is_dir():
            link_tree(source, target)
        elif source.exists() or self.remote is None:
            atomic_link(source, target)
        if self.remote is not None:
            self.remote.copy(source.name, target.name)


def _remote_folder(config: CheckpointConfig) -> RemoteFolder:
    from nn_handler.checkpoint.remote.folder import RemoteFolder, working_copy

    url = str(config.dir)
    return RemoteFolder(
        url,
        working_copy(url, config.staging_dir),
        config.storage_options,
        workers=config.upload_workers,
        background=config.async_save,
        timeout_s=config.store_timeout_s,
    )


__all__ = ["LATEST", "CheckpointFolder", "is_checkpoint"]
