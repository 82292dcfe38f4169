"""Where a run's checkpoints live, behind ``CheckpointStore`` (ten members): the only code that
commits a checkpoint. A writer writes into ``staging(target)``; each rank hands its files to
``put``; rank 0 ``commit``-s once every put is agreed; ``fetch`` gives a committed one on this
machine. ``LocalStore`` commits by a rename, ``ObjectStore`` (a LocalStore as working copy) by
a manifest on the store; ``open_store`` picks one from ``checkpoint.dir``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.format import is_checkpoint
from nn_handler.checkpoint.store.local import LATEST, Listing, LocalStore
from nn_handler.config.checkpoint import CheckpointConfig, is_url

if TYPE_CHECKING:
    from collections.abc import Mapping

    from nn_handler.checkpoint.manifest import Entry
    from nn_handler.distributed.communicator import Communicator


class CheckpointStore(Protocol):
    """The folder of one run's checkpoints: ten members. The changes are the lead's (rank 0
    of the run writing there) unless their docstring says otherwise; ``put``, ``fetch``,
    ``staging`` and ``flush`` are any rank's."""

    #: Where checkpoints are written on this machine (the folder, or a working copy).
    dir: Path

    def session(self, lead: bool) -> AbstractContextManager[None]:
        """The store in use: the ``lead`` creates and locks it and cleans what killed saves
        left, any other learns what it holds; leaving waits for the changes still running
        and gives the lock up. Raises CheckpointError when it cannot start. Outside a
        session a store is read afresh at every listing."""

    def flush(self) -> None:
        """Wait for changes running in the background; raise the first failure."""

    def checkpoints(self) -> Listing:
        """Every committed checkpoint with the run that wrote it, and ``latest``: the one
        latest.json names."""

    def write_latest(self, pointer: Mapping[str, Any]) -> None:
        """Point latest.json at ``pointer``, never backwards over another job's."""

    def fetch(self, name: str) -> Path:
        """The committed checkpoint ``name`` on this machine (an object store's downloaded
        into the working copy, every object checked as it arrives)."""

    def staging(self, target: Path, folder: bool = False) -> Path:
        """Where the checkpoint ``target`` is written before its commit (a file rank 0
        writes, or a ``folder`` every rank writes into); on the lead, no earlier commit of
        that name vouches for a folder written there from now on."""

    def put(
        self, staging: Path, files: list[Path], name: str, known: dict[str, Entry] | None = None
    ) -> dict[str, Entry]:
        """This rank's ``files`` of the folder being written in ``staging``, sent as the
        checkpoint ``name``'s; their manifest entries (``known``: by file name, those the
        writer already has)."""

    def commit(
        self,
        target: Path,
        source: Path | str,
        run: str | None,
        objects: dict[str, Entry] | None = None,
    ) -> None:
        """Once every rank's ``put`` is agreed, the staging path ``source`` becomes the
        checkpoint ``target`` of the run ``run``, trusted from now on (``objects``: the
        entries already known, the others are computed); or ``target`` becomes a copy of the
        committed checkpoint named ``source``."""

    def remove(self, path: Path) -> None:
        """Delete a checkpoint."""


def location(where: str, target: Path) -> str:
    """Where the checkpoint ``target`` of the store ``where`` lives, as the user names it (its
    URL on an object store)."""
    return f"{where.rstrip('/')}/{target.name}" if is_url(where) else str(target)


def flush_together(store: CheckpointStore, comm: Communicator, where: str) -> None:
    """Wait for ``store``'s changes running in the background (rank 0's uploads); every rank
    raises the same CheckpointError if one failed. Every rank must call this."""
    if not is_url(where):
        return
    error: str | None = None
    try:
        store.flush()
    except Exception as caught:  # a background failure of any kind; agreed below
        error = f"{type(caught).__name__}: {caught}"
    with comm.patient():
        agree_on(comm, error, f"uploading checkpoints to {where}")


def where_of(config: CheckpointConfig) -> str:
    """The store of ``config.dir`` as the user names it (an object store's URL)."""
    return str(config.dir).rstrip("/") if is_url(config.dir) else str(Path(str(config.dir)))


def open_store(config: CheckpointConfig) -> CheckpointStore:
    """The store of ``config.dir``: an ObjectStore for a URL, a LocalStore otherwise."""
    if is_url(config.dir):
        from nn_handler.checkpoint.store.object_store import ObjectStore

        return ObjectStore(config)
    return LocalStore(Path(str(config.dir)))


__all__ = [
    "LATEST",
    "CheckpointStore",
    "Listing",
    "LocalStore",
    "flush_together",
    "is_checkpoint",
    "location",
    "open_store",
    "where_of",
]
