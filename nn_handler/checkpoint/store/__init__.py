"""Where a run's checkpoints live, behind one small interface: ``CheckpointStore``.

Two implementations: ``LocalStore``, a folder (every change a local rename, link or deletion),
and ``ObjectStore``, a folder of an object store seen through a local working copy (every
change made there is mirrored to the store: a checkpoint is uploaded and committed by its
manifest, ``latest.json`` follows; what the store has committed is what is trusted).
``open_store`` picks one from ``checkpoint.dir``. The CheckpointManager's policy (which to
write, keep and resume) uses either alike; nothing else asks which one it has.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nn_handler.checkpoint.store.local import LATEST, LocalStore, is_checkpoint
from nn_handler.config.checkpoint import CheckpointConfig, is_url

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    import torch

    from nn_handler.checkpoint.manifest import Entry
    from nn_handler.checkpoint.remote.folder import RemoteFolder
    from nn_handler.checkpoint.source import Opened
    from nn_handler.errors import CheckpointError


class CheckpointStore(Protocol):
    """The folder of one run's checkpoints. The operations that change it are rank 0's unless
    their docstring says otherwise."""

    #: Where checkpoints are written (the folder, or an object store's working copy).
    dir: Path

    @property
    def remote(self) -> RemoteFolder | None:
        """The object store's folder (uploads run on it), None for a local folder."""

    @property
    def where(self) -> str:
        """The folder as the user named it (a URL for an object store)."""

    def location(self, path: Path) -> str:
        """Where the checkpoint ``path`` lives, as the user names it."""

    def start(self, is_checkpoint_name: Callable[[str], bool]) -> CheckpointError | None:
        """Rank 0, once: create, lock, clean what killed saves left. Returns the error."""

    def refresh(self) -> None:
        """Read again what the store holds (every rank but 0, at the start)."""

    def release(self) -> None:
        """Wait for changes still running and give up the lock (any rank)."""

    def exists(self, path: Path) -> bool:
        """Whether ``path`` is a complete (committed) checkpoint."""

    def entries(self) -> list[Path]:
        """Every complete checkpoint."""

    def read_latest(self) -> Any:
        """latest.json's contents (None: there is none)."""

    def owner(self, path: Path) -> tuple[bool, str | None]:
        """(known, the run id) of ``path`` where the store records it."""

    def open(self, path: str | Path, map_location: torch.device | str | None = None) -> Opened:
        """Read the checkpoint ``path``, verified (any rank)."""

    def write_latest(self, pointer: Mapping[str, Any]) -> None:
        """Point latest.json at ``pointer``, never backwards over another job's."""

    def upload(self, path: Path, run_id: str | None) -> None:
        """Commit the single-file checkpoint ``path`` where it must reach (a no-op locally)."""

    def flush(self) -> None:
        """Wait for changes running in the background; raise the first failure (any rank)."""

    def remove(self, path: Path) -> None:
        """Delete a checkpoint."""

    def link(self, source: Path, target: Path) -> None:
        """``target`` becomes the checkpoint ``source`` too."""

    # A folder checkpoint every rank writes (ShardedWriter), committed where it must reach.
    @property
    def uploads(self) -> bool:
        """Whether ``put`` and ``commit`` reach another place (an object store)."""

    def prepare(self, name: str) -> None:
        """Before the checkpoint ``name`` is written anew: no old commit may vouch for it."""

    def put(self, folder: Path, files: list[Path], name: str) -> dict[str, Entry]:
        """This rank's ``files`` of the folder checkpoint ``folder``, sent as ``name``'s;
        their entries (any rank)."""

    def commit(self, name: str, objects: dict[str, Entry], run: str | None) -> None:
        """Rank 0, once every rank's ``put`` is agreed: the checkpoint ``name`` is trusted."""


def open_store(config: CheckpointConfig) -> CheckpointStore:
    """The store of ``config.dir``: an ObjectStore for a URL, a LocalStore otherwise."""
    if is_url(config.dir):
        from nn_handler.checkpoint.store.object_store import ObjectStore

        return ObjectStore(config)
    return LocalStore(config)


__all__ = ["LATEST", "CheckpointStore", "LocalStore", "is_checkpoint", "open_store"]
