"""The Trainer's checkpointing part: its state's registry, saving, loading and resuming. It takes
the parts, the communicator and the loop position, never the Trainer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from torch.distributed import ProcessGroup

from nn_handler.checkpoint.manager import CheckpointManager
from nn_handler.checkpoint.opening import open_on_every_rank
from nn_handler.checkpoint.registry import Part, Stateful, StateRegistry, restore_shards
from nn_handler.checkpoint.run_identity import new_run_id, run_to_continue
from nn_handler.checkpoint.saving import save_to, writer_for
from nn_handler.checkpoint.sharded import verify_sharded
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.training.checkpoint_events import CheckpointEvents
from nn_handler.training.checkpoint_format import (
    FORMAT,
    VERSION,
    assemble,
    check_checkpoint,
    check_reproducible,
    parts_of,
    plain_config,
    refuse_a_shorter_latest,
    world_change_note,
)
from nn_handler.training.fault_tolerance.shards import local_state, take_local_state
from nn_handler.training.position import LoopPosition, check_data

#: A wait for the previous background save at least this long is logged.
NOTED_WAIT_S = 0.5
#: A member's state's keys (``member_state``): its shards, and the unsharded rest.
SHARDS, REST_OF_MEMBER = "shards", "rest"


class TrainerCheckpoints:
    """The registry of the parts the Trainer hands over (``adopt``) and of the user's
    ``track``-ed state (until the fit starts), and the saving, loading and resuming of them.
    ``manager`` is None without a folder or in a fast_dev_run; ``writer`` (a ShardedWriter or
    a FileWriter) is chosen once; ``hook`` is the policy's CheckpointHook."""

    def __init__(
        self,
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
        self.registry = StateRegistry()
        self.position = position
        self.comm = comm
        self.device = device
        self.config = config
        self.run_config = run_config
        self._group = group
        self.manager = (
            CheckpointManager(config, comm, sharded=sharded) if enabled and config.dir else None
        )
        self.writer = writer_for(sharded, comm, group)
        self.hook: Any = None
        self.events = CheckpointEvents()
        self.log = logger.bind(rank=comm.rank)
        if config.async_writer == "process" and comm.rank == 0:
            self.log.warning(
                "checkpoint.async_writer='process' was removed (no measured gain over the "
                "thread); the background saves run in a thread: drop the setting"
            )
        self._first_fit = True
        self.fingerprint = fingerprint  # what defines this run (checkpoint/run_identity.py)
        self._tracked: dict[str, Stateful] = {}
        self._world_note: str | None = None  # a world-size change said at the next fit
        self.run_id: str | None = None  # the resumed checkpoint's, or new when afresh

    def adopt(self, parts: Iterable[Part], hooks: Sequence[Any] = ()) -> None:
        """Add the parts that hold the run's state; hooks with ``state_dict`` and
        ``load_state_dict`` are tracked by themselves, as ``hook.<ClassName>``; hooks with
        ``checkpoint_committed`` or ``checkpoint_to_resume`` join ``events``."""
        for part in parts:
            self.registry.add(part)
        if self.hook is not None:  # the best value and top-k that save_best compares with
            for part in self.hook.parts():
                self.registry.add(part)
        for hook in hooks:
            if isinstance(hook, Stateful):
                name = f"hook.{type(hook).__name__}"
                taken = name in self._tracked
                self.track(f"{name}.{len(self._tracked)}" if taken else name, hook)
        self.events.adopt(hooks)

    def track(self, name: str, obj: Stateful) -> None:
        """Keep ``obj`` (anything with ``state_dict()`` and ``load_state_dict(state)``) in
        every checkpoint under ``name``, each rank's own state (see ``Trainer.track``)."""
        known = self._tracked.get(name)
        if known is obj:
            return
        if known is not None:
            raise ConfigError(f"track: the name {name!r} is already tracked for another object.")
        self.registry.track(name, obj)
        self._tracked[name] = obj

    @property
    def tracked(self) -> dict[str, Stateful]:
        """The user's own checkpointed state, by name (see ``track``)."""
        return dict(self._tracked)

    def own_run(self, run_id: str | None = None) -> str:
        """This run's id, set to ``run_id`` (or created when it has none; ``None`` keeps it);
        rotation then deletes only its checkpoints."""
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
        run = (self.own_run(), self.fingerprint())
        return assemble(shared, ranks, self.comm.world_size, self.run_config, run, skip)

    def load(
        self,
        checkpoint: Mapping[str, Any],
        source: str,
        allow_world_size_change: bool | None,
        folder: Path | None = None,
        *,
        verified: bool = False,
        automatic: bool = False,
        for_inference: bool = False,
        shards: Mapping[str, Any] | None = None,
    ) -> None:
        """Give every part its state from ``checkpoint`` (with a sharded one's ``folder``,
        verified first unless ``verified``, or its ``shards`` in memory: a member's); the next
        fit continues it as the same run. Another run configuration's checkpoint is refused
        when chosen ``automatic``-ally, else loaded with a warning; ``for_inference``
        (NNHandler.load): a world-size change is said at the next fit. Every rank must call
        this with the same checkpoint."""
        if allow_world_size_change is None:
            allow_world_size_change = self.config.allow_world_size_change
        ckpt = check_checkpoint(checkpoint, source)
        if not for_inference:  # weights to predict with: the steps do not matter
            check_reproducible(ckpt.get("config"), self.run_config, source)
        refuse = automatic and self.config.resume != "force"
        saved_run, other_run = run_to_continue(ckpt, self.fingerprint(), source, refuse)
        if other_run is not None and self.comm.rank == 0:
            self.log.warning(other_run)
        saved_world, world = int(ckpt["world_size"]), self.comm.world_size
        batches_done = int((ckpt.get("trainer") or {}).get("batches_done", 0))
        self._world_note = None
        if saved_world != world:
            self._world_note = world_change_note(
                source, saved_world, world, batches_done, allow_world_size_change,
                exact=self.position.replicated,
            )  # fmt: skip
            if not for_inference:
                self.log.warning(self._world_note)
                self._world_note = None
        shared, ranks, sharded = parts_of(ckpt)
        if sharded and folder is None and shards is None:
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
        for part in self.registry.sharded():
            if shards is not None and part.name in shards:
                restore_shards(part, shards[part.name], source)
        if saved_world != world and self.position.resume is not None:
            self.position.resume.saved_world = saved_world
        self.own_run(saved_run)
        self._first_fit = False

    def _load_shards(self, folder: Path, names: list[str], source: str) -> None:
        """Every sharded part of this run that ``folder`` holds, resharded to this run."""
        for name in self.registry.load_shards(folder, names, self._group(), source):
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
        """Write the checkpoint to ``path`` (a folder when sharded; a URL: a single file,
        uploaded and committed there). Every rank must call this."""
        self._wait_writer()
        target, manager = Path(path), self.manager
        if manager is not None and target.parent == manager.dir:  # best/, top-k: the run's
            return manager.save(target, self.writer, self._contents(), budget_s=budget_s)
        config = self.config
        return save_to(
            self.comm, path, self.writer, self._contents(), run=self.run_id, budget_s=budget_s,
            storage_options=config.storage_options, timeout_s=config.store_timeout_s,
        )  # fmt: skip

    def _contents(self) -> Any:
        """What the writer saves: the whole checkpoint on rank 0 (a file), or (a folder) the
        parts' shards and the rest."""
        if not self.writer.folder:
            return self.state_dict()
        shards = self._shards()
        return self._collect(list(shards)), shards

    def _shards(self) -> dict[str, Any]:
        shards = {p.name: p.shards() for p in self.registry.sharded() if p.shards is not None}
        return {name: state for name, state in shards.items() if state}  # "optimizers": {}

    def member_state(self) -> dict[str, Any]:
        """This rank's part of its member's state, for the same rank of a member that joins
        (fault tolerance): its shards, local, with their layout, and the unsharded rest. Every
        rank of the member must call this."""
        shards = self._shards()
        rest = self.comm.broadcast_object(self._collect(list(shards)), src=0)
        return {**local_state({SHARDS: shards}), REST_OF_MEMBER: rest}

    def take_member_state(self, payload: Mapping[str, Any], source: str) -> None:
        """Load ``member_state``'s ``payload`` from the same rank of a live member: a member
        sharded otherwise is a ConfigError, a payload that does not fit a CheckpointError,
        before anything changes. Every rank of the member must call this."""
        rest = check_checkpoint(payload.get(REST_OF_MEMBER), source)  # before a shard is copied
        filled = take_local_state({SHARDS: self._shards()}, payload, source)
        self.load(rest, source, allow_world_size_change=True, shards=filled[SHARDS])

    def save_periodic(self, budget_s: float | None = None, *, final: bool = False) -> Path:
        """The periodic checkpoint of the current position; ``final`` (the end of fit, a
        preemption) never leaves it writing in the background. Every rank must call this."""
        manager = self.require_manager("save_periodic")
        state = self.position.state
        epoch, step = state.epoch, state.global_step
        self._wait_for_the_previous(manager, step)
        background = self.config.async_save and not final and self.writer.folder
        contents = self._contents()
        path = manager.save_periodic(self.writer, contents, epoch, step, budget_s, background)
        (self.events.writing if background else self.events.committed)(path, epoch, step)
        return path

    def finish(self, uploads: bool = True) -> None:
        """Wait for a checkpoint still being written in the background and commit it, and
        (``uploads``) for the uploads to an object store still running. Every rank must call
        this (the end of fit does)."""
        self._wait_writer()
        if uploads and self.manager is not None:
            self.manager.flush()

    def _wait_for_the_previous(self, manager: CheckpointManager, step: int) -> None:
        """One background save at most: wait for the previous one's commit and upload, and
        say a wait of ``NOTED_WAIT_S`` or more (rank 0)."""
        writing = manager.route.pending
        started = time.perf_counter()
        manager.flush()
        self._wait_writer()
        waited = time.perf_counter() - started
        if waited >= NOTED_WAIT_S and self.comm.rank == 0:  # (a folder's flush is instant)
            self.log.info(
                "checkpoint at step {}: waited {:.2f} s for the previous one, still {} in the "
                "background (save less often, or the store or disk is slower than the saves)",
                step,
                waited,
                "being written" if writing is not None else "uploading",
            )

    def _wait_writer(self) -> None:
        if self.manager is not None:
            self.events.waited(self.manager.route.wait())

    # ----------------------------------------------------------------- resuming
    def begin_fit(self, train_loader: Iterable[Any]) -> None:
        """Resume per the policy (first fit only) and check the loader against a checkpoint."""
        self._auto_resume()
        self.own_run()
        point = self.position.resume
        if point is None:
            self.position.state.should_stop = False
        else:
            check_data(point, train_loader, self.comm.rank)
            if self._world_note is not None:
                self.log.warning(self._world_note)
        self._world_note = None

    def resume(
        self, path: str | Path, allow_world_size_change: bool | None, missing_ok: bool
    ) -> Path | None:
        """Load ``path`` (a file, a sharded folder, a folder of checkpoints or 'latest') on
        every rank; see ``Trainer.resume``."""
        self.finish()
        opened, latest = open_on_every_rank(
            path,
            missing_ok,
            self.comm,
            self.device,
            self.config,
            lambda: self.require_manager("resume('latest')"),
        )
        if opened is None:
            return None
        self.load(
            opened.contents,
            opened.where,
            allow_world_size_change,
            opened.folder,
            verified=latest or opened.verified,
            automatic=latest,
        )
        return opened.path

    def _auto_resume(self) -> None:
        first, self._first_fit = self._first_fit, False
        policy = self.config.resume
        if not first or self.position.resume is not None:
            return
        named = self.events.resume_point()
        if named is not None:  # a hook's checkpoint (Ray's after a restart) comes first
            path, source = named
            self.resume(path, allow_world_size_change=None, missing_ok=False)
            self.log.info("resumed from {} (given by {})", path, source)
            return
        if self.manager is None:
            return
        if policy in ("auto", "force") or (
            policy == "on_restart" and self.manager.restarted(os.environ)
        ):
            found = self.resume("latest", allow_world_size_change=None, missing_ok=True)
            if found is None:
                self.log.info("resume={!r}: no checkpoint yet, starting afresh", policy)
            else:
                where = self.manager.location(found)
                self.log.info("resume={!r}: resumed from {}", policy, where)
            return
        existing = self.manager.periodic()
        if policy == "on_restart":
            refuse_a_shorter_latest(self.comm, existing, str(self.config.dir))
        if existing and self.comm.rank == 0:
            self.log.warning(
                "{} already holds {} checkpoint(s) and this run starts afresh (resume={!r}, "
                "not a restart): they are kept (rotation deletes only this run's). Use a new "
                "folder, or resume='auto' to continue the run that wrote them.",
                self.manager.dir,
                len(existing),
                policy,
            )


__all__ = ["FORMAT", "VERSION", "TrainerCheckpoints", "check_checkpoint", "plain_config"]
