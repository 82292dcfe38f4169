"""Sharded checkpoints: a folder every rank writes in parallel through
torch.distributed.checkpoint (DCP), and that any number of ranks can load.

Layout::

    ckpt-e0003-s00000120/
        trainer.pt      every part that is not sharded (loop position, history, schedulers,
                        every rank's RNG, ...): the single-file format without the sharded
                        parts, which its "sharded" entry names; rank 0 writes it
        __0_0.distcp    each rank's shards of the sharded parts (model, optimizers, EMA)
        .metadata       DCP's index of the shards, once every rank has written
        manifest.json   the size and CRC-32 checksums of every file and every item in the
                        shards (checkpoint/manifest.py), written by the store's commit

Every rank writes into the store's staging folder (``.ckpt-e0003-s00000120.tmp-sharded``) and
hands its files to the store (``put``: an object store uploads them); once every rank has,
rank 0 has the store commit the folder (a local one by its manifest and one rename, an object
store by its manifest beside it), so a kill at any moment leaves the previous checkpoint the
newest complete one. The writer knows nothing of object stores.
DCP reshards on load: a folder written by W ranks loads on W' ranks, under FSDP2, DDP or in
one process. Loading reads the index and the shards' values without running code
(checkpoint/safe_dcp.py) and only after every file was checked against the manifest
(``verify_sharded``: each rank a share of the files).
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.async_staging import CachedStager
from nn_handler.checkpoint.format import CHECKSUMS, REST
from nn_handler.checkpoint.io import write_file
from nn_handler.checkpoint.manifest import MANIFEST, Entry
from nn_handler.checkpoint.run_identity import RUN
from nn_handler.checkpoint.sharded_errors import (
    causes_of,
    dcp_errors,
    failure_text,
    save_failure,
)
from nn_handler.checkpoint.verify import verify_files
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError


class FolderStore(Protocol):
    """What a folder checkpoint's writer needs of the store that commits it (a
    CheckpointStore, checkpoint/store/, has it)."""

    @property
    def where(self) -> str: ...

    @property
    def uploads(self) -> bool: ...

    def staging(self, target: Path, folder: bool = False) -> Path: ...

    def prepare(self, name: str) -> None: ...

    def put(
        self, staging: Path, files: list[Path], name: str, known: dict[str, Entry] | None = None
    ) -> dict[str, Entry]: ...

    def commit(
        self, target: Path, staging: Path, run: str | None, objects: dict[str, Entry] | None = None
    ) -> None: ...


@dataclass
class _Save:
    """One save: where it goes and what commits it."""

    staging: Path
    target: Path
    store: FolderStore
    writer: Any
    run: str | None
    then: Callable[[Path], None] | None
    #: The DCP write (None: it already finished) and this rank's puts once it has.
    written: Future[Any] | None = None
    put: Future[dict[str, Entry]] | None = None
    #: This rank's shards (a background save's failure names the bytes they need).
    shards: Any = None


class ShardedWriter:
    """Writes one run's sharded checkpoints (every rank calls every method at the same point).

    ``group`` returns the process group DCP's collectives use (the strategy's
    ``checkpoint_group``: a gloo group of their own; None in one process). An asynchronous
    save returns once this rank has copied its state; the files are written (and put in the
    store) in background threads, and the next ``save`` or ``wait`` waits for them and has the
    store commit the folder; ``close`` stops the threads.
    """

    def __init__(self, comm: Communicator, group: Callable[[], dist.ProcessGroup | None]) -> None:
        self.comm = comm
        self._group = group
        self._pending: _Save | None = None
        self._stager = CachedStager()
        # Made at the first asynchronous save: its DCP writes, and its puts to a store.
        self._writes: ThreadPoolExecutor | None = None
        self._puts: ThreadPoolExecutor | None = None

    def close(self) -> None:
        """Stop the writer's threads, if any (after ``wait``). Every rank may call it."""
        for pool in (self._writes, self._puts):
            if pool is not None:  # not waited for: after a failure a write may still hang
                pool.shutdown(wait=False)
        self._writes = self._puts = None

    @property
    def pending(self) -> Path | None:
        """The folder of the asynchronous save not yet committed (None: none)."""
        return None if self._pending is None else self._pending.target

    @property
    def writing(self) -> bool:
        """Whether an asynchronous save's files are still being written."""
        written = None if self._pending is None else self._pending.written
        return written is not None and not written.done()

    def save(
        self,
        rest: Mapping[str, Any] | None,
        shards: dict[str, Any],
        target: str | Path,
        store: FolderStore,
        *,
        asynchronous: bool = False,
        then: Callable[[Path], None] | None = None,
    ) -> Path:
        """Write the folder ``target`` for ``store`` to commit: ``rest`` (used on rank 0) as
        its REST file and every rank's ``shards`` through DCP; ``then(target)`` runs on rank
        0 once it is committed (a failure in it fails the save). Every rank must call this;
        all raise the same CheckpointError if any failed. Asynchronous: returns once this
        rank's state is copied, with no collective; a failure is raised by the ``wait`` that
        would commit it."""
        self.wait()
        target = Path(target)
        staging = store.staging(target, folder=True)
        error = _prepare(staging, rest, store, target) if self.comm.rank == 0 else None
        group = self._group()
        options: dict[str, Any] = {"process_group": group, "no_dist": group is None}
        save = _Save(staging, target, store, _writer(staging), _run_of(rest), then)
        if asynchronous:
            staged = shards
            try:
                staged = self._stager.stage(shards)
            except Exception as caught:  # (shared memory full, say)
                error = error or f"copying this rank's state: {type(caught).__name__}: {caught}"
            # No collective of the loop's here: a failure so far is raised in DCP's planning,
            # which reports it to every rank before any writes or puts, and fails the wait.
            save.writer.refusal = error
            if self._writes is None:
                self._writes = ThreadPoolExecutor(1, "nn_handler-checkpoint")
            save.written = self._writes.submit(dcp_save, staged, save.writer, options)
            save.shards = shards
            if store.uploads:
                if self._puts is None:
                    self._puts = ThreadPoolExecutor(1, "nn_handler-upload")
                save.put = self._puts.submit(self._put, save)
            self._pending = save
            return target
        agree_on(self.comm, error, f"writing checkpoint {target}")  # before any rank writes
        try:
            dcp_save(shards, save.writer, options)
        except dcp_errors() as caught:
            error = save_failure(caught, target, shards)
        self._finish(save, error, f"writing checkpoint {target}")
        return target

    def _put(self, save: _Save) -> dict[str, Entry]:
        """This rank's files of the folder, put in its store (after they are written)."""
        if save.written is not None:
            save.written.result()
        names = list(getattr(save.writer, "written", [])) + ([REST] if self.comm.rank == 0 else [])
        known = getattr(save.writer, "entries", {})  # checksummed as they were written
        files = [save.staging / name for name in names]
        return save.store.put(save.staging, files, save.target.name, known)

    def _finish(self, save: _Save, error: str | None, what: str) -> None:
        """Every rank: put its files (unless done in the background) and agree on the writes
        and puts; then rank 0 has the store commit the folder, with every rank's entries,
        and runs ``then``."""
        store, target = save.store, save.target
        objects: dict[str, Entry] = {}
        if store.uploads:
            try:
                if error is None:
                    objects = save.put.result() if save.put is not None else self._put(save)
            except Exception as caught:  # never skip the agreement below: the others wait in it
                error = error or f"{type(caught).__name__}: {caught}"
            with self.comm.patient():  # ranks upload at their own pace
                agree_on(self.comm, error, f"uploading checkpoint {target} to {store.where}")
        every = [objects]
        if store.uploads and self.comm.world_size > 1:
            every = self.comm.gather_object(objects, dst=0) or []
        if error is None and self.comm.rank == 0:
            merged = {key: entry for part in every for key, entry in part.items()}
            for name, entry in getattr(save.writer, "files", {}).items():
                key = f"{target.name}/{name}"
                merged[key] = {**merged.get(key, {}), **entry}  # type: ignore[typeddict-item]
            try:
                store.commit(target, save.staging, save.run, merged)
                if save.then is not None:
                    save.then(target)
            except Exception as caught:
                error = f"{type(caught).__name__}: {caught}"
        agree_on(self.comm, error, what)
        if store.uploads and self.comm.rank != 0:
            _drop_own(save.staging, objects)

    def wait(self) -> Path | None:
        """Wait for the asynchronous save in flight, if any, and commit it; returns its folder.
        Every rank must call this; all raise the same CheckpointError if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error: str | None = None
        try:
            if pending.written is not None:
                pending.written.result()
        except dcp_errors() as caught:
            error = save_failure(caught, pending.target, pending.shards)
        self._finish(pending, error, f"writing checkpoint {pending.target} (in the background)")
        return pending.target


def _drop_own(staging: Path, objects: Mapping[str, Any]) -> None:
    """A rank on another machine than rank 0's: its uploaded files' local copies (and the
    staging folder once empty). Only its own files: on rank 0's machine the folder is already
    committed, and a later save may be staging under the same name."""
    for key in objects:
        with contextlib.suppress(FileNotFoundError):
            (staging / key.split("/", 1)[1]).unlink()
    with contextlib.suppress(OSError):
        staging.rmdir()


def _run_of(rest: Mapping[str, Any] | None) -> str | None:
    run = rest.get(RUN) if isinstance(rest, Mapping) else None
    found = run.get("id") if isinstance(run, Mapping) else None
    return found if isinstance(found, str) else None


def verify_sharded(folder: str | Path, comm: Communicator | None, rest: Any) -> None:
    """Check the folder's files against its manifest, each rank a share of them (``comm``
    None: every file, in this process); ``rest`` is its REST contents (a folder written with
    checksums must still have them). Every rank must call this; all raise the same
    CheckpointError naming the file, the bytes and the tensor when any rank found one bad."""
    path = Path(folder)
    required = isinstance(rest, Mapping) and rest.get(CHECKSUMS) == MANIFEST
    rank, world = (0, 1) if comm is None else (comm.rank, comm.world_size)
    error: CheckpointError | None = None
    try:
        verify_files(path, rank, world, required)
    except CheckpointError as caught:
        error = caught
    if comm is None:
        if error is not None:
            raise error
        return
    with comm.patient():  # a rank with a large share reads for a while
        agree_on(comm, error, f"verifying checkpoint {path}")


def load_shards(
    path: str | Path, template: dict[str, Any], group: dist.ProcessGroup | None
) -> None:
    """Fill ``template`` (the parts' ``shards()``, on every rank) in place from the folder at
    ``path``, resharded to this run's ranks, reading nothing that can run code (verify the
    folder first: ``verify_sharded``). Every rank must call this; a failure on any rank is a
    CheckpointError on every rank."""
    from torch.distributed.checkpoint.state_dict_loader import load

    from nn_handler.checkpoint.safe_dcp import SafeLoadPlanner, SafeReader

    try:
        if group is None:
            quiet_one_process_notice()
        load(
            template,
            storage_reader=SafeReader(str(path)),
            planner=SafeLoadPlanner(path),
            process_group=group,
            no_dist=group is None,
        )
    except CheckpointError:
        raise
    except dcp_errors() as error:  # DCP raised the same error on every rank
        ours = [c for c in causes_of(error) if isinstance(c, CheckpointError)]
        if ours:  # a refused index or value: the file is at fault, not the model
            raise CheckpointError(f"cannot load the shards of {path}: {ours[0]}") from error
        raise CheckpointError(
            f"cannot load the shards of {path}: {failure_text(error)}. Build the model, "
            f"optimizers and EMA the same way as the run that wrote it."
        ) from error


#: DCP's notice that it runs in one process (torch.distributed.checkpoint's save and load
#: say it on every call with no process group): what a one-process sharded save asks for.
ONE_PROCESS_NOTICE = (
    r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to "
    r"(save|load) in a single process"
)


def quiet_one_process_notice() -> None:
    """Ignore DCP's one-process notice, from torch.distributed.checkpoint only, for the rest
    of the process (documented in docs/checkpoints.md). One filter, added once: a
    ``catch_warnings`` around each save is not thread-safe (an asynchronous save runs in a
    thread) and, on leaving, resets every "once" registry, so the notice came back at every
    save."""
    for action, message, *_ in warnings.filters:
        if action == "ignore" and message is not None and message.pattern == ONE_PROCESS_NOTICE:
            return
    warnings.filterwarnings(
        "ignore", message=ONE_PROCESS_NOTICE, module=r"torch\.distributed\.checkpoint"
    )


def dcp_save(shards: dict[str, Any], writer: Any, options: dict[str, Any]) -> None:
    """DCP's save of ``shards`` through ``writer`` (its collectives on ``options``' group)."""
    from torch.distributed.checkpoint.state_dict_saver import save

    if options["no_dist"]:
        quiet_one_process_notice()
    save(shards, storage_writer=writer, **options)


def _writer(staging: Path) -> Any:
    from nn_handler.checkpoint.checksumming_writer import ChecksummingWriter

    return ChecksummingWriter(str(staging), sync_files=True)


def _prepare(
    staging: Path, rest: Mapping[str, Any] | None, store: FolderStore, target: Path
) -> str | None:
    """Rank 0: an empty staging folder holding the REST file; no commit of ``target`` left
    to vouch for it (FolderStore.prepare)."""
    if rest is None:
        return "no checkpoint contents were given on rank 0"
    try:
        store.prepare(target.name)
        if staging.exists():  # left by a save that was killed
            shutil.rmtree(staging)
        staging.mkdir(parents=True, exist_ok=True)  # (another rank's DCP may have made it)
        write_file({**rest, CHECKSUMS: MANIFEST}, staging / REST, name=target / REST)
    except Exception as caught:
        return f"{type(caught).__name__}: {caught}"
    return None


__all__ = ["CachedStager", "ShardedWriter", "load_shards", "verify_sharded"]
