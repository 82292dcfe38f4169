"""Where a run's checkpoints live, behind one small interface: ``CheckpointStore``, the only
code that commits a checkpoint (renames it into place or writes its manifest).

The protocol, for every checkpoint: a writer writes into ``staging(target)``; each rank hands
its files to ``put``; rank 0 ``commit``-s once every rank's put is agreed; ``fetch`` gives a
committed one on this machine (checkpoint/opening.py reads it). Two implementations:
``LocalStore``, a folder (the commit is one rename, a folder's manifest written into it
first: checkpoint/store/files.py), and
``ObjectStore``, a folder of an object store seen through a local working copy (committed
there as locally, then on the store: every object uploaded, then its manifest; what the store
has committed is what is trusted). ``open_store`` picks one from ``checkpoint.dir``. The
CheckpointManager's policy (which to write, keep and resume) uses either alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.format import is_checkpoint
from nn_handler.checkpoint.store.local import LATEST, LocalStore
from nn_handler.config.checkpoint import CheckpointConfig, is_url

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from nn_handler.checkpoint.manifest import Entry
    from nn_handler.distributed.communicator import Communicator
    from nn_handler.errors import CheckpointError


class CheckpointStore(Protocol):
    """The folder of one run's checkpoints. The operations that change it are rank 0's unless
    their docstring says otherwise."""

    #: Where checkpoints are written (the folder, or an object store's working copy).
    dir: Path

    @property
    def where(self) -> str:
        """The folder as the user named it (a URL for an object store)."""

    def location(self, path: Path) -> str:
        """Where the checkpoint ``path`` lives, as the user names it."""

    def start(
        self, is_checkpoint_name: Callable[[str], bool], lead: bool = True
    ) -> CheckpointError | None:
        """Once, before use: the ``lead`` (rank 0 of the run writing here) creates, locks and
        cleans what killed saves left; a reader learns what the store holds. Returns the
        error."""

    def release(self) -> None:
        """Wait for changes still running and give up the lock (any rank)."""

    def checkpoints(self) -> Mapping[Path, str | None]:
        """Every complete (committed) checkpoint, with the run its store records beside it
        (None: none recorded; the checkpoint itself may say)."""

    def latest(self) -> Path | None:
        """The complete checkpoint latest.json names (None: none, or unreadable)."""

    def fetch(self, name: str) -> Path:
        """The committed checkpoint ``name`` on this machine (an object store's downloaded
        into the working copy, every object checked as it arrives). Any rank."""

    def write_latest(self, pointer: Mapping[str, Any]) -> None:
        """Point latest.json at ``pointer``, never backwards over another job's."""

    def flush(self) -> None:
        """Wait for changes running in the background; raise the first failure (any rank)."""

    def remove(self, path: Path) -> None:
        """Delete a checkpoint."""

    def link(self, source: Path, target: Path) -> None:
        """``target`` becomes the checkpoint ``source`` too."""

    # The commit protocol.
    @property
    def uploads(self) -> bool:
        """Whether ``put`` and ``commit`` reach another place (an object store)."""

    def staging(self, target: Path, folder: bool = False) -> Path:
        """Where the checkpoint ``target`` is written before its commit (a file rank 0
        writes, or a ``folder`` every rank writes into)."""

    def prepare(self, name: str) -> None:
        """Rank 0, before the checkpoint ``name`` is written anew: no old commit may vouch
        for it."""

    def put(
        self, staging: Path, files: list[Path], name: str, known: dict[str, Entry] | None = None
    ) -> dict[str, Entry]:
        """This rank's ``files`` of the folder being written in ``staging``, sent as the
        checkpoint ``name``'s; their manifest entries (``known``: by file name, those the
        writer already has). Any rank."""

    def commit(
        self, target: Path, staging: Path, run: str | None, objects: dict[str, Entry] | None = None
    ) -> None:
        """Rank 0, once every rank's ``put`` is agreed: ``staging`` becomes the checkpoint
        ``target`` of the run ``run``, trusted from now on; ``objects``: the entries already
        known (the writer's, the puts'), the others are computed."""


def flush_together(store: CheckpointStore, comm: Communicator) -> None:
    """Wait for ``store``'s changes running in the background (rank 0's uploads); every rank
    raises the same CheckpointError if one failed. Every rank must call this."""
    if not store.uploads:
        return
    error: str | None = None
    try:
        store.flush()
    except Exception as caught:  # a background failure of any kind; agreed below
        error = f"{type(caught).__name__}: {caught}"
    with comm.patient():
        agree_on(comm, error, f"uploading checkpoints to {store.where}")


def open_store(config: CheckpointConfig) -> CheckpointStore:
    """The store of ``config.dir``: an ObjectStore for a URL, a LocalStore otherwise."""
    if is_url(config.dir):
        from nn_handler.checkpoint.store.object_store import ObjectStore

        return ObjectStore(config)
    return LocalStore(Path(str(config.dir)))


__all__ = [
    "LATEST",
    "CheckpointStore",
    "LocalStore",
    "flush_together",
    "is_checkpoint",
    "open_store",
]
