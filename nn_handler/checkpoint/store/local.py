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


class LocalStore:
    """The folder ``dir`` of one run's checkpoints (see CheckpointStore)."""

    uploads = False

    def __init__(self, dir: Path) -> None:
        self.dir = dir
        self._lease = Lease(FileLock(dir), str(dir))
        #: latest.json as this process last read or wrote it (rank 0): another job moving it
        #: since is told from this.
        self._seen_latest: Any = None
        self._runs: dict[tuple[Path, int], str | None] = {}

    @property
    def where(self) -> str:
        return str(self.dir)

    def location(self, path: Path) -> str:
        return str(path)

    def start(
        self, is_checkpoint_name: Callable[[str], bool], lead: bool = True
    ) -> CheckpointError | None:
        """Once, before use: the ``lead`` (rank 0 of the run that writes here) creates the
        folder, takes its lock and removes what killed saves left; any other reads what the
        store holds. Returns the error."""
        if not lead:
            return self._read_store()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._lease.acquire(os.environ)
            # Only once the folder is ours: another job's save may be in flight.
            for orphan in remove_orphans(self.dir):
                logger.bind(rank=0).warning("removed {} (left by an interrupted save)", orphan)
            self._start_store(is_checkpoint_name)
            self._seen_latest = self._stored_latest()
        except CheckpointError as caught:
            return caught
        except OSError as caught:
            return CheckpointError(
                f"cannot use the checkpoint folder {self.dir}: {caught.strerror or caught}."
            )
        return None

    def _start_store(self, is_checkpoint_name: Callable[[str], bool]) -> None:
        """What a store behind the folder checks at the start (nothing for a folder)."""

    def _read_store(self) -> CheckpointError | None:
        """What a reader learns of the store at its start (a plain folder: nothing, it is
        always read afresh)."""
        return None

    def release(self) -> None:
        self._lease.release()

    # ----------------------------------------------------------------- what is there
    def checkpoints(self) -> Mapping[Path, str | None]:
        """Every committed checkpoint with the run that wrote it (the one this process
        committed it for, else read from the checkpoint itself, memory-mapped, once per
        version of it, when asked; None: not known, so never this run's to delete)."""
        if not self.dir.is_dir():
            return {}
        found = [p for p in self.dir.iterdir() if is_checkpoint_name(p.name) and is_checkpoint(p)]
        return _Runs(sorted(found), self._run_of)

    def _run_of(self, path: Path) -> str | None:
        top = top_file(path)
        try:
            key = (top, top.stat().st_mtime_ns)
            if key not in self._runs:
                self._runs[key] = run_of(load_file(top, mmap=True, verify=False))[0]
        except (CheckpointError, OSError):
            return None  # unreadable: not known to be this run's, so kept
        return self._runs[key]

    def latest(self) -> Path | None:
        """The complete checkpoint latest.json names (None: none; an unreadable latest.json is
        said in a warning and names none)."""
        try:
            data = self._read_pointer()
            name = None if data is None else data["checkpoint"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            logger.warning("ignoring unreadable {}/{}: {}", self.where, LATEST, error)
            return None
        target = None if name is None else self.dir / str(name)
        return target if target is not None and target in self.checkpoints() else None

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
        """Point latest.json at ``pointer`` (rank 0), never backwards over another job's: a
        pointer that another writer moved since this process last saw it, to a later step
        than ``pointer``'s, is a CheckpointError, as a failed write is."""
        self._forward(self._stored_latest(), pointer)
        self._write_pointer(pointer)

    def _write_pointer(self, pointer: Mapping[str, Any]) -> None:
        """latest.json in the folder (the working copy's, for an object store)."""
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

    def flush(self) -> None:
        """Nothing runs in the background."""

    def remove(self, path: Path) -> None:
        remove_tree(path)

    def link(self, source: Path, target: Path) -> None:
        """Hard links (copies where links are not supported)."""
        if source.is_dir():
            link_tree(source, target)
        else:
            atomic_link(source, target)

    # ----------------------------------------------------------------- committing
    def staging(self, target: Path, folder: bool = False) -> Path:
        """Where the checkpoint ``target`` (a file, or a ``folder`` every rank writes into)
        is written before its commit."""
        return staging_path(target, folder)

    def prepare(self, name: str) -> None:
        """A local commit is a rename: nothing vouches for ``name`` before it."""

    def put(
        self, staging: Path, files: list[Path], name: str, known: dict[str, Entry] | None = None
    ) -> dict[str, Entry]:
        """The files are where they must be."""
        return {}

    def commit(
        self, target: Path, staging: Path, run: str | None, objects: dict[str, Entry] | None = None
    ) -> None:
        """Rank 0: ``staging`` becomes the checkpoint ``target`` by one rename; a folder gets
        its manifest first (``objects``: entries the writer or the uploads know, the rest
        checksummed here)."""
        if not staging.is_dir():
            commit_file(staging, target)
        else:
            manifest = folder_manifest(staging, target.name, run, objects or {})
            atomic_write_bytes(manifest.to_bytes(), staging / MANIFEST)
            commit_folder(staging, target)
        with contextlib.suppress(OSError):  # the run that wrote it: known, never read back
            top = top_file(target)
            self._runs[(top, top.stat().st_mtime_ns)] = run


class _Runs(Mapping[Path, "str | None"]):
    """Committed checkpoints, listed when made, and the run that wrote each, read when asked
    (a listing costs no read of the checkpoints it does not ask about)."""

    def __init__(self, paths: list[Path], run_of: Callable[[Path], str | None]) -> None:
        self._paths, self._known, self._run_of = paths, set(paths), run_of

    def __getitem__(self, path: Path) -> str | None:
        if path not in self._known:
            raise KeyError(path)
        return self._run_of(path)

    def __iter__(self) -> Iterator[Path]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


def folder_manifest(folder: Path, name: str, run: str | None, known: dict[str, Entry]) -> Manifest:
    """The manifest of the checkpoint ``name`` written in ``folder``: the ``known`` entries
    (the writer's, the uploads'), and every other file of it checksummed now."""
    objects = dict(known)
    for path in sorted(folder.iterdir()):
        key = f"{name}/{path.name}"
        if path.name != MANIFEST and path.is_file() and key not in objects:
            objects[key] = entry_of(path)
    return Manifest(name, {key: objects[key] for key in sorted(objects)}, run)


__all__ = ["LATEST", "LocalStore", "folder_manifest", "is_checkpoint"]
