"""The two optional hook methods of the Trainer's checkpointing (docs/training.md):
``checkpoint_committed(path, epoch, step)``, on every rank in the same order once a periodic
checkpoint is committed (never for a failed one), and ``checkpoint_to_resume()``, asked once
on every rank before the ``resume`` policy (a path to resume from, or None).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class CommitListener(Protocol):
    """A hook told of every committed periodic checkpoint."""

    def checkpoint_committed(self, path: Path, epoch: int, step: int) -> None: ...


@runtime_checkable
class ResumeSource(Protocol):
    """A hook that may name the checkpoint a fit starts from."""

    def checkpoint_to_resume(self) -> Path | None: ...


class CheckpointEvents:
    """The listeners and sources among a trainer's hooks, and the asynchronous checkpoint
    whose commit is still to be told."""

    def __init__(self) -> None:
        self.listeners: list[CommitListener] = []
        self.sources: list[ResumeSource] = []
        self._pending: tuple[Path, int, int] | None = None

    def adopt(self, hooks: Iterable[Any]) -> None:
        """Remember the hooks that implement either method."""
        for hook in hooks:
            if isinstance(hook, CommitListener):
                self.listeners.append(hook)
            if isinstance(hook, ResumeSource):
                self.sources.append(hook)

    def committed(self, path: Path, epoch: int, step: int) -> None:
        """Tell every listener that ``path`` is committed. Every rank must call this."""
        for listener in self.listeners:
            listener.checkpoint_committed(path, epoch, step)

    def writing(self, path: Path, epoch: int, step: int) -> None:
        """``path`` is being written in the background: told once ``waited`` says it is
        committed."""
        self._pending = (path, epoch, step)

    def waited(self, path: Path | None) -> None:
        """The background save of ``path`` (None: none was in flight) is committed."""
        pending, self._pending = self._pending, None
        if path is not None and pending is not None and pending[0] == path:
            self.committed(*pending)

    def resume_point(self) -> tuple[Path, str] | None:
        """The first checkpoint a source names, with the source's class name."""
        for source in self.sources:
            path = source.checkpoint_to_resume()
            if path is not None:
                return Path(path), type(source).__name__
        return None


__all__ = ["CheckpointEvents", "CommitListener", "ResumeSource"]
