"""ObjectStore: a run's checkpoints on an object store (``checkpoint.dir`` a URL), written into
a local working copy exactly as into a folder (LocalStore, which it extends: the same staging
and rename there) and committed on the store by checkpoint/store/remote_protocol.py: every
object uploaded, then the manifest ``<name>.manifest.json``; ``latest.json`` follows. What the
store has committed is what is trusted, and what a user is told (its URL, never the working
copy's path). The changes to the store (commits, the pointer, deletions, copies) run in order
on one thread: at once, or in the background with ``async_save``, where ``flush`` waits for
them and raises the first failure."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loguru import logger

from nn_handler.checkpoint.manifest import MANIFEST, Entry, Manifest, manifest_name
from nn_handler.checkpoint.store import remote_protocol as protocol
from nn_handler.checkpoint.store.files import (
    atomic_link,
    atomic_write_bytes,
    link_tree,
    remove_tree,
)
from nn_handler.checkpoint.store.lease import DEFAULT_LEASE_S, Lease, ObjectLock
from nn_handler.checkpoint.store.local import LATEST, LocalStore
from nn_handler.checkpoint.store.remote_store import RemoteStore
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.errors import CheckpointError


class ObjectStore(LocalStore):
    """The object store's folder ``config.dir`` through its working copy ``dir``."""

    uploads = True

    def __init__(self, config: CheckpointConfig) -> None:
        url = str(config.dir)
        self.store = RemoteStore(
            url, config.storage_options, first_wait_s=config.store_retry_wait_s,
            timeout_s=config.store_timeout_s,
        )  # fmt: skip
        super().__init__(working_copy(self.store.url, config.staging_dir))
        self.workers = config.upload_workers
        self.background = config.async_save
        # The committed checkpoints as this process knows them. Only this thread adds or
        # removes names; the store's thread replaces the entry of a name already there (so
        # ``entries`` never sees the dict change size while it iterates).
        self._known: dict[str, Manifest] = {}
        self._thread = ThreadPoolExecutor(1, "nn_handler-remote")
        self._pending: list[Future[None]] = []
        self._failure: BaseException | None = None
        self._store_lease = Lease(ObjectLock(self.store), self.store.url, DEFAULT_LEASE_S)

    @property
    def where(self) -> str:
        return self.store.url

    def location(self, path: Path) -> str:
        return self.store.url_of(path.name)

    def _start_store(self, is_checkpoint_name: Callable[[str], bool]) -> None:
        """Check that the store can be written (a clear error now, before training, for a
        missing bucket or refused credentials), take its lease (one live job per folder),
        read its committed checkpoints and delete the objects of incomplete ones."""
        self.store.check()
        self._store_lease.acquire(os.environ)  # before deleting: no other job uploads here
        self._known, listing = protocol.read_manifests(self.store, _warn)
        for stale in protocol.incomplete(listing, self._known, is_checkpoint_name):
            self.store.remove(stale)
            logger.bind(rank=0).warning(
                "removed {} (an upload interrupted before its commit)", self.store.url_of(stale)
            )

    def _read_store(self) -> CheckpointError | None:
        """A reader's start: the committed checkpoints, from their manifests (once this
        process's own changes have landed)."""
        try:
            self.flush()
            self._known, _ = protocol.read_manifests(self.store, _warn)
        except CheckpointError as caught:
            return caught
        return None

    def release(self) -> None:
        """Wait for the background changes (a failure is logged), then give up the lease."""
        try:
            self.flush()
        except Exception as error:
            logger.error("the last checkpoint upload to {} failed: {}", self.where, error)
        finally:
            self._thread.shutdown(wait=True)
            self._store_lease.release()
        super().release()

    # ----------------------------------------------------------------- what is there
    def checkpoints(self) -> Mapping[Path, str | None]:
        """Every checkpoint committed on the store, with the run its manifest records."""
        return {self.dir / name: self._known[name].run for name in sorted(self._known)}

    def _read_pointer(self) -> Any:
        """The contents of ``latest.json`` on the store (None: none); ValueError when it
        cannot be read."""
        self.flush()
        data = self.store.read(LATEST)
        return None if data is None else json.loads(data)

    def fetch(self, name: str) -> Path:
        """The committed checkpoint ``name`` in the working copy, downloaded where missing or
        changed, every object checked as it arrives (not again when loaded); a
        CheckpointError names the object that is missing or changed."""
        self.flush()
        key = manifest_name(name)
        data = self.store.read(key)
        if data is None:
            raise CheckpointError(
                f"checkpoint {self.store.url_of(name)} is not committed (no {key}): an upload "
                f"was interrupted; use an earlier one."
            )
        manifest = Manifest.from_bytes(data, self.store.url_of(key))
        try:
            protocol.vouches_for(manifest, name, self.store.url_of(key))
        except CheckpointError as error:
            raise CheckpointError(f"{error}: it was refused.") from None
        local = protocol.fetch(self.store, manifest, self.dir, self.workers)
        if local.is_dir() and f"{name}/{MANIFEST}" not in manifest.objects:
            atomic_write_bytes(manifest.to_bytes(), local / MANIFEST)  # a local checkpoint too
        return local

    # ----------------------------------------------------------------- changing it
    def write_latest(self, pointer: Mapping[str, Any]) -> None:
        """The working copy's latest.json, then the store's once the changes before it have
        landed (never backwards over another job's: checked then, raised at the next
        flush)."""
        self._write_pointer(pointer)
        body = (json.dumps(dict(pointer), indent=1) + "\n").encode()

        def task() -> None:
            self._forward(self._stored_latest(), pointer)
            self.store.write(LATEST, body)

        self._submit(task)

    def _stored_latest(self) -> Any:
        """latest.json as the store holds it now (None: none or unreadable)."""
        data = self.store.read(LATEST)
        try:
            return None if data is None else json.loads(data)
        except ValueError:
            return None

    def flush(self) -> None:
        """Wait for the changes still running in the background; raise the first failure."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.exception()  # waits
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    def remove(self, path: Path) -> None:
        """The working copy's, then the store's (its manifest first)."""
        remove_tree(path)
        name = path.name
        self._known.pop(name, None)

        def task() -> None:
            data = self.store.read(manifest_name(name))
            if data is not None:
                where = self.store.url_of(manifest_name(name))
                protocol.remove(self.store, Manifest.from_bytes(data, where))

        self._submit(task)

    def link(self, source: Path, target: Path) -> None:
        """In the working copy where ``source`` is there; on the store, a server-side copy
        committed by its own manifest."""
        if source.is_dir():
            link_tree(source, target)
        elif source.exists():
            atomic_link(source, target)
        known = self._known.get(source.name)
        self._known[target.name] = Manifest(target.name, {}, None if known is None else known.run)

        def task() -> None:
            data = self.store.read(manifest_name(source.name))
            if data is None:
                raise CheckpointError(f"cannot copy {self.location(source)}: not committed.")
            original = Manifest.from_bytes(data, self.store.url_of(manifest_name(source.name)))
            self._learned(protocol.copy(self.store, original, target.name))

        self._submit(task)

    # ----------------------------------------------------------------- committing
    def prepare(self, name: str) -> None:
        """Before the checkpoint ``name`` is uploaded again (a run resumed before a
        checkpoint that its killed predecessor committed writes that name anew): its
        manifest goes first, once the changes before it have landed, so that an old
        manifest never describes new objects. Waits; raises the first failure. A name not
        committed (every periodic one) costs no request: a manifest that the start could not
        read vouches for nothing, and the commit replaces it."""
        committed = self._known.pop(name, None) is not None
        self.flush()
        if committed:
            self.store.remove(manifest_name(name))

    def put(
        self, staging: Path, files: list[Path], name: str, known: dict[str, Entry] | None = None
    ) -> dict[str, Entry]:
        """Upload this rank's ``files`` of the folder being written in ``staging`` as the
        checkpoint ``name``'s objects now, several at once; their entries (``known``'s, by
        file name, where the writer checksummed them). A single file is uploaded by its
        commit (in the background with ``async_save``)."""
        if not staging.is_dir():
            return {}
        objects = {f"{name}/{path.name}": path for path in files}
        entries = {f"{name}/{file}": entry for file, entry in (known or {}).items()}
        return protocol.upload(self.store, objects, self.workers, entries)

    def commit(
        self, target: Path, staging: Path, run: str | None, objects: dict[str, Entry] | None = None
    ) -> None:
        """Committed in the working copy (LocalStore.commit), then on the store: a single file
        uploaded, then the manifest (a folder's ``objects`` were put already), after the
        changes before it (in the background with ``async_save``)."""
        single = not staging.is_dir()
        super().commit(target, staging, run, objects)
        name = target.name
        self._known[name] = Manifest(name, {}, run)
        uploaded = objects or {}

        def task() -> None:
            found = uploaded
            if single:
                self.store.remove(manifest_name(name))  # see ``prepare``
                found = protocol.upload(self.store, {name: target}, self.workers)
            manifest = Manifest(name, found, run)
            protocol.commit(self.store, manifest)
            self._learned(manifest)

        self._submit(task)

    def _learned(self, manifest: Manifest) -> None:
        if manifest.name in self._known:  # (see __init__: never adds a name)
            self._known[manifest.name] = manifest

    def _submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` after the changes before it; once one failed, the later ones are
        dropped until ``flush`` reports it (``latest.json`` never names a failed upload)."""

        def guarded() -> None:
            if self._failure is not None:
                return
            try:
                self._store_lease.check_held()  # another job took the folder: write nothing
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


def default_working_copy(url: str, env: Mapping[str, str]) -> Path:
    """Where the working copy of ``url`` goes unless ``checkpoint.staging_dir`` says: under
    ``$XDG_CACHE_HOME`` (``~/.cache``) / nn_handler / checkpoints / the URL as a path."""
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    parts = [re.sub(r"[^A-Za-z0-9._-]+", "_", part) for part in url.split("/") if part]
    safe = [part if part.strip(".") else "_" for part in parts]  # never '.' or '..'
    return Path(cache, "nn_handler", "checkpoints", *safe)


def working_copy(url: str, staging_dir: str | None) -> Path:
    return Path(staging_dir) if staging_dir else default_working_copy(url, os.environ)


def _warn(text: str) -> None:
    logger.warning(text)


__all__ = ["ObjectStore", "default_working_copy", "working_copy"]
