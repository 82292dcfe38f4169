"""ObjectStore: checkpoints on an object store, written into a local working copy (a LocalStore)
and committed on the store by remote_protocol.py; what the store committed is trusted and
named by its URL. Changes run in the caller, or with ``async_save`` in order on the store's
thread, where ``flush`` waits for them and raises the first failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from loguru import logger

from nn_handler.checkpoint.manifest import MANIFEST, Entry, Manifest, manifest_name
from nn_handler.checkpoint.naming import is_checkpoint_name
from nn_handler.checkpoint.store import remote_protocol as protocol
from nn_handler.checkpoint.store.files import atomic_write_bytes
from nn_handler.checkpoint.store.lease import DEFAULT_LEASE_S, Lease, ObjectLock
from nn_handler.checkpoint.store.local import LATEST, Listing, LocalStore, PointerGuard
from nn_handler.checkpoint.store.remote_store import RemoteStore
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.errors import CheckpointError


class ObjectStore:
    """The object store's folder ``config.dir`` through its local working copy ``dir`` (a
    LocalStore: the same staging and rename there, then the commit on the store)."""

    def __init__(self, config: CheckpointConfig) -> None:
        url = str(config.dir)
        self.store = RemoteStore(
            url, config.storage_options, first_wait_s=config.store_retry_wait_s,
            timeout_s=config.store_timeout_s,
        )  # fmt: skip
        self.where = self.store.url
        self.copy = LocalStore(working_copy(self.store.url, config.staging_dir))
        self.dir = self.copy.dir
        self.workers = config.upload_workers
        self.background = config.async_save
        # The committed checkpoints as this process knows them in a session (None: outside
        # one, read afresh at every listing). Only this thread adds or removes names; the
        # store's thread replaces the entry of a name already there.
        self._known: dict[str, Manifest] | None = None
        self._lead = False
        self._pointer = PointerGuard(self.where)
        self._thread: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._failure: BaseException | None = None
        self._lease = Lease(ObjectLock(self.store), self.store.url, DEFAULT_LEASE_S)

    @contextlib.contextmanager
    def session(self, lead: bool) -> Iterator[None]:
        """The ``lead`` probes the store, takes its lease and deletes incomplete checkpoints;
        any other reads the committed ones. Leaving waits for running changes (a failure is
        logged) and gives the lease up."""
        with self.copy.session(lead):
            try:
                if lead:
                    self.store.check()
                    self._lease.acquire(os.environ)  # before deleting: no other job uploads
                known, listing = protocol.read_manifests(self.store, _warn)
                stale_ones = protocol.incomplete(listing, known, is_checkpoint_name)
                for stale in stale_ones if lead else []:
                    self.store.remove(stale)
                    logger.bind(rank=0).warning(
                        "removed {} (an upload interrupted before its commit)",
                        self.store.url_of(stale),
                    )
                self._known, self._lead = known, lead
                self._pointer.seen = self._stored_latest() if lead else None
                yield
            finally:
                try:
                    self.flush()
                except Exception as error:
                    logger.error("the last checkpoint upload to {} failed: {}", self.where, error)
                finally:
                    thread, self._thread, self._known, self._lead = self._thread, None, None, False
                    try:
                        if thread is not None:
                            thread.shutdown(wait=True)
                    finally:
                        self._lease.release()

    def flush(self) -> None:
        """Wait for the changes still running in the background; raise the first failure."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.exception()  # waits
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    # ----------------------------------------------------------------- what is there
    def checkpoints(self) -> Listing:
        """Every checkpoint committed on the store, with the run its manifest records, and the
        one the store's latest.json names."""
        known = self._known
        if known is None:  # outside a session: what the store holds now
            self.flush()
            known = protocol.read_manifests(self.store, _warn)[0]
        runs = {self.dir / name: known[name].run for name in sorted(known)}
        return Listing(list(runs), runs.__getitem__, self._read_pointer, self.where)

    def _read_pointer(self) -> Any:
        """The contents of ``latest.json`` on the store (None: none); ValueError when it
        cannot be read."""
        self.flush()
        data = self.store.read(LATEST)
        return None if data is None else json.loads(data)

    def _stored_latest(self) -> Any:
        """latest.json as the store holds it now (None: none or unreadable)."""
        data = self.store.read(LATEST)
        try:
            return None if data is None else json.loads(data)
        except ValueError:
            return None

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
        self.copy.write_latest(pointer)
        body = (json.dumps(dict(pointer), indent=1) + "\n").encode()

        def task() -> None:
            self._pointer.forward(self._stored_latest(), pointer)
            self.store.write(LATEST, body)

        self._submit(task)

    def remove(self, path: Path) -> None:
        """The working copy's, then the store's (its manifest first)."""
        self.copy.remove(path)
        name = path.name
        if self._known is not None:
            self._known.pop(name, None)

        def task() -> None:
            data = self.store.read(manifest_name(name))
            if data is not None:
                where = self.store.url_of(manifest_name(name))
                protocol.remove(self.store, Manifest.from_bytes(data, where))

        self._submit(task)

    # ----------------------------------------------------------------- committing
    def staging(self, target: Path, folder: bool = False) -> Path:
        """The working copy's staging path; on the lead, a committed folder of that name loses
        its manifest first, so an old manifest never describes new objects."""
        path = self.copy.staging(target, folder)
        if folder and self._lead and self._known is not None:
            committed = self._known.pop(target.name, None) is not None
            self.flush()
            if committed:
                self.store.remove(manifest_name(target.name))
        return path

    def put(
        self, staging: Path, files: list[Path], name: str, known: dict[str, Entry] | None = None
    ) -> dict[str, Entry]:
        """Upload this rank's ``files`` of a folder now; their entries (``known``'s where the
        writer checksummed them). A single file is uploaded by its commit."""
        if not staging.is_dir():
            return {}
        objects = {f"{name}/{path.name}": path for path in files}
        entries = {f"{name}/{file}": entry for file, entry in (known or {}).items()}
        return protocol.upload(self.store, objects, self.workers, entries)

    def commit(
        self,
        target: Path,
        source: Path | str,
        run: str | None,
        objects: dict[str, Entry] | None = None,
    ) -> None:
        """Commit in the working copy, then on the store after the changes before it: a single
        file's upload, then the manifest; a copy is made by the store with its own manifest."""
        name = target.name
        if isinstance(source, str):
            if (self.dir / source).exists():
                self.copy.commit(target, source, run)
            task = self._copy_task(source, name)
        else:
            single = not source.is_dir()
            self.copy.commit(target, source, run, objects)
            task = self._commit_task(target, single, run, objects or {})
        known = self._known if self._known is not None else {}
        known[name] = Manifest(name, {}, run)
        try:
            self._submit(task)
        except BaseException:
            known.pop(name, None)  # not committed on the store
            raise

    def _commit_task(
        self, target: Path, single: bool, run: str | None, uploaded: dict[str, Entry]
    ) -> Callable[[], None]:
        name = target.name

        def task() -> None:
            found = uploaded
            if single:
                self.store.remove(manifest_name(name))  # see ``staging``
                found = protocol.upload(self.store, {name: target}, self.workers)
            manifest = Manifest(name, found, run)
            protocol.commit(self.store, manifest)
            self._learned(manifest)

        return task

    def _copy_task(self, source: str, name: str) -> Callable[[], None]:
        def task() -> None:
            data = self.store.read(manifest_name(source))
            if data is None:
                raise CheckpointError(f"cannot copy {self.store.url_of(source)}: not committed.")
            original = Manifest.from_bytes(data, self.store.url_of(manifest_name(source)))
            self._learned(protocol.copy(self.store, original, name))

        return task

    def _learned(self, manifest: Manifest) -> None:
        known = self._known
        if known is not None and manifest.name in known:  # (see __init__: never adds a name)
            known[manifest.name] = manifest

    def _submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` now, or (``async_save``) after the changes before it in the store's
        thread; once one failed, the later ones are dropped until ``flush`` reports it
        (``latest.json`` never names a failed upload)."""

        def guarded() -> None:
            if self._failure is not None:
                return
            try:
                self._lease.check_held()  # another job took the folder: write nothing
                task()
            except BaseException as error:
                self._failure = error
                raise

        if not self.background:
            self._lease.check_held()
            task()
            return
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, "nn_handler-remote")
        self._pending.append(self._thread.submit(guarded))


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
