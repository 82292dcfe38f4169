"""RemoteFolder: a run's checkpoint folder on an object store, seen through a local working copy.

Checkpoints are written to the local working copy exactly as to a plain folder (atomically,
with their checksums), then uploaded and committed (checkpoint/remote/commit.py). The
operations that change the store (upload, commit, the ``latest.json`` pointer, deletions,
copies) run in order on one thread: at once, or in the background with ``background``, where
``flush`` waits for them and raises the first failure. Loading downloads a committed
checkpoint into the working copy (what is already there and matches is kept) and checks every
object against its manifest.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

from nn_handler.checkpoint.manifest import SUFFIX, Entry, Manifest, manifest_name
from nn_handler.checkpoint.remote import commit as protocol
from nn_handler.checkpoint.remote.lock import StoreLock
from nn_handler.checkpoint.remote.store import DEFAULT_TIMEOUT_S, RemoteStore
from nn_handler.errors import CheckpointError

if TYPE_CHECKING:
    from nn_handler.distributed.communicator import Communicator

LATEST = "latest.json"
SUFFIX_HINT = f"<name>{SUFFIX}"


def default_working_copy(url: str, env: Mapping[str, str]) -> Path:
    """Where the working copy of ``url`` goes unless ``checkpoint.staging_dir`` says: under
    ``$XDG_CACHE_HOME`` (``~/.cache``) / nn_handler / checkpoints / the URL as a path."""
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    parts = [re.sub(r"[^A-Za-z0-9._-]+", "_", part) for part in url.split("/") if part]
    safe = [part if part.strip(".") else "_" for part in parts]  # never '.' or '..'
    return Path(cache, "nn_handler", "checkpoints", *safe)


class RemoteFolder:
    """The checkpoint folder ``url`` with its local working copy ``local``.

    Args:
        url: the folder on the object store.
        local: the working copy (a local folder; ranks of one machine share it).
        storage_options: for the fsspec filesystem (never logged).
        workers: objects uploaded or downloaded at once per process.
        background: changes to the store run in the background (``flush`` waits).
        timeout_s: the connect and read timeout of every request to the store.
    """

    def __init__(
        self,
        url: str,
        local: Path,
        storage_options: Mapping[str, Any] | None = None,
        workers: int = 8,
        background: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.store = RemoteStore(url, storage_options, timeout_s=timeout_s)
        self.url = self.store.url
        self.local = local
        self.workers = workers
        self.background = background
        # The committed checkpoints as this process knows them. Only this thread adds or
        # removes names; the store's thread replaces the entry of a name already there (so
        # ``names`` never sees the dict change size while it iterates).
        self._known: dict[str, Manifest] = {}
        self._thread = ThreadPoolExecutor(1, "nn_handler-remote")
        self._pending: list[Future[None]] = []
        self._failure: BaseException | None = None
        self._lock: StoreLock | None = None  # rank 0's lease on the folder (``start``)

    # ----------------------------------------------------------------- the store's state
    def start(self, is_checkpoint: Callable[[str], bool]) -> list[str]:
        """Check that the folder can be written (a clear error now, before training, for a
        missing bucket or refused credentials), take its lease (one live job per folder:
        checkpoint/remote/lock.py), read its committed checkpoints, and delete the objects of
        incomplete ones. Rank 0, once, at the start; returns what it deleted."""
        self.store.check()
        self._lock = StoreLock(self.store)
        self._lock.acquire(os.environ)  # before deleting anything: no other job uploads here
        self._known, listing = protocol.read_manifests(self.store, _warn)
        stale = protocol.incomplete(listing, self._known, is_checkpoint)
        for key in stale:
            self.store.remove(key)
        return stale

    def refresh(self) -> dict[str, Manifest]:
        """Read the committed checkpoints from the store (after pending changes land)."""
        self.flush()
        self._known, _ = protocol.read_manifests(self.store, _warn)
        return dict(self._known)

    def names(self) -> list[str]:
        """The committed checkpoints, as this process knows them (its own changes included)."""
        return sorted(self._known)

    def owner(self, name: str) -> str | None:
        known = self._known.get(name)
        return None if known is None else known.run

    def latest(self) -> Any:
        """The contents of ``latest.json`` on the store (None: there is none)."""
        self.flush()
        data = self.store.read(LATEST)
        if data is None:
            return None
        try:
            return json.loads(data)
        except ValueError as error:
            logger.warning("ignoring unreadable {}: {}", self.store.url_of(LATEST), error)
            return None

    # ----------------------------------------------------------------- changing it
    def upload(self, local: Path, files: list[Path] | None = None, name: str | None = None
               ) -> dict[str, Entry]:  # fmt: skip
        """Upload this process's objects of the local checkpoint ``local`` (all of a file or
        folder, or the folder's ``files``) now, as the checkpoint ``name`` (default: the
        local one's); returns their sizes and checksums."""
        objects = protocol.local_objects(local, files)
        if name is not None and name != local.name:
            objects = {name + key[len(local.name) :]: path for key, path in objects.items()}
        return protocol.upload(self.store, objects, self.workers)

    def publish(self, local: Path, run: str | None) -> None:
        """Upload the local checkpoint ``local`` (every object of it) and commit it."""
        name = local.name
        self._known[name] = Manifest(name, {}, run)

        def task() -> None:
            self.store.remove(manifest_name(name))  # see ``invalidate``
            objects = self.upload(local)
            self._commit(Manifest(name, objects, run))

        self._submit(task)

    def invalidate(self, name: str) -> None:
        """Before the checkpoint ``name`` is uploaded again (a run resumed before a
        checkpoint that its killed predecessor committed writes that name anew): remove its
        manifest, once the changes before it have landed, so that an old manifest never
        describes new objects. Waits for it; raises the first failure (``flush``)."""
        self._known.pop(name, None)
        self.flush()
        self.store.remove(manifest_name(name))

    def commit(self, name: str, objects: dict[str, Entry], run: str | None) -> None:
        """Commit the checkpoint ``name`` whose ``objects`` every rank has uploaded."""
        manifest = Manifest(name, objects, run)
        self._known[name] = manifest
        self._submit(lambda: self._commit(manifest))

    def _commit(self, manifest: Manifest) -> None:
        protocol.commit(self.store, manifest)
        if manifest.name in self._known:  # (see __init__: never adds a name)
            self._known[manifest.name] = manifest

    def point_latest(
        self, data: Mapping[str, Any], check: Callable[[Any], None] | None = None
    ) -> None:
        """Write ``latest.json`` once the changes before it have landed; ``check(current)``
        first, with what the store holds then (it raises to keep the pointer as it is)."""
        body = (json.dumps(dict(data), indent=1) + "\n").encode()

        def task() -> None:
            if check is not None:
                stored = self.store.read(LATEST)
                try:
                    current = None if stored is None else json.loads(stored)
                except ValueError:
                    current = None
                check(current)
            self.store.write(LATEST, body)

        self._submit(task)

    def remove(self, name: str) -> None:
        """Delete the committed checkpoint ``name`` (manifest first)."""
        self._known.pop(name, None)

        def task() -> None:
            data = self.store.read(manifest_name(name))
            if data is not None:
                where = self.store.url_of(manifest_name(name))
                protocol.remove(self.store, Manifest.from_bytes(data, where))

        self._submit(task)

    def copy(self, source: str, target: str) -> None:
        """Make ``target`` a committed copy of the checkpoint ``source``."""
        known = self._known.get(source)
        self._known[target] = Manifest(target, {}, None if known is None else known.run)

        def task() -> None:
            data = self.store.read(manifest_name(source))
            if data is None:
                raise CheckpointError(f"cannot copy {self.store.url_of(source)}: not committed.")
            where = self.store.url_of(manifest_name(source))
            copied = protocol.copy(self.store, Manifest.from_bytes(data, where), target)
            if target in self._known:  # (see __init__: never adds a name)
                self._known[target] = copied

        self._submit(task)

    def _submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` after the changes before it; once one failed, the later ones are
        dropped until ``flush`` reports it (``latest.json`` never names a failed upload)."""

        def guarded() -> None:
            if self._failure is not None:
                return
            try:
                task()
            except BaseException as error:
                self._failure = error
                raise

        future = self._thread.submit(guarded)
        if self.background:
            self._pending.append(future)
            return
        try:
            future.result()
        finally:
            self._failure = None  # raised here, to the caller: nothing left to report

    def flush(self) -> None:
        """Wait for the changes still running in the background; raise the first failure."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.exception()  # waits
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    @property
    def busy(self) -> bool:
        return any(not future.done() for future in self._pending)

    # ----------------------------------------------------------------- reading
    def fetch(self, name: str) -> Path:
        """The committed checkpoint ``name`` in the working copy, downloaded where missing or
        different, every object checked against the manifest (CheckpointError naming the one
        that is missing or changed)."""
        self.flush()
        data = self.store.read(manifest_name(name))
        if data is None:
            raise CheckpointError(
                f"checkpoint {self.store.url_of(name)} is not committed (no "
                f"{manifest_name(name)}): an upload was interrupted; use an earlier one."
            )
        manifest = Manifest.from_bytes(data, self.store.url_of(manifest_name(name)))
        if manifest.name != name:
            raise CheckpointError(
                f"{self.store.url_of(manifest_name(name))} describes {manifest.name!r}, "
                f"not {name!r}: it was refused."
            )
        return protocol.fetch(self.store, manifest, self.local, self.workers)

    def close(self) -> None:
        """Wait for the background changes, then stop the thread (failures are logged)."""
        try:
            self.flush()
        except Exception as error:
            logger.error("the last checkpoint upload to {} failed: {}", self.url, error)
        finally:
            self._thread.shutdown(wait=True)
            if self._lock is not None:
                self._lock.release()
                self._lock = None


def split_url(url: str) -> tuple[str, str]:
    """(the folder, the name) of a checkpoint's URL."""
    parent, _, name = url.rstrip("/").rpartition("/")
    return parent, name


def is_checkpoint_url(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> bool:
    """Whether ``url`` names one committed checkpoint (not a folder of them)."""
    parent, name = split_url(url)
    if "://" not in parent or parent.endswith(":/"):
        return False  # s3://bucket: a bucket is never a checkpoint
    store = RemoteStore(parent, storage_options, timeout_s=timeout_s)
    return store.read(manifest_name(name)) is not None


def fetch_url(
    url: str,
    storage_options: Mapping[str, Any] | None = None,
    staging_dir: str | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> tuple[Path, str]:
    """The checkpoint at ``url`` (a committed checkpoint, or a folder of them: the one its
    ``latest.json`` names) in a local working copy, every object checked against its
    manifest, and that checkpoint's URL. Raises CheckpointError when there is none or it
    does not match."""
    if is_checkpoint_url(url, storage_options, timeout_s):
        parent, name = split_url(url)
        local = working_copy(parent, staging_dir)
        store = RemoteFolder(parent, local, storage_options, timeout_s=timeout_s)
        return store.fetch(name), url.rstrip("/")
    folder = RemoteFolder(url, working_copy(url, staging_dir), storage_options, timeout_s=timeout_s)
    pointer = folder.latest()
    latest = pointer.get("checkpoint") if isinstance(pointer, dict) else None
    if not isinstance(latest, str):
        raise CheckpointError(
            f"no committed checkpoint at {url} (neither {SUFFIX_HINT} beside it nor a "
            f"latest.json under it)."
        )
    return folder.fetch(latest), folder.store.url_of(latest)


def save_to_store(
    comm: Communicator,
    url: str,
    write: Callable[[Path], Path],
    run_id: str | None,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Path:
    """Write a single-file checkpoint with ``write(local path)`` (every rank calls it; rank 0
    writes) into the working copy of ``url``'s folder, then upload and commit it as ``url``
    (rank 0). Every rank must call this; all raise the same CheckpointError on a failure.
    Returns the local copy."""
    from nn_handler.checkpoint.agreement import agree_on

    parent, name = split_url(url)
    if "://" not in parent or parent.endswith(":/") or not name:
        raise CheckpointError(f"{url} names no checkpoint inside a folder (s3://bucket/run/x.pt).")
    folder = RemoteFolder(parent, working_copy(parent, None), storage_options, timeout_s=timeout_s)
    try:
        local = write(folder.local / name)
        error: CheckpointError | None = None
        if comm.rank == 0:
            try:
                folder.publish(local, run_id)
            except CheckpointError as caught:
                error = caught
        with comm.patient():
            agree_on(comm, error, f"uploading checkpoint {url}")
    finally:
        folder.close()
    return local


def _warn(text: str) -> None:
    logger.warning(text)


def working_copy(url: str, staging_dir: str | None) -> Path:
    return Path(staging_dir) if staging_dir else default_working_copy(url, os.environ)


__all__ = [
    "LATEST",
    "RemoteFolder",
    "default_working_copy",
    "fetch_url",
    "save_to_store",
    "is_checkpoint_url",
    "split_url",
    "working_copy",
]
