"""ObjectStore: a run's checkpoints on an object store (``checkpoint.dir`` a URL), written into
a local working copy exactly as into a folder (LocalStore, which it extends) and mirrored to
the store by a RemoteFolder (checkpoint/remote/folder.py): a checkpoint is uploaded and
committed by its manifest, ``latest.json`` follows; what the store has committed is what is
trusted, and what a user is told (its URL, never the working copy's path)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from nn_handler.checkpoint.folder_commit import link_tree, remove_tree
from nn_handler.checkpoint.io import atomic_link, atomic_write_json
from nn_handler.checkpoint.manifest import Entry
from nn_handler.checkpoint.remote.folder import RemoteFolder, working_copy
from nn_handler.checkpoint.source import Opened, open_checkpoint
from nn_handler.checkpoint.store.local import LATEST, LocalStore
from nn_handler.config.checkpoint import CheckpointConfig


class ObjectStore(LocalStore):
    """The object store's folder ``config.dir`` through its working copy ``dir``."""

    remote: RemoteFolder

    def _folder(self, config: CheckpointConfig) -> Path:
        url = str(config.dir)
        self.remote = RemoteFolder(
            url,
            working_copy(url, config.staging_dir),
            config.storage_options,
            workers=config.upload_workers,
            background=config.async_save,
            timeout_s=config.store_timeout_s,
        )
        return self.remote.local

    @property
    def where(self) -> str:
        return self.remote.url

    def location(self, path: Path) -> str:
        return self.remote.store.url_of(path.name)

    def _start_store(self, is_checkpoint_name: Callable[[str], bool]) -> None:
        """Check that the store can be written and delete uncommitted uploads."""
        for stale in self.remote.start(is_checkpoint_name):
            logger.bind(rank=0).warning(
                "removed {} (an upload interrupted before its commit)",
                self.remote.store.url_of(stale),
            )

    def refresh(self) -> None:
        self.remote.refresh()

    def release(self) -> None:
        """Wait for uploads still running, then give up the lock."""
        self.remote.close()
        super().release()

    # ----------------------------------------------------------------- what is there
    def exists(self, path: Path) -> bool:
        """Committed on the store."""
        return path.name in self.remote.names()

    def entries(self) -> list[Path]:
        return [self.dir / name for name in self.remote.names()]

    def read_latest(self) -> Any:
        return self.remote.latest()

    def owner(self, path: Path) -> tuple[bool, str | None]:
        """The run id its manifest records."""
        if path.name in self.remote.names():
            return True, self.remote.owner(path.name)
        return False, None

    def open(self, path: str | Path, map_location: torch.device | str | None = None) -> Opened:
        """The committed checkpoint of that name, downloaded into the working copy where
        missing or changed, every object checked as it arrives (not again when loaded)."""
        local = self.remote.fetch(Path(path).name)
        return open_checkpoint(local, map_location, where=self.location(local), verified=True)

    # ----------------------------------------------------------------- changing it
    def write_latest(self, pointer: Mapping[str, Any]) -> None:
        """The working copy's latest.json, then the store's once the changes before it have
        landed (never backwards over another job's: checked then, raised at the next
        flush)."""
        atomic_write_json(dict(pointer), self.dir / LATEST)
        self.remote.point_latest(pointer, lambda current: self._forward(current, pointer))

    def _stored_latest(self) -> Any:
        try:
            data = self.remote.store.read(LATEST)
            return None if data is None else json.loads(data)
        except (OSError, ValueError):
            return None

    def upload(self, path: Path, run_id: str | None) -> None:
        """Upload and commit the single-file checkpoint ``path``."""
        self.remote.publish(path, run_id)

    def flush(self) -> None:
        self.remote.flush()

    def remove(self, path: Path) -> None:
        """The working copy's, then the store's (its manifest first)."""
        remove_tree(path)
        self.remote.remove(path.name)

    def link(self, source: Path, target: Path) -> None:
        """In the working copy where ``source`` is there; on the store, a server-side copy
        committed by its own manifest."""
        if source.is_dir():
            link_tree(source, target)
        elif source.exists():
            atomic_link(source, target)
        self.remote.copy(source.name, target.name)

    # ----------------------------------------------------------------- a folder checkpoint
    uploads = True

    def prepare(self, name: str) -> None:
        """Its old manifest goes first (RemoteFolder.invalidate)."""
        self.remote.invalidate(name)

    def put(self, folder: Path, files: list[Path], name: str) -> dict[str, Entry]:
        """Upload them now, several at once."""
        return self.remote.upload(folder, files, name=name)

    def commit(self, name: str, objects: dict[str, Entry], run: str | None) -> None:
        """Its manifest, written after the changes before it (in the background with
        ``async_save``)."""
        self.remote.commit(name, objects, run)


__all__ = ["ObjectStore"]
