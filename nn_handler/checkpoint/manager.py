"""CheckpointManager: where a run's checkpoints go, which to keep, and which is the latest.

The folder's layout (``ckpt-e0003-s00000120.pt``, ``best.pt``, ``top-...``, ``latest.json``)
is in docs/checkpoints.md; the store (a folder or an object store) commits every change.
Every rank calls the writing methods and raises the same CheckpointError when a write failed.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loguru import logger

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.naming import (
    BEST,
    BEST_SHARDED,
    PERIODIC,
    order,
    periodic_name,
    restart_count,
)
from nn_handler.checkpoint.saving import CheckpointWriter, SaveRoute
from nn_handler.checkpoint.store import (
    CheckpointStore,
    flush_together,
    location,
    open_store,
    where_of,
)
from nn_handler.checkpoint.top_k import TopK, top_name
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class Ranking:
    """What one monitored value changed: best.pt, the top-k name kept, the names dropped."""

    best: bool
    top: str | None
    dropped: list[str]


class CheckpointManager:
    """Writes, rotates and finds the checkpoints of one run in ``config.dir``. Every rank
    constructs it; rank 0 takes the folder (its lock, and the cleanup of killed saves)."""

    def __init__(
        self,
        config: CheckpointConfig,
        communicator: Communicator,
        clean: bool = True,
        sharded: bool = False,
    ) -> None:
        if config.dir is None:
            raise CheckpointError("CheckpointManager needs CheckpointConfig(dir=...).")
        if str(config.dir).startswith("memory://") and communicator.world_size > 1:
            raise ConfigError(
                f"checkpoint.dir {config.dir}: memory:// is one process's memory, which "
                f"{communicator.world_size} ranks cannot share; use an object store (s3://...) "
                f"or a folder every rank sees."
            )
        self.config = config
        self.comm = communicator
        #: Where the checkpoints live (a folder, or an object store).
        self.folder: CheckpointStore = open_store(config)
        self.dir = self.folder.dir
        #: The folder as the user named it (a URL for an object store).
        self.where = where_of(config)
        #: The one way this run's checkpoints are saved into the folder.
        self.route = SaveRoute(communicator, self.folder, self.where)
        self._session = contextlib.ExitStack()
        self.sharded = sharded
        self.best_value: float | None = None
        #: The save_top_k best checkpoints kept as top-*.pt (unused when save_top_k is 1).
        self.top = TopK(config.save_top_k, config.mode)
        self.last_saved_step: int | None = None
        self.last_saved_path: Path | None = None
        self.last_saved_epoch: int | None = None
        #: The run whose checkpoints rotation may delete (None: every periodic checkpoint).
        self.run_id: str | None = None
        if not clean:
            return
        # Rank 0 takes the folder; the others learn what it holds (every rank names alike).
        error: CheckpointError | None = None
        try:
            self._session.enter_context(self.folder.session(lead=self.comm.rank == 0))
        except CheckpointError as caught:
            error = caught
        except Exception as caught:  # any failure still reaches the agreement: no rank waits
            name = type(caught).__name__
            error = CheckpointError(
                f"cannot use the checkpoint folder {self.where}: {name}: {caught}"
            )
        if self.comm.world_size > 1:
            agree_on(self.comm, error, f"starting checkpoints in {self.where}")
        elif error is not None:
            raise error

    @staticmethod
    def restarted(env: Mapping[str, str]) -> bool:
        """Whether the launcher restarted this job (``restart_count`` > 0 in ``env``)."""
        return restart_count(env) > 0

    def release(self) -> None:
        """Give up the folder's lock (rank 0; the handler's close does) and wait for uploads
        still running. Idempotent."""
        self.route.close()
        self._session.close()

    # ----------------------------------------------------------------- writing
    def save(
        self,
        target: Path,
        writer: CheckpointWriter,
        contents: Any,
        *,
        budget_s: float | None = None,
        background: bool = False,
        then: Callable[[Path], None] | None = None,
    ) -> Path:
        """Save ``contents`` as the checkpoint ``target`` through the one save route
        (SaveRoute.save). Every rank must call this."""
        return self.route.save(
            target, writer, contents, run=self.run_id, budget_s=budget_s,
            background=background, then=then,
        )  # fmt: skip

    def flush(self) -> None:
        """Wait for the store's background changes; every rank raises the same CheckpointError
        if one failed. Every rank must call this."""
        flush_together(self.folder, self.comm, self.where)

    def save_periodic(
        self,
        writer: CheckpointWriter,
        contents: Any,
        epoch: int,
        step: int,
        budget_s: float | None = None,
        background: bool = False,
    ) -> Path:
        """Save the checkpoint after ``epoch`` epochs and ``step`` steps, then point latest.json
        at it and rotate. Every rank must call this."""
        target = self.periodic_path(epoch, step)
        publish = lambda done: self.publish(done, epoch, step)  # noqa: E731
        self.save(target, writer, contents, budget_s=budget_s, background=background, then=publish)
        self.remember(target, epoch, step)
        return target

    def location(self, target: Path) -> str:
        """Where the checkpoint ``target`` lives, as the user names it."""
        return location(self.where, target)

    def periodic_path(self, epoch: int, step: int) -> Path:
        """The periodic checkpoint's path: its plain name, or with this run's id
        (``ckpt-e0002-s00000010-r<id>.pt``) when another run's checkpoint has that name."""
        plain = self.dir / periodic_name(epoch, step, self.sharded)
        owner = self.folder.checkpoints().get(plain)
        if owner is None or self.run_id is None or owner == self.run_id:
            return plain
        return plain.with_name(plain.name.replace(f"-s{step:08d}", f"-s{step:08d}-r{self.run_id}"))

    def publish(self, path: Path, epoch: int, step: int) -> None:
        """Rank 0, once the periodic checkpoint ``path`` is complete: point latest.json at it
        and delete periodic ones beyond ``keep_last``."""
        self._point_latest(path, epoch, step, "periodic")
        self._prune(keep=path)

    def remember(self, path: Path, epoch: int, step: int) -> None:
        """Remember the periodic checkpoint every rank has just written (or started to)."""
        self.last_saved_step, self.last_saved_path = step, path
        self.last_saved_epoch = epoch

    def mark_preempted(self, reason: str = "preempted") -> bool:
        """Record ``reason`` ("preempted", "interrupted") in latest.json, still naming the
        newest complete checkpoint. Rank 0 writes, best effort, and returns whether it landed;
        any rank may call this."""
        if self.comm.rank != 0:
            return True
        path = self.last_saved_path or self.folder.checkpoints().latest
        epoch, step = self.last_saved_epoch, self.last_saved_step
        if path is not None and (epoch is None or step is None):
            match = PERIODIC.match(path.name)
            epoch, step = (int(match.group(1)), int(match.group(2))) if match else (None, None)
        try:
            self._point_latest(path, epoch, step, reason)
            self.folder.flush()  # the process exits next: the emergency upload lands first
        except Exception as error:  # best effort: the run is stopping either way
            logger.bind(rank=0).error(
                "could not mark the latest checkpoint of {} as {}: {}", self.where, reason, error
            )
            return False
        return True

    def _point_latest(
        self, path: Path | None, epoch: int | None, step: int | None, reason: str
    ) -> None:
        pointer = {
            "checkpoint": None if path is None else path.name,
            "epoch": epoch,
            "global_step": step,
            "reason": reason,
            "time": time.time(),
        }
        self.folder.write_latest(pointer)

    @property
    def best_path(self) -> Path:
        """best.pt, or the folder ``best`` for sharded checkpoints."""
        return self.dir / (BEST_SHARDED if self.sharded else BEST)

    def rank(self, value: float, epoch: int, step: int) -> Ranking:
        """Rank the monitored ``value`` in memory (the checkpoint written next holds its own
        ranking); ``keep`` then makes the files. Every rank alike."""
        best = not math.isnan(value) and self.improves(value)
        if best:
            self.best_value = value
        top, dropped = None, []
        if self.config.save_top_k > 1 and self.top.admits(value):
            top = top_name(self.config.monitor, value, epoch, step, self.sharded)
            dropped = self.top.add(value, top)
        return Ranking(best, top, dropped)

    def keep(self, ranking: Ranking, source: Path | None, write: Callable[[Path], Path]) -> None:
        """Make ``ranking``'s files: copies of ``source`` (or ``write(path)`` without one),
        and delete what fell out of the top k. Every rank must call this."""
        if ranking.best:
            if source is None:
                source = write(self.best_path)
            else:
                self.route.copy(source, self.best_path, self.run_id)
        if ranking.top is None:
            return
        target = self.dir / ranking.top
        if source is None:
            write(target)
        else:
            self.route.copy(source, target, self.run_id)
        error: str | None = None
        if self.comm.rank == 0:
            try:
                for name in ranking.dropped:
                    self.folder.remove(self.dir / name)
            except (OSError, CheckpointError) as caught:
                error = f"{type(caught).__name__}: {caught}"
        agree_on(self.comm, error, f"writing checkpoint {self.location(target)}")

    def improves(self, value: float) -> bool:
        if self.best_value is None:
            return True
        return value < self.best_value if self.config.mode == "min" else value > self.best_value

    def _prune(self, keep: Path) -> None:
        """Delete this run's periodic checkpoints beyond ``keep_last`` and a step save that
        ``keep`` (its epoch's checkpoint) supersedes; never another run's."""
        runs = self.folder.checkpoints()  # the run that wrote each, as the store knows it
        periodic = sorted((p for p in runs if PERIODIC.match(p.name)), key=order, reverse=True)
        if self.run_id is not None:
            periodic = [p for p in periodic if runs[p] == self.run_id]
        step, epoch = order(keep)
        superseded = [p for p in periodic if order(p)[0] == step and order(p)[1] < epoch]
        rest = [p for p in periodic if p not in superseded]
        for old in superseded + rest[self.config.keep_last :]:
            if old != keep:
                self.folder.remove(old)

    def periodic(self) -> list[Path]:
        return [path for path in self.folder.checkpoints() if PERIODIC.match(path.name)]


__all__ = ["CheckpointManager", "Ranking"]
