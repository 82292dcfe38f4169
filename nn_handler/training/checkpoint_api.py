"""The Trainer's checkpoint parts and its public save / load / resume methods. Mixed into
Trainer: it registers every stateful part once (``checkpoint_parts``) and hands the registry
to TrainerCheckpoints (training/checkpointing.py), which never sees the Trainer."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from nn_handler.checkpoint.manager import CheckpointManager
from nn_handler.checkpoint.registry import Part, Stateful, StateRegistry, part_of
from nn_handler.checkpoint.run_identity import fingerprint
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.training.checkpoint_hook import CheckpointHook
from nn_handler.training.checkpointing import TrainerCheckpoints
from nn_handler.training.early_stopping import EarlyStopping
from nn_handler.training.history import History
from nn_handler.training.parts import TrainerParts
from nn_handler.training.position import LoopPosition
from nn_handler.training.sharded_ema import ShardedEma


class CheckpointMixin(TrainerParts):
    """``track``, ``state_dict`` / ``load_state_dict``, ``save_checkpoint``,
    ``save_periodic`` and ``resume``."""

    history: History
    early_stopping: EarlyStopping | None
    position: LoopPosition
    checkpoint_parts: StateRegistry
    checkpointing: TrainerCheckpoints
    checkpoint_hook: CheckpointHook | None
    _optimizers: list[torch.optim.Optimizer]
    _schedulers: list[Any]
    _scheduler_factory: Callable[[Any, int], Any] | None
    _pending_scheduler_state: Any
    hyperparameters: Callable[[], dict[str, Any]]
    initial_lr: float | None

    def _build_checkpointing(
        self, config: CheckpointConfig, run_config: dict[str, Any], hooks: list[Any]
    ) -> None:
        """The registry of every stateful part, the checkpoint service and, with a folder,
        the CheckpointHook. Called once, after the optimizers exist."""
        registry = self.checkpoint_parts = StateRegistry()
        for part in self.strategy.checkpoint_parts():
            registry.add(part)
        self._register_optimization_parts(registry)
        registry.add(part_of("history", self.history, missing="error"))
        self.checkpointing = TrainerCheckpoints(
            registry,
            self.position,
            self.comm,
            self.device,
            config,
            run_config,
            enabled=not self.config.fast_dev_run,
            group=self.strategy.checkpoint_group,
            sharded=_sharded(config, self.strategy.collective_state),
            fingerprint=self._run_fingerprint,
        )
        self.checkpoint_hook = None
        if self.checkpointing.manager is not None:
            self.checkpoint_hook = CheckpointHook(self.checkpointing, self.history, self.device)
            registry.add(self.checkpoint_hook.part())
        for part in self.position.parts():
            registry.add(part)
        for hook in hooks:
            if isinstance(hook, Stateful):
                name = f"hook.{type(hook).__name__}"
                taken = f"tracked.{name}" in registry
                self.track(f"{name}.{len(self._tracked)}" if taken else name, hook)

    def _run_fingerprint(self) -> dict[str, Any]:
        """What defines this run (checkpoint/run_identity.py): the hyperparameters, with the
        learning rate the optimizer had when the Trainer got it (a scheduler moves it)."""
        params = self.hyperparameters()
        if self.initial_lr is not None:
            params["lr"] = self.initial_lr
        return fingerprint(params)

    def _register_optimization_parts(self, registry: StateRegistry) -> None:
        strategy = self.strategy
        if self.optimizer is not None:
            optimizer = self.optimizer
            registry.add(
                Part(
                    "optimizer",
                    lambda: strategy.optimizer_state_dict(optimizer),
                    lambda state, _source: strategy.load_optimizer_state_dict(optimizer, state),
                    collective=strategy.collective_state,
                    shards=lambda: strategy.optimizer_shards(optimizer),
                    load_shards=lambda state, _source: strategy.load_optimizer_shards(
                        optimizer, state
                    ),
                )
            )
        # Manual optimization with several: the second and later ones, in order.
        registry.add(
            Part(
                "optimizers",
                lambda: [strategy.optimizer_state_dict(o) for o in self._optimizers[1:]],
                lambda states, source: _load_more(
                    self._optimizers[1:],
                    states,
                    "optimizer",
                    source,
                    strategy.load_optimizer_state_dict,
                ),
                missing="ignore",
                collective=strategy.collective_state,
                # DCP keys are names: the second optimizer is "1", and so on.
                shards=lambda: {
                    str(i): strategy.optimizer_shards(o)
                    for i, o in enumerate(self._optimizers[1:], start=1)
                },
                load_shards=lambda states, source: _load_more(
                    self._optimizers[1:],
                    [states[str(i)] for i in range(1, len(self._optimizers))],
                    "optimizer",
                    source,
                    strategy.load_optimizer_shards,
                ),
            )
        )
        if self.scheduler is not None or self._scheduler_factory is not None:
            registry.add(Part("scheduler", self._save_scheduler, self._load_scheduler))
        registry.add(
            Part(
                "schedulers",
                lambda: [s.state_dict() for s in self._schedulers[1:]],
                lambda states, source: _load_more(
                    self._schedulers[1:],
                    states,
                    "scheduler",
                    source,
                    lambda scheduler, state: scheduler.load_state_dict(state),
                ),
                missing="ignore",
            )
        )
        precision = self.precision
        registry.add(
            Part(
                "precision",
                precision.state_dict,
                lambda state, _source: precision.load_state_dict(state or {}),
                missing="ignore",
            )
        )
        ema = self.ema
        if isinstance(ema, ShardedEma):  # gathered whole, like the model (a collective)
            registry.add(
                Part(
                    "ema",
                    ema.state_dict,
                    ema.load_state_dict,
                    collective=True,
                    shards=ema.shards,
                    load_shards=ema.load_shards,
                )
            )
        elif ema is not None:
            plain = ema
            registry.add(
                Part(
                    "ema",
                    plain.state_dict,
                    lambda state, _source: plain.load_state_dict(state),
                    shards=plain.state_dict,
                    load_shards=lambda state, _source: plain.load_state_dict(state),
                )
            )
        if self.early_stopping is not None:
            registry.add(part_of("early_stopping", self.early_stopping))

    def _save_scheduler(self) -> Any:
        return self.scheduler.state_dict() if self.scheduler is not None else None

    def _load_scheduler(self, state: Any, _source: str) -> None:
        if self.scheduler is None:  # built at the start of fit (it needs the run's length)
            self._pending_scheduler_state = state
        else:
            self.scheduler.load_state_dict(state)

    # ----------------------------------------------------------------- public
    def track(self, name: str, obj: Stateful) -> None:
        """Keep ``obj`` (anything with ``state_dict()`` and ``load_state_dict(state)``) in
        every checkpoint under ``name``: each rank's own state is saved and restored on that
        rank, so per-rank sums or counters resume exactly (after a change of world size every
        rank takes rank 0's). Call it on every rank before ``fit`` or ``resume`` (which restore
        it), e.g. in ``configure_optimizers`` or right after building the handler. Hooks with
        ``state_dict``/``load_state_dict`` are tracked by themselves, as
        ``hook.<ClassName>``."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"track needs a non-empty str name, got {name!r}.")
        missing = [
            m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))
        ]
        if missing:
            raise ConfigError(
                f"track({name!r}, ...): {type(obj).__name__} has no {' or '.join(missing)}; "
                f"track an object with state_dict() and load_state_dict(state)."
            )
        known = self.tracked.get(name)
        if known is obj:
            return
        if known is not None:
            raise ConfigError(f"track: the name {name!r} is already tracked for another object.")
        self.checkpoint_parts.add(part_of(f"tracked.{name}", obj, per_rank=True, on_resize="rank0"))
        self._tracked[name] = obj

    @property
    def tracked(self) -> dict[str, Stateful]:
        """The user's own checkpointed state, by name (see ``track``)."""
        return dict(self._tracked)

    _tracked: dict[str, Stateful]

    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The CheckpointManager of CheckpointConfig.dir (None without a folder)."""
        return self.checkpointing.manager

    @property
    def run_config(self) -> dict[str, Any]:
        """The run's configuration as plain values, stored in checkpoints (NNHandler puts its
        whole HandlerConfig here)."""
        return self.checkpointing.run_config

    @run_config.setter
    def run_config(self, value: dict[str, Any]) -> None:
        self.checkpointing.run_config = value

    @property
    def checkpoint_config(self) -> CheckpointConfig:
        return self.checkpointing.config

    def state_dict(self) -> dict[str, Any] | None:
        """The full checkpoint (see training/checkpointing.py) on rank 0, None on the other
        ranks. Every rank must call this (it gathers every rank's RNG state)."""
        return self.checkpointing.state_dict()

    def load_state_dict(
        self,
        checkpoint: Mapping[str, Any],
        source: str = "checkpoint",
        allow_world_size_change: bool | None = None,
    ) -> None:
        """Restore a checkpoint from ``state_dict``; the next ``fit`` continues exactly
        where it was written (mid-epoch too). ``allow_world_size_change`` (default:
        CheckpointConfig.allow_world_size_change) accepts another number of ranks (the data
        re-sharded). Every rank must call this with the same one."""
        self.checkpointing.load(checkpoint, source, allow_world_size_change)

    def save_checkpoint(self, path: str | Path, budget_s: float | None = None) -> Path:
        """Write the full checkpoint to ``path`` atomically (rank 0 writes; a sharded
        checkpoint is a folder every rank writes its shards into). Every rank must call this;
        all raise CheckpointError if the write failed."""
        return self.checkpointing.save(path, budget_s)

    def save_periodic(self, budget_s: float | None = None) -> Path:
        """Write the periodic checkpoint of the current position (named by epoch and step) and
        point latest.json at it. Every rank must call this."""
        return self.checkpointing.save_periodic(budget_s)

    def resume(
        self,
        path: str | Path = "latest",
        *,
        allow_world_size_change: bool | None = None,
        missing_ok: bool = False,
    ) -> Path | None:
        """Load a checkpoint so that the next ``fit`` continues the run exactly.

        ``path`` is a checkpoint file, a checkpoint folder, or "latest" (the newest complete
        checkpoint in CheckpointConfig.dir; an unreadable newest one falls back to the previous).
        Rank 0 chooses the file and every rank loads it (map_location: this rank's device).
        Returns the path, or None when ``missing_ok`` and there is none.
        ``allow_world_size_change`` defaults to CheckpointConfig.allow_world_size_change.
        Every rank must call this; a failure on any rank raises CheckpointError on every rank.
        """
        return self.checkpointing.resume(path, allow_world_size_change, missing_ok)


def _sharded(config: CheckpointConfig, sharded_model: bool) -> bool:
    """Whether checkpoints are sharded folders (``format``; 'auto': when the model is)."""
    sharded = config.format == "sharded" or (config.format == "auto" and sharded_model)
    if config.async_save and not sharded:
        raise ConfigError(
            "checkpoint.async_save writes sharded checkpoints in the background, and this run "
            "writes single files (format='auto' shards with strategy='fsdp' only): set "
            "checkpoint.format='sharded', or async_save=False."
        )
    return sharded


def _load_more(
    targets: list[Any],
    states: list[Any],
    kind: str,
    source: str,
    load: Callable[[Any, Any], Any],
) -> None:
    """The second and later optimizers (or schedulers) of manual optimization."""
    if len(targets) != len(states):
        raise CheckpointError(
            f"{source} holds {len(states) + 1} {kind}s' states but this run has "
            f"{len(targets) + 1}; build the {kind}s the same way as the run that wrote it."
        )
    for index, (target, state) in enumerate(zip(targets, states, strict=True), start=1):
        try:
            load(target, state)
        except (KeyError, ValueError, RuntimeError) as error:
            raise CheckpointError(
                f"cannot load the {kind} {index} state from {source}: {error}. Build the "
                f"{kind}s the same way as the run that wrote it."
            ) from error


__all__ = ["CheckpointMixin"]
