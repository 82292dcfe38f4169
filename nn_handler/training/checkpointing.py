"""The Trainer's checkpoints: a StateRegistry's parts in one ``torch.save`` file of plain
values (it loads with ``weights_only=True``), and how a run is put back where it stopped.

Top level: ``format``, ``version``, ``world_size``, ``config`` and every shared part by name
(the strategy's ``model``; ``optimizer``, ``scheduler``, ``optimizers``, ``schedulers``,
``precision``, ``ema``, ``early_stopping``, ``history``; the loop's ``trainer`` and ``data``;
``best`` with a checkpoint folder); ``ranks``: for every rank its per-rank parts (``rng``,
``epoch_rng``, ``running``, the strategy's ``buffers``, the user's ``tracked.<name>``).

A sharded checkpoint (``CheckpointConfig.format``, checkpoint/sharded.py) is a folder: the
parts with a sharded view (model, optimizers, EMA) in every rank's DCP shards, the rest in
``trainer.pt`` in the format above, whose ``sharded`` entry names the parts in the shards.

``TrainerCheckpoints`` writes and reads them; it takes the registry, the communicator and the
loop position, never the Trainer.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from torch.distributed import ProcessGroup

from nn_handler.checkpoint.agreement import agree_on
from nn_handler.checkpoint.manager import (
    CheckpointManager,
    read_checkpoint,
    restart_count,
    write_together,
)
from nn_handler.checkpoint.registry import StateRegistry, restore_shards
from nn_handler.checkpoint.run_identity import (
    RUN,
    differences,
    new_run_id,
    refusal,
    run_of,
)
from nn_handler.checkpoint.sharded import (
    META,
    SHARDED,
    ShardedWriter,
    is_sharded,
    load_shards,
    verify_sharded,
)
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.training.checkpoint_format import (
    FORMAT,
    VERSION,
    check_checkpoint,
    plain_config,
    rank_parts,
)
from nn_handler.training.position import LoopPosition, check_data


class TrainerCheckpoints:
    """Writing, loading and resuming the Trainer's checkpoints.

    Attributes:
        registry: the checkpoint's parts.
        config: the CheckpointConfig.
        manager: the CheckpointManager of ``config.dir`` (None without a folder, or in a
            fast_dev_run, which neither writes nor resumes checkpoints).
        run_config: the run's configuration as plain values, stored in every checkpoint.
        writer: the ShardedWriter when checkpoints are sharded (None: single files). Either
            way a sharded checkpoint can be loaded; ``group`` gives the process group of its
            collectives (the strategy's ``checkpoint_group``).
    """

    def __init__(
        self,
        registry: StateRegistry,
        position: LoopPosition,
        comm: Communicator,
        device: torch.device,
        config: CheckpointConfig,
        run_config: dict[str, Any],
        *,
        group: Callable[[], ProcessGroup | None],
        enabled: bool = True,
        sharded: bool = False,
        fingerprint: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.registry = registry
        self.position = position
        self.comm = comm
        self.device = device
        self.config = config
        self.run_config = run_config
        self._group = group
        self.writer = ShardedWriter(comm, group) if sharded else None
        self.manager = (
            CheckpointManager(config, comm, sharded=self.writer is not None)
            if enabled and config.dir
            else None
        )
        self.log = logger.bind(rank=comm.rank)
        self._first_fit = True
        self._fingerprint = fingerprint
        #: This run's id (checkpoint/run_identity.py): adopted from the checkpoint it resumes,
        #: new when it starts afresh.
        self.run_id: str | None = None

    def _own_run(self, run_id: str | None = None) -> str:
        """Set (or create) this run's id; rotation then deletes only its checkpoints."""
        if run_id is not None or self.run_id is None:
            self.run_id = run_id or new_run_id()
        if self.manager is not None:
            self.manager.run_id = self.run_id
        return self.run_id

    def close(self) -> None:
        """Give up the checkpoint folder's lock (rank 0). Every rank may call it."""
        if self.manager is not None:
            self.manager.release()

    # ----------------------------------------------------------------- the format
    def state_dict(self) -> dict[str, Any] | None:
        """The whole checkpoint on rank 0 (None elsewhere). Every rank must call this, at the
        end of an accumulation window when inside an epoch."""
        return self._collect([])

    def _collect(self, skip: list[str]) -> dict[str, Any] | None:
        self.position.check_saveable()
        collected = self.registry.collect(self.comm, skip)
        if collected is None:
            return None
        shared, ranks = collected
        checkpoint = {
            "format": FORMAT,
            "version": VERSION,
            "world_size": self.comm.world_size,
            **shared,
            "config": self.run_config,
            "ranks": ranks,
            RUN: {"id": self._own_run(), "fingerprint": self._fingerprint()},
        }
        if skip:
            checkpoint[SHARDED] = list(skip)
        return checkpoint

    def load(
        self,
        checkpoint: Mapping[str, Any],
        source: str,
        allow_world_size_change: bool | None,
        folder: Path | None = None,
        *,
        verified: bool = False,
        automatic: bool = False,
    ) -> None:
        """Give every part its state from ``checkpoint`` (a sharded checkpoint's unsharded
        parts, with its ``folder``, whose files are checked against their checksums first
        unless ``verified``); the next fit continues where it was written, as the same run.
        A checkpoint of a run configured otherwise (checkpoint/run_identity.py) is refused
        when chosen ``automatic``-ally (resume 'latest', 'auto', 'on_restart'; not with
        'force'), and loaded with a warning otherwise. Every rank must call this with the
        same checkpoint."""
        if allow_world_size_change is None:
            allow_world_size_change = self.config.allow_world_size_change
        ckpt = check_checkpoint(checkpoint, source)
        saved_run = self._check_run(ckpt, source, automatic)
        saved_world, world = int(ckpt["world_size"]), self.comm.world_size
        batches_done = int((ckpt.get("trainer") or {}).get("batches_done", 0))
        if saved_world != world:
            _check_world_change(source, saved_world, world, allow_world_size_change)
            self.log.warning(
                "resuming {} (written by {} ranks) with {} ranks: the data is re-sharded, so "
                "the order differs from an uninterrupted run from here on{}",
                source,
                saved_world,
                world,
                " (the rest of the interrupted epoch visits each of its remaining samples once)"
                if batches_done
                else "",
            )
        shared = {k: v for k, v in ckpt.items() if k not in META}
        ranks = [rank_parts(r) for r in ckpt["ranks"]]
        sharded = [str(name) for name in ckpt.get(SHARDED) or []]
        if sharded and folder is None:
            raise CheckpointError(
                f"{source} holds the unsharded parts of a sharded checkpoint only; resume "
                f"from its folder (trainer.resume(folder)) to load the shards too."
            )
        if folder is not None and sharded and not verified:  # before any part changes
            verify_sharded(folder, self.comm, ckpt)
        self.registry.restore(
            shared, ranks, self.comm.rank, source, same_world=saved_world == world, skip=sharded
        )
        if folder is not None and sharded:
            self._load_shards(folder, sharded, source)
        if saved_world != world and self.position.resume is not None:
            self.position.resume.saved_world = saved_world
        self._own_run(saved_run)
        self._first_fit = False

    def _check_run(self, ckpt: Mapping[str, Any], source: str, automatic: bool) -> str | None:
        """The checkpoint's run id, once its run's configuration is found to be this one's
        (or the difference is allowed: see ``load``)."""
        saved_run, saved = run_of(ckpt)
        found = differences(saved, self._fingerprint())
        if not found:
            return saved_run
        if automatic and self.config.resume != "force":
            raise CheckpointError(refusal(source, found))
        if self.comm.rank == 0:
            self.log.warning(
                "{} was written by another run configuration ({}); continuing its state with "
                "this run's settings",
                source,
                "; ".join(found),
            )
        return saved_run

    def _load_shards(self, folder: Path, names: list[str], source: str) -> None:
        """Every sharded part of this run that ``folder`` holds, resharded to this run."""
        parts = [p for p in self.registry.sharded() if p.name in names]
        template = {p.name: p.shards() for p in parts if p.shards is not None}
        load_shards(folder, template, self._group())  # raises alike on every rank
        for part in parts:
            restore_shards(part, template[part.name], source)
        for name in sorted(set(self.registry.names()) & set(names) - set(template)):
            self.log.info(
                "{}: its {} shards are not used (this run has no such part)", source, name
            )

    # ----------------------------------------------------------------- writing
    def require_manager(self, what: str) -> CheckpointManager:
        if self.manager is None:
            raise ConfigError(
                f"{what} needs a checkpoint folder: set CheckpointConfig(dir=...) "
                f"(HandlerConfig.checkpoint.dir)."
            )
        return self.manager

    def save(self, path: str | Path, budget_s: float | None = None) -> Path:
        """Write the checkpoint to ``path`` (a folder when sharded). Every rank must call this."""
        if self.writer is None:
            return write_together(self.comm, self.state_dict(), path, budget_s)
        return self._save_sharded(self.writer, Path(path))

    def _save_sharded(
        self,
        writer: ShardedWriter,
        target: Path,
        *,
        asynchronous: bool = False,
        then: Callable[[Path], None] | None = None,
    ) -> Path:
        shards = {p.name: p.shards() for p in self.registry.sharded() if p.shards is not None}
        shards = {name: state for name, state in shards.items() if state}  # "optimizers": {}
        rest = self._collect(list(shards))
        return writer.save(rest, shards, target, asynchronous=asynchronous, then=then)

    def save_periodic(self, budget_s: float | None = None, *, final: bool = False) -> Path:
        """The periodic checkpoint of the current position; ``final`` (the end of fit, a
        preemption) never leaves it writing in the background. Every rank must call this."""
        manager = self.require_manager("save_periodic")
        state = self.position.state
        epoch, step = state.epoch, state.global_step
        if self.writer is None:
            return manager.save_periodic(self.state_dict(), epoch, step, budget_s)
        path = manager.periodic_path(epoch, step)
        self._save_sharded(
            self.writer,
            path,
            asynchronous=self.config.async_save and not final,
            then=lambda done: manager.committed(done, epoch, step),
        )
        manager.saved(path, epoch, step)
        return path

    def finish(self) -> None:
        """Wait for a checkpoint still being written in the background and commit it. Every
        rank must call this (the end of fit does)."""
        if self.writer is not None:
            self.writer.wait()

    # ----------------------------------------------------------------- resuming
    def begin_fit(self, train_loader: Iterable[Any]) -> None:
        """Resume per the policy (first fit only) and check the loader against a checkpoint."""
        self._auto_resume()
        self._own_run()
        point = self.position.resume
        if point is None:
            self.position.state.should_stop = False
        else:
            check_data(point, train_loader, self.comm.rank)

    def resume(
        self, path: str | Path, allow_world_size_change: bool | None, missing_ok: bool
    ) -> Path | None:
        self.finish()
        verified = automatic = False
        if str(path) == "latest" or (Path(path).is_dir() and not is_sharded(path)):
            target, checkpoint = self._load_latest(path, missing_ok)
            if target is None:
                return None
            verified = automatic = True
        else:
            target, problem, checkpoint = Path(path), None, None
            try:
                checkpoint = read_checkpoint(target, self.device)
            except Exception as error:
                problem = error
            agree_on(self.comm, problem, f"loading checkpoint {target}")
        folder = target if is_sharded(target) else None
        self.load(
            checkpoint,
            str(target),
            allow_world_size_change,
            folder,
            verified=verified,
            automatic=automatic,
        )
        return target

    def _load_latest(self, path: str | Path, missing_ok: bool) -> tuple[Path | None, Any]:
        """The newest complete, verified checkpoint and its contents (a sharded one's
        unsharded parts, its files checked by every rank): rank 0 picks the newest readable
        one, every rank reads it and checks its share; a damaged one is skipped with a
        warning saying why, and the previous one is tried."""
        if str(path) == "latest":
            manager = self.require_manager("resume('latest')")
        else:
            folder = CheckpointConfig(dir=str(path))
            manager = CheckpointManager(
                folder, self.comm, clean=False, sharded=self.writer is not None
            )
        skipped: list[Path] = []
        while True:
            name, checkpoint = self._pick(manager, skipped)
            if name is None:
                if missing_ok:
                    return None, None
                raise CheckpointError(f"no complete checkpoint in {manager.dir} to resume from.")
            target = Path(name)
            if not is_sharded(target):
                return target, checkpoint
            try:
                verify_sharded(target, self.comm, checkpoint)
            except CheckpointError as error:
                if self.comm.rank == 0:
                    self.log.warning("{}; trying the previous checkpoint", error)
                skipped.append(target)
                continue
            return target, checkpoint

    def _pick(self, manager: CheckpointManager, skipped: list[Path]) -> tuple[str | None, Any]:
        """Rank 0 picks the newest readable checkpoint not in ``skipped``; every rank reads
        that one (the same CheckpointError on every rank if one cannot)."""
        comm, device = self.comm, self.device
        name: str | None = None
        checkpoint: Any = None
        problem: BaseException | None = None
        if comm.rank == 0:
            try:
                found = manager.load_latest(device, skip=skipped)
                if found is not None:
                    name, checkpoint = str(found[0]), found[1]
            except Exception as error:
                problem = error
        if comm.world_size > 1:
            name = comm.broadcast_object(name)
            if name is not None and comm.rank != 0:
                try:
                    checkpoint = read_checkpoint(Path(name), device)
                except Exception as error:
                    problem = error
        agree_on(comm, problem, f"loading the latest checkpoint in {manager.dir}")
        return name, checkpoint

    def _auto_resume(self) -> None:
        first, self._first_fit = self._first_fit, False
        policy = self.config.resume
        if not first or self.position.resume is not None or self.manager is None:
            return
        if policy in ("auto", "force") or (
            policy == "on_restart" and restart_count(os.environ) > 0
        ):
            found = self.resume("latest", allow_world_size_change=None, missing_ok=True)
            if found is None:
                self.log.info("resume={!r}: no checkpoint yet, starting afresh", policy)
            else:
                self.log.info("resume={!r}: resumed from {}", policy, found)
            return
        existing = self.manager.periodic()
        if existing and self.comm.rank == 0:
            self.log.warning(
                "{} already holds {} checkpoint(s) and this run starts afresh (resume={!r}, "
                "not a restart): they are kept (rotation deletes only this run's). Use a new "
                "folder, or resume='auto' to continue the run that wrote them.",
                self.manager.dir,
                len(existing),
                policy,
            )


def _check_world_change(source: str, saved_world: int, world: int, allowed: bool) -> None:
    if allowed:
        return
    raise CheckpointError(
        f"{source} was written by {saved_world} rank(s); this run has {world}. Resume with "
        f"{saved_world} rank(s) to continue exactly, or set "
        f"checkpoint.allow_world_size_change=True (or pass allow_world_size_change=True) to "
        f"continue with the data re-sharded over the new ranks (a different data order from "
        f"then on; mid-epoch, the rest of the epoch visits each remaining sample once)."
    )


__all__ = ["FORMAT", "META", "VERSION", "TrainerCheckpoints", "check_checkpoint", "plain_config"]
