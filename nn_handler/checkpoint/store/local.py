"""LocalStore: a run's checkpoints in a plain folder, where every change is a local rename,
link or deletion (checkpoint/store/files.py). A checkpoint is written into its staging path
and committed by one rename: a folder with its manifest written into it first, a single file
with torch's own zip directory (every record's size and CRC-32, written last by torch.save)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from loguru import logger

from nn_handler.checkpoint.format import is_checkpoint, top_file
from nn_handler.checkpoint.io import load_file
from nn_handler.checkpoint.manifest import MANIFEST, Entry, Manifest
from nn_handler.checkpoint.naming import is_checkpoint_name
from nn_handler.checkpoint.run_identity import run_of
from nn_handler.checkpoint.store.files import (
    atomic_link,
    atomic_write_bytes,
    atomic_write_json,
    commit_file,
    commit_folder,
    link_tree,
    remove_orphans,
    remove_tree,
    staging_path,
)
from nn_handler.checkpoint.store.lease import FileLock, Lease
from nn_handler.checkpoint.verify import entry_of
from nn_handler.errors import CheckpointError

LATEST = "latest.json"


class Listing(Mapping[Path, "str | None"]):
    """What a store holds: its committed checkpoints, each with the run that wrote it (read
    when asked: a listing costs no read of the checkpoints it is not asked about; None: not
    known, so never this run's to delete), and ``latest``, the one latest.json names."""

    def __init__(
        self,
        paths: list[Path],
        run_of: Callable[[Path], str | None],
        pointer: Callable[[], Any],
        where: str,
    ) -> None:
        self._paths, self._known, self._run_of = paths, set(paths), run_of
        self._pointer, self._where = pointer, where

    def __getitem__(self, path: Path) -> str | None:
        if path not in self._known:
            raise KeyError(path)
        return self._run_of(path)

    def __iter__(self) -> Iterator[Path]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)

    @property
    def latest(self) -> Path | None:
        """The committed checkpoint latest.json names (None: none; an unreadable latest.json
        is said in a warning and names none)."""
        try:
            data = self._pointer()
            name = None if data is None else data["checkpoint"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("ignoring unreadable {}/{}: {}", self._where, LATEST, error)
            return None
        found = [path for path in self._paths if path.name == name]
        return found[0] if found else None


class PointerGuard:
    """Keeps latest.json from moving backwards over another job's: ``seen`` is latest.json
    as this process last read or wrote it (the lead)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.seen: Any = None

    def forward(self, current: Any, pointer: Mapping[str, Any]) -> None:
        """Raise when ``current`` (latest.json now) was written by another job since this
        process last saw it and names a later step than ``pointer``; else remember
        ``pointer``. The pointer moving back by this process's own choice (a resume past a
        damaged checkpoint, ``resume: never`` over an older run) is allowed: it was seen."""
        seen, self.seen = self.seen, dict(pointer)
        if not isinstance(current, dict) or current == seen:
            return
        theirs, ours = current.get("global_step"), pointer.get("global_step")
        if isinstance(theirs, int) and isinstance(ours, int) and theirs > ours:
            self.seen = seen
            raise CheckpointError(
                f"{self.where}/{LATEST} names {current.get('checkpoint')} (step {theirs}), "
                f"written by another job since this one started; this run's step {ours} would "
                f"move it backwards. Two jobs are writing into {self.where}: stop one "
                f"(a checkpoint folder is one job's)."
            )


class LocalStore:
    """The folder ``dir`` of one run's checkpoints (see CheckpointStore)."""

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self.where = str(dir)
        self._lease = Lease(FileLock(dir), str(dir))
        self._pointer = PointerGuard(self.where)
        self._runs: dict[tuple[Path, int], str | None] = {}

    @contextlib.contextmanager
    def session(self, lead: bool) -> Iterator[None]:
        """The ``lead`` (rank 0 of the run that writes here) creates the folder, takes its
        lock and removes what killed saves left; the lock is given up on leaving. A folder
        is always read afresh: nothing else to learn."""
        if not lead:
            yield
            return
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lease.acquire(os.environ)
        except OSError as caught:
            raise CheckpointError(
                f"cannot use the checkpoint folder {self.dir}: {caught.strerror or caught}."
            ) from None
        try:
            # Only once the folder is ours: another job's save may be in flight.
            for orphan in remove_orphans(self.dir):
                logger.bind(rank=0).warning("removed {} (left by an interrupted save)", orphan)
            self._pointer.seen = self._stored_latest()
            yield
        finally:
            self._lease.release()

    def flush(self) -> None:
        """Nothing runs in the background."""

    # ----------------------------------------------------------------- what is there
    def checkpoints(self) -> Listing:
        """Every committed checkpoint with the run that wrote it (the one this process
        committed it for, else read from the checkpoint itself, memory-mapped, once per
        version of it, when asked), and the one latest.json names."""
        found = sorted(self.dir.iterdir()) if self.dir.is_dir() else []
        found = [p for p in found if is_checkpoint_name(p.name) and is_checkpoint(p)]
        return Listing(found, self._run_of, self._read_pointer, self.where)

    def _run_of(self, path: Path) -> str | None:
        top = top_file(path)
        try:
            key = (top, top.stat().st_mtime_ns)
            if key not in self._runs:
                self._runs[key] = run_of(load_file(top, mmap=True, verify=False))[0]
        except (CheckpointError, OSError):
            return None  # unreadable: not known to be this run's, so kept
        return self._runs[key]

    def _read_pointer(self) -> Any:
        """latest.json's contents (None: there is none); raises OSError or ValueError when it
        cannot be read."""
        try:
            return json.loads((self.dir / LATEST).read_text())
        except FileNotFoundError:
            return None

    def fetch(self, name: str) -> Path:
        """The checkpoint ``name`` on this machine: where it is."""
        return self.dir / name

    # ----------------------------------------------------------------- changing it
    def write_latest(self, pointer: Mapping[str, Any]) -> None:
        """Point latest.json at ``pointer`` (the lead), never backwards over another job's: a
        pointer that another writer moved since this process last saw it, to a later step
        than ``pointer``'s, is a CheckpointError, as a failed write is."""
        self._pointer.forward(self._stored_latest(), pointer)
        try:
            atomic_write_json(dict(pointer), self.dir / LATEST)
        except OSError as error:
            raise CheckpointError(f"cannot write {self.where}/{LATEST}: {error}") from error

    def _stored_latest(self) -> Any:
        """latest.json as stored now (None: none, or unreadable)."""
        try:
            return self._read_pointer()
        except (OSError, ValueError):
            return None

    def remove(self, path: Path) -> None:
        remove_tree(path)

    # ----------------------------------------------------------------- committing
    def staging(self, target: Path, folder: bool = False) -> Path:
        """Where the checkpoint ``target`` (a file, or a ``folder`` every rank writes into)
        is written before its commit (a local commit is a rename: nothing vouches for
        ``target`` before it)."""
        return staging_path(target, folder)

    def put(
        self, staging: Path, files: list[Path], name: str, known: dict[str, Entry] | None = None
    ) -> dict[str, Entry]:
        """The files are where they must be."""
        return {}

    def commit(
        self,
        target: Path,
        source: Path | str,
        run: str | None,
        objects: dict[str, Entry] | None = None,
    ) -> None:
        """The lead: the staging path ``source`` becomes the checkpoint ``target`` by one
        rename (a folder gets its manifest first: ``objects``, entries the writer knows, the
        rest checksummed here); or ``target`` becomes the committed checkpoint named
        ``source`` too (hard links; copies where links are not supported)."""
        if isinstance(source, str):
            copy = link_tree if (self.dir / source).is_dir() else atomic_link
            copy(self.dir / source, target)
        elif not source.is_dir():
            commit_file(source, target)
        else:
            manifest = folder_manifest(source, target.name, run, objects or {})
            atomic_write_bytes(manifest.to_bytes(), source / MANIFEST)
            commit_folder(source, target)
        with contextlib.suppress(OSError):  # the run that wrote it: known, never read back
            top = top_file(target)
            self._runs[(top, top.stat().st_mtime_ns)] = run


def folder_manifest(folder: Path, name: str, run: str | None, known: dict[str, Entry]) -> Manifest:
    """The manifest of the checkpoint ``name`` written in ``folder``: the ``known`` entries
    (the writer's, the uploads'), and every other file of it checksummed now."""
    objects = dict(known)
    for path in sorted(folder.iterdir()):
        key = f"{name}/{path.name}"
        if path.name != MANIFEST and path.is_file() and key not in objects:
            objects[key] = entry_of(path)
    return Manifest(name, {key: objects[key] for key in sorted(objects)}, run)


__all__ = ["LATEST", "Listing", "LocalStore", "PointerGuard", "folder_manifest", "is_checkpoint"]
