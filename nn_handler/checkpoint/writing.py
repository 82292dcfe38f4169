"""What a checkpoint writer is (checkpoint/single_file.py, checkpoint/sharded.py): it writes
one checkpoint's files into a staging place and knows nothing of stores; the save route
(checkpoint/saving.py) does the rest."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from nn_handler.checkpoint.manifest import Entry


@dataclass
class Written:
    """What one rank's writer left in the staging place."""

    #: This rank's files (rank 0's file, or its shards: what an object store uploads).
    files: list[Path] = field(default_factory=list)
    #: Their entries, by file name, where the writer checksummed them as they were written.
    known: dict[str, Entry] = field(default_factory=dict)
    #: On rank 0: every rank's shard files' entries (DCP's coordinator gathers them).
    every: dict[str, Entry] = field(default_factory=dict)
    #: Why this rank's part failed (None: written).
    error: str | None = None


@dataclass(frozen=True)
class WriteJob:
    """One checkpoint for a writer to write."""

    #: The store's staging place: a file, or a folder every rank writes into.
    staging: Path
    #: The checkpoint as the user names it (errors say it).
    where: str
    #: What to write (a writer's own form; rank 0's where only rank 0 writes).
    contents: Any
    #: Why this rank's part must not go on (every rank is told before any writes).
    refusal: str | None = None
    #: The longest the write may take (None: no bound).
    budget_s: float | None = None
    #: Whether the write runs in a thread while training goes on.
    background: bool = False


class CheckpointWriter(Protocol):
    """Writes one checkpoint's files into its staging place (checkpoint/single_file.py,
    checkpoint/sharded.py). Every rank calls ``begin`` at the same point."""

    #: Whether every rank writes into a folder (else rank 0 writes one file).
    folder: bool

    def begin(self, job: WriteJob) -> Callable[[], Written]:
        """What must happen now (rank 0's preparation; a background save's copy of this
        rank's state), and the write to run now or in a thread."""


__all__ = ["CheckpointWriter", "WriteJob", "Written"]
