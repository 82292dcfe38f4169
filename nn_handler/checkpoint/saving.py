"""SaveRoute: the one way every checkpoint is saved, a single file or a sharded folder, into a
local folder or an object store, now or in the background::

    store.staging(target) -> writer: this rank's files (rank 0's one file, or every rank's
    shards) -> store.put (an object store uploads them) -> rank 0 gathers every rank's
    entries, or its refusal -> store.commit(target) -> then(target) (the policy: latest.json,
    rotation) -> every rank agrees on the outcome

Writers know nothing of stores; one save is in flight at most (a background one's write and
put run in the route's thread; the next save, or ``wait``, commits it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.manifest import Entry
from nn_handler.checkpoint.store import location
from nn_handler.checkpoint.store.files import staging_path
from nn_handler.checkpoint.writing import CheckpointWriter, WriteJob, Written
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from nn_handler.checkpoint.store import CheckpointStore


@dataclass
class _Pending:
    target: Path
    staging: Path
    writer: CheckpointWriter
    run: str | None
    then: Callable[[Path], None] | None
    future: Future[tuple[Written, dict[str, Entry]]] | None = None


class SaveRoute:
    """Saves checkpoints into ``store`` (every rank calls every method at the same point)."""

    def __init__(
        self, comm: Communicator, store: CheckpointStore, where: str | None = None
    ) -> None:
        self.comm = comm
        self.store = store
        #: The store as the user names it (None: its local folder).
        self.where = str(store.dir) if where is None else where
        self._pending: _Pending | None = None
        self._thread: ThreadPoolExecutor | None = None

    @property
    def pending(self) -> Path | None:
        """The checkpoint saved in the background and not yet committed (None: none)."""
        return None if self._pending is None else self._pending.target

    @property
    def writing(self) -> bool:
        """Whether a background save's files are still being written or put."""
        future = None if self._pending is None else self._pending.future
        return future is not None and not future.done()

    def save(
        self,
        target: Path,
        writer: CheckpointWriter,
        contents: Any,
        *,
        run: str | None = None,
        budget_s: float | None = None,
        background: bool = False,
        then: Callable[[Path], None] | None = None,
    ) -> Path:
        """Save ``contents`` through ``writer`` as ``target``; ``then(target)`` on rank 0 once
        committed. Returns then, or (``background``) once the writer has copied what it needs.
        Every rank must call this; all raise the same CheckpointError."""
        self.wait()
        refusal = None
        try:  # the lead's: no earlier commit of this name may vouch for what is written now
            staging = self.store.staging(target, folder=writer.folder)
        except Exception as caught:  # refused in the writer: every rank still reaches it
            staging = staging_path(target, writer.folder)
            refusal = f"{type(caught).__name__}: {caught}"
        where = location(self.where, target)
        write = writer.begin(WriteJob(staging, where, contents, refusal, budget_s, background))
        pending = _Pending(target, staging, writer, run, then)
        if background:
            if self._thread is None:
                self._thread = ThreadPoolExecutor(1, "nn_handler-checkpoint")
            pending.future = self._thread.submit(self._write_and_put, pending, write)
            self._pending = pending
            return target
        try:
            written, objects = self._write_and_put(pending, write)
        except Exception as caught:  # never skip the gather and agreement: the others wait
            written, objects = Written(error=f"{type(caught).__name__}: {caught}"), {}
        self._finish(pending, written, objects)
        return target

    def wait(self) -> Path | None:
        """Wait for the background save, if any, and commit it; returns its target. Every
        rank must call this; all raise the same CheckpointError if it failed."""
        pending, self._pending = self._pending, None
        if pending is None or pending.future is None:
            return None
        try:
            written, objects = pending.future.result()
        except Exception as caught:  # never skip the agreement: the others wait in it
            written, objects = Written(error=f"{type(caught).__name__}: {caught}"), {}
        self._finish(pending, written, objects, " (in the background)")
        return pending.target

    def copy(self, source: Path, target: Path, run: str | None) -> Path:
        """``target`` becomes a copy of the committed checkpoint ``source`` (hard links; a copy
        made by an object store), committed by the store on rank 0. Every rank must call
        this; all raise the same CheckpointError if it failed."""
        error: str | None = None
        if self.comm.rank == 0:
            try:
                self.store.commit(target, source.name, run)
            except Exception as caught:
                error = f"{type(caught).__name__}: {caught}"
        agree_on(self.comm, error, f"writing checkpoint {location(self.where, target)}")
        return target

    def close(self) -> None:
        """Stop the route's thread (after ``wait``; not waited for: after a failure a write
        may still hang). Any rank."""
        if self._thread is not None:
            self._thread.shutdown(wait=False)
        self._thread = None

    def _write_and_put(
        self, pending: _Pending, write: Callable[[], Written]
    ) -> tuple[Written, dict[str, Entry]]:
        written = write()
        objects: dict[str, Entry] = {}
        if written.error is None:
            try:
                name = pending.target.name
                objects = self.store.put(pending.staging, written.files, name, written.known)
            except Exception as caught:  # agreed at the finish, with every rank's
                written.error = f"{type(caught).__name__}: {caught}"
        return written, objects

    def _finish(
        self, pending: _Pending, written: Written, objects: dict[str, Entry], when: str = ""
    ) -> None:
        """Rank 0 gathers every rank's outcome and entries (a folder's), has the store commit
        the checkpoint when none failed and runs ``then``; every rank agrees on it."""
        comm, target = self.comm, pending.target
        error = written.error
        every: list[Any] = [(error, objects)]
        if pending.writer.folder and comm.world_size > 1:
            with comm.patient():  # ranks write and upload at their own pace
                every = comm.gather_object((error, objects), dst=0) or []
        if comm.rank == 0 and all(failed is None for failed, _ in every):
            merged = {key: entry for _, part in every for key, entry in part.items()}
            for name, entry in written.every.items():
                key = f"{target.name}/{name}"
                merged[key] = {**merged.get(key, {}), **entry}
            try:
                self.store.commit(target, pending.staging, pending.run, merged)
                if pending.then is not None:
                    pending.then(target)
            except Exception as caught:
                error = f"{type(caught).__name__}: {caught}"
        with comm.patient():  # the others wait while rank 0 writes a file or commits
            agree_on(comm, error, f"writing checkpoint {location(self.where, target)}{when}")
        if comm.rank != 0 and objects:
            _drop_own(pending.staging, objects)


def _drop_own(staging: Path, objects: Mapping[str, Any]) -> None:
    """A rank on another machine than rank 0's, once its files are uploaded: their local
    copies (and the staging folder once empty). Only its own files: on rank 0's machine the
    folder is already committed, and a later save may be staging under the same name."""
    for key in objects:
        with contextlib.suppress(FileNotFoundError):
            (staging / key.split("/", 1)[1]).unlink()
    with contextlib.suppress(OSError):
        staging.rmdir()


def writer_for(
    sharded: bool, comm: Communicator, group: Callable[[], ProcessGroup | None]
) -> CheckpointWriter:
    """The writer of a run's checkpoints, chosen once (checkpoint/format.py's
    ``sharded_checkpoints`` decides): a folder every rank writes, or one file rank 0 writes."""
    from nn_handler.checkpoint.sharded import ShardedWriter
    from nn_handler.checkpoint.single_file import FileWriter

    return ShardedWriter(comm, group) if sharded else FileWriter(comm)


def save_to(
    comm: Communicator,
    path: str | Path,
    writer: CheckpointWriter,
    contents: Any,
    *,
    run: str | None,
    budget_s: float | None = None,
    storage_options: Mapping[str, Any] | None = None,
    timeout_s: float = 120.0,
) -> Path:
    """Save a checkpoint outside a run's folder: into the local folder holding ``path``, or
    a single file to an object store's URL, committed there as every checkpoint is. Every
    rank must call this."""
    from nn_handler.checkpoint.store import LocalStore
    from nn_handler.checkpoint.store.urls import store_of
    from nn_handler.config.checkpoint import is_url

    store: CheckpointStore = LocalStore(Path(path).parent)
    target, where = Path(path), str(Path(path).parent)
    if is_url(path):
        if writer.folder:
            raise ConfigError(
                f"save({path!r}): a sharded checkpoint reaches an object store as a periodic "
                f"one (checkpoint.dir={str(path).rpartition('/')[0]!r}); save(url) writes "
                f"single files. Or save to a local folder."
            )
        store, target = store_of(str(path), storage_options, timeout_s)
        where = str(path).rstrip("/").rpartition("/")[0]
    route = SaveRoute(comm, store, where)
    try:
        return route.save(target, writer, contents, run=run, budget_s=budget_s)
    finally:
        route.close()


__all__ = ["CheckpointWriter", "SaveRoute", "Written", "save_to", "writer_for"]
