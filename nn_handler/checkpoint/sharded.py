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
                        shards (checkpoint/manifest.py), written last

The folder is written as ``.ckpt-e0003-s00000120.tmp-sharded`` and committed by one rename on
rank 0 after every rank has finished, so a kill at any moment leaves the previous checkpoint
the newest complete one (the CheckpointManager removes the staging folder at the next start).
DCP reshards on load: a folder written by W ranks loads on W' ranks, under FSDP2, DDP or in
one process. Loading reads the index and the shards' values without running code
(checkpoint/safe_dcp.py) and only after every file was checked against the manifest
(``verify_sharded``: each rank a share of the files).
"""

from __future__ import annotations

import contextlib
import shutil
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.async_staging import CachedStager
from nn_handler.checkpoint.folder_commit import (
    commit_folder,
    link_tree,
    remove_tree,
    staging_path,
)
from nn_handler.checkpoint.io import atomic_save, load_file
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

#: The file of a sharded checkpoint holding its unsharded parts.
REST = "trainer.pt"
#: The entry of REST naming the parts that are in the shards.
SHARDED = "sharded"
#: The entry of REST naming the folder's checksum file (absent: written before checksums).
CHECKSUMS = "checksums"
#: Top-level keys of a training checkpoint that are not parts (training/checkpointing.py).
META = ("format", "version", "world_size", "config", "ranks", SHARDED, CHECKSUMS,
        "consolidated_without", RUN)  # fmt: skip


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a (committed) sharded checkpoint folder."""
    folder = Path(path)
    return folder.is_dir() and (folder / REST).is_file()


def read_rest(
    path: str | Path, map_location: torch.device | str | None = None, verify: bool = True
) -> Any:
    """The unsharded parts of the sharded checkpoint at ``path`` (a training checkpoint's
    top level, with ``sharded`` naming the parts in the shards); ``verify``: check its
    records' CRC-32s (not when its bytes were checked as they were fetched)."""
    return load_file(Path(path) / REST, map_location, verify=verify)


class FolderStore(Protocol):
    """What a folder checkpoint's writer needs of the store that commits it (a
    CheckpointStore, checkpoint/store/, has it)."""

    @property
    def where(self) -> str: ...

    @property
    def uploads(self) -> bool: ...

    def prepare(self, name: str) -> None: ...

    def put(self, folder: Path, files: list[Path], name: str) -> dict[str, Entry]: ...

    def commit(self, name: str, objects: dict[str, Entry], run: str | None) -> None: ...


@dataclass
class _Pending:
    future: Future[Any]
    staging: Path
    target: Path
    then: Callable[[Path], None] | None
    #: This rank's upload to the object store, once the files are written (None: no store).
    uploaded: Future[dict[str, Any]] | None = None
    run: str | None = None
    store: FolderStore | None = None


class ShardedWriter:
    """Writes one run's sharded checkpoints (every rank calls every method at the same point).

    ``group`` returns the process group DCP's collectives use (the strategy's
    ``checkpoint_group``: a gloo group of their own; None in one process). An asynchronous
    save returns once every rank has copied its state; the files are written in a background
    thread, and the next ``save`` or ``wait`` waits for it and commits it.

    A save given a ``store`` that uploads (an object store) has every rank put the files it
    wrote there (in the background too, for an asynchronous save) and rank 0 commit the folder
    once every rank's upload finished (FolderStore.put and commit), before ``then`` runs;
    the writer holds no store of its own.
    """

    def __init__(self, comm: Communicator, group: Callable[[], dist.ProcessGroup | None]) -> None:
        self.comm = comm
        self._group = group
        self._pending: _Pending | None = None
        self._stager = CachedStager()
        self._uploads: ThreadPoolExecutor | None = None  # made at the first upload

    @property
    def pending(self) -> Path | None:
        """The folder an asynchronous save is still writing (None: none)."""
        return None if self._pending is None else self._pending.target

    def save(
        self,
        rest: Mapping[str, Any] | None,
        shards: dict[str, Any],
        target: str | Path,
        *,
        asynchronous: bool = False,
        then: Callable[[Path], None] | None = None,
        store: FolderStore | None = None,
    ) -> Path:
        """Write the folder ``target``: ``rest`` (used on rank 0) as its REST file and every
        rank's ``shards`` through DCP; ``then(target)`` runs on rank 0 once it is committed
        (a failure in it fails the save); ``store``: where it is committed too, when that
        store uploads (the same on every rank). Every rank must call this; all raise the same
        CheckpointError if any failed. Asynchronous: returns once the state is staged."""
        self.wait()
        target = Path(target)
        staging = staging_path(target)
        store = store if store is not None and store.uploads else None
        error = _prepare(staging, rest, store, target.name) if self.comm.rank == 0 else None
        agree_on(self.comm, error, f"writing checkpoint {target}")  # before any rank uploads
        group = self._group()
        options: dict[str, Any] = {"process_group": group, "no_dist": group is None}
        writer = _writer(staging)
        run = _run_of(rest)
        if asynchronous:
            try:
                future = dcp_async_save(shards, writer, {**options, "async_stager": self._stager})
            except dcp_errors() as caught:
                error = save_failure(caught, target, shards)
            agree_on(self.comm, error, f"staging checkpoint {target}")
            uploaded = None
            if store is not None:
                if self._uploads is None:
                    self._uploads = ThreadPoolExecutor(1, "nn_handler-upload")
                uploaded = self._uploads.submit(
                    self._upload, writer, staging, target, future, store
                )
            self._pending = _Pending(future, staging, target, then, uploaded, run, store)
            return target
        try:
            dcp_save(shards, writer, options)
        except dcp_errors() as caught:
            error = save_failure(caught, target, shards)
        objects: dict[str, Any] = {}
        if error is None and store is not None:
            try:
                objects = self._upload(writer, staging, target, None, store)
            except Exception as caught:  # never skip the agreement below: the others wait in it
                error = f"{type(caught).__name__}: {caught}"
        what = f"writing checkpoint {target}"
        self._finish(staging, target, then, error, objects, run, what, store)
        return target

    def _upload(
        self,
        writer: Any,
        staging: Path,
        target: Path,
        written: Future[Any] | None,
        store: FolderStore,
    ) -> dict[str, Any]:
        """This rank's files of the folder, put in ``store`` as ``target``'s (after
        ``written``)."""
        if written is not None:
            written.result()
        names = list(getattr(writer, "written", [])) + ([REST] if self.comm.rank == 0 else [])
        return store.put(staging, [staging / n for n in names], target.name)

    def _finish(
        self,
        staging: Path,
        target: Path,
        then: Callable[[Path], None] | None,
        error: str | None,
        objects: dict[str, Any],
        run: str | None,
        what: str,
        store: FolderStore | None,
    ) -> None:
        """Every rank: agree on the writes (and uploads), then rank 0 commits the folder (in
        the uploading ``store`` too, with every rank's objects) and runs ``then``."""
        if store is not None:
            remote = store  # named for the closure below (mypy keeps the narrowing)
            with self.comm.patient():  # ranks upload at their own pace
                agree_on(self.comm, error, f"uploading checkpoint {target} to {remote.where}")
            every = (
                self.comm.gather_object(objects, dst=0) if self.comm.world_size > 1 else [objects]
            )
            merged = {key: entry for part in every or [] for key, entry in part.items()}

            def committed(done: Path) -> None:
                remote.commit(done.name, merged, run)
                if then is not None:
                    then(done)

            error = commit_folder(staging, target, committed) if self.comm.rank == 0 else None
        elif error is None and self.comm.rank == 0:
            error = commit_folder(staging, target, then)
        agree_on(self.comm, error, what)
        if store is not None and self.comm.rank != 0:
            _drop_own(staging, objects)

    def wait(self) -> Path | None:
        """Wait for the asynchronous save in flight, if any, and commit it; returns its folder.
        Every rank must call this; all raise the same CheckpointError if it failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        error: str | None = None
        try:
            pending.future.result()
        except dcp_errors() as caught:
            error = save_failure(caught, pending.target, None)
        objects: dict[str, Any] = {}
        if pending.uploaded is not None:
            try:
                objects = pending.uploaded.result()
            except Exception as caught:  # the write's own failure is said above
                error = error or str(caught)
        what = f"writing checkpoint {pending.target} (in the background)"
        self._finish(
            pending.staging,
            pending.target,
            pending.then,
            error,
            objects,
            pending.run,
            what,
            pending.store,
        )
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
        with _one_process(group is None):
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


@contextlib.contextmanager
def _one_process(alone: bool) -> Iterator[None]:
    """Silence DCP's warning that it runs in one process, which is what we asked for."""
    with warnings.catch_warnings():
        if alone:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def dcp_save(shards: dict[str, Any], writer: Any, options: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.state_dict_saver import save

    with _one_process(options["no_dist"]):
        save(shards, storage_writer=writer, **options)


def dcp_async_save(shards: dict[str, Any], writer: Any, options: dict[str, Any]) -> Future[Any]:
    from torch.distributed.checkpoint.state_dict_saver import async_save

    with _one_process(options["no_dist"]):
        return async_save(shards, storage_writer=writer, **options)  # type: ignore[return-value]


def _writer(staging: Path) -> Any:
    from nn_handler.checkpoint.checksumming_writer import ChecksummingWriter

    return ChecksummingWriter(str(staging), sync_files=True)


def _prepare(
    staging: Path, rest: Mapping[str, Any] | None, store: FolderStore | None, name: str
) -> str | None:
    """Rank 0: an empty staging folder holding the REST file; on a store, no manifest left
    for ``name`` (RemoteFolder.invalidate)."""
    if rest is None:
        return "no checkpoint contents were given on rank 0"
    try:
        if store is not None:
            store.prepare(name)
        if staging.exists():  # left by a save that was killed
            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        atomic_save({**rest, CHECKSUMS: MANIFEST}, staging / REST)  # written last by the writer
    except Exception as caught:
        return f"{type(caught).__name__}: {caught}"
    return None


__all__ = [
    "CHECKSUMS",
    "CachedStager",
    "META",
    "REST",
    "SHARDED",
    "ShardedWriter",
    "is_sharded",
    "link_tree",
    "load_shards",
    "read_rest",
    "remove_tree",
    "staging_path",
    "verify_sharded",
]
