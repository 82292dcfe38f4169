"""What a Trainer checkpoint holds, and how a Trainer is put back where it stopped.

A checkpoint is one ``torch.save`` file of plain values (it loads with ``weights_only=True``):

- ``model`` (plain keys), ``optimizer``, ``scheduler``, ``precision`` (the GradScaler),
  ``ema``, ``early_stopping``, ``history``, ``best`` (save_best's value), ``config``;
- ``trainer``: epochs completed, optimizer steps, batches done in the current epoch;
- ``data``: the loader's seed, batch size and batches per epoch (its position is the epoch
  and the batches done);
- ``ranks``: for every rank, its RNG states (now, and at the start of the epoch), its partial
  epoch loss and its buffers.

Resuming restores all of it and, mid-epoch, re-reads (and discards) the batches already
trained, so the data order, the RNG streams and the summed losses continue exactly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loguru import logger
from pydantic import BaseModel

from nn_handler.checkpoint.model_state import load_model_state, model_state_dict
from nn_handler.checkpoint.rng import capture_rng
from nn_handler.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from nn_handler.training.metrics import RunningLoss
    from nn_handler.training.trainer import Trainer

FORMAT = "nn_handler.checkpoint"
VERSION = 1


@dataclass
class ResumePoint:
    """What a loaded checkpoint still has to restore once the loop restarts.

    Attributes:
        start_rng: this rank's RNG state to set at the start of the next epoch (None: keep).
        step_rng: the RNG state to set after skipping ``batches_done`` batches (mid-epoch).
        batches_done: batches of the current epoch already trained.
        running: the partial epoch loss (mid-epoch).
        skipped_steps: steps of the current epoch skipped for NaN/inf.
        data: the loader description the checkpoint was written with.
    """

    start_rng: dict[str, Any] | None = None
    step_rng: dict[str, Any] | None = None
    batches_done: int = 0
    running: dict[str, Any] | None = None
    skipped_steps: int = 0
    data: dict[str, Any] = field(default_factory=dict)


def plain_config(config: BaseModel) -> dict[str, Any]:
    """A config as JSON-compatible values for a checkpoint; values JSON cannot hold (a callable
    in compile_kwargs, say) are stored as their repr."""
    try:
        return dict(config.model_dump(mode="json"))
    except Exception:  # pydantic's serialisation error for values it cannot convert
        dumped = config.model_dump()
        return json.loads(json.dumps(dumped, default=repr))  # type: ignore[no-any-return]


def describe_loader(loader: Iterable[Any]) -> dict[str, Any]:
    """The facts of a loader that fix its data order: seed, batch size, batches per epoch."""
    sampler = getattr(loader, "sampler", None)
    seed = getattr(loader, "seed", getattr(sampler, "seed", None))
    try:
        batches: int | None = len(loader)  # type: ignore[arg-type]
    except TypeError:
        batches = None
    return {
        "seed": seed if isinstance(seed, int) else None,
        "batch_size": getattr(loader, "batch_size", None),
        "batches_per_epoch": batches,
    }


def rank_state(trainer: Trainer, running: RunningLoss | None) -> dict[str, Any]:
    """This rank's part of a checkpoint (RNG, partial loss, buffers)."""
    state: dict[str, Any] = {
        "rng": capture_rng(),
        "epoch_rng": trainer.epoch_rng,
        "running": running.state_dict() if running is not None else None,
        "tracked": {name: obj.state_dict() for name, obj in trainer.tracked.items()},
    }
    if trainer.comm.world_size > 1:  # ranks' BatchNorm statistics differ between forwards
        state["buffers"] = {n: b.detach().clone() for n, b in trainer.module.named_buffers()}
    return state


def build_checkpoint(trainer: Trainer, running: RunningLoss | None = None) -> dict[str, Any] | None:
    """The whole checkpoint on rank 0 (None elsewhere). Every rank must call this, at the end
    of an accumulation window (``trainer.state.step_synced``) when inside an epoch."""
    if running is not None and not trainer.state.step_synced:
        raise ConfigError(
            f"cannot checkpoint in the middle of an accumulation window (batch "
            f"{trainer.state.batch_index + 1} of epoch {trainer.state.epoch + 1}): the "
            f"accumulated gradients are not saved. Save when trainer.state.step_synced is True."
        )
    mine = rank_state(trainer, running)
    ranks = trainer.comm.gather_object(mine, dst=0) if trainer.comm.world_size > 1 else [mine]
    if trainer.comm.rank != 0:
        return None
    state = trainer.state
    manager = trainer.checkpoints
    return {
        "format": FORMAT,
        "version": VERSION,
        "world_size": trainer.comm.world_size,
        "model": model_state_dict(trainer.module),
        "optimizer": trainer.optimizer.state_dict() if trainer.optimizer is not None else None,
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        # Manual optimization with several: every one, in order (the first also above).
        "optimizers": [o.state_dict() for o in trainer._optimizers[1:]],
        "schedulers": [s.state_dict() for s in trainer._schedulers[1:]],
        "precision": trainer.precision.state_dict(),
        "ema": trainer.ema.state_dict() if trainer.ema is not None else None,
        "early_stopping": (
            trainer.early_stopping.state_dict() if trainer.early_stopping is not None else None
        ),
        "history": trainer.history.state_dict(),
        "best": None if manager is None else manager.best_value,
        "trainer": {
            "epoch": state.epoch,
            "global_step": state.global_step,
            "batches_done": trainer.batches_done,
            "skipped_steps": state.skipped_steps,
            "skipped_in_a_row": state.skipped_in_a_row,
            "should_stop": state.should_stop,
        },
        "data": dict(trainer.data_description),
        "config": trainer.run_config,
        "ranks": ranks,
    }


def check_checkpoint(checkpoint: Any, source: str) -> dict[str, Any]:
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        keys = sorted(checkpoint)[:10] if isinstance(checkpoint, dict) else type(checkpoint)
        raise CheckpointError(
            f"{source} is not an nn_handler training checkpoint (top level: {keys}). To load "
            f"bare weights use nn_handler.checkpoint.load_model_state(model, state) or "
            f"NNHandler.load."
        )
    if int(checkpoint.get("version", 0)) > VERSION:
        raise CheckpointError(
            f"{source} was written by a newer nn_handler (format version "
            f"{checkpoint['version']} > {VERSION}); upgrade nn_handler to load it."
        )
    return checkpoint


def apply_checkpoint(
    trainer: Trainer,
    checkpoint: Mapping[str, Any],
    source: str,
    allow_world_size_change: bool = False,
) -> ResumePoint:
    """Load every part of ``checkpoint`` into ``trainer`` and return what the loop restores
    when it restarts. Every rank must call this with the same checkpoint."""
    ckpt = check_checkpoint(checkpoint, source)
    saved_world, world = int(ckpt["world_size"]), trainer.comm.world_size
    position = ckpt["trainer"]
    batches_done = int(position["batches_done"])
    if saved_world != world:
        if not allow_world_size_change or batches_done:
            where = f"mid-epoch (after batch {batches_done})" if batches_done else "after an epoch"
            raise CheckpointError(
                f"{source} was written by {saved_world} rank(s) {where}; this run has {world}. "
                f"Resume with {saved_world} rank(s) to continue exactly"
                + (
                    ", or set checkpoint.allow_world_size_change=True (or pass "
                    "allow_world_size_change=True) to continue with the data re-sharded over the "
                    "new ranks (a different data order from then on)."
                    if not batches_done
                    else "; a mid-epoch position cannot be re-sharded (load the weights only "
                    "with NNHandler.load or load_model_state)."
                )
            )
        logger.bind(rank=trainer.comm.rank).warning(
            "resuming {} (written by {} ranks) with {} ranks: the data is re-sharded, so the "
            "order differs from an uninterrupted run from here on",
            source,
            saved_world,
            world,
        )
    load_model_state(trainer.module, ckpt["model"], source=source)
    _load_part(trainer.optimizer, ckpt.get("optimizer"), "optimizer", source)
    _load_more(trainer._optimizers[1:], ckpt.get("optimizers") or [], "optimizer", source)
    _load_more(trainer._schedulers[1:], ckpt.get("schedulers") or [], "scheduler", source)
    if trainer.scheduler is None and trainer._scheduler_factory is not None:
        # Built at the start of fit (it needs the run's length): loaded then.
        trainer._pending_scheduler_state = ckpt.get("scheduler")
    else:
        _load_part(trainer.scheduler, ckpt.get("scheduler"), "scheduler", source)
    _load_part(trainer.ema, ckpt.get("ema"), "ema", source)
    _load_part(trainer.early_stopping, ckpt.get("early_stopping"), "early_stopping", source)
    trainer.precision.load_state_dict(ckpt.get("precision") or {})
    trainer.history.load_state_dict(ckpt["history"])
    if trainer.checkpoints is not None and ckpt.get("best") is not None:
        trainer.checkpoints.best_value = float(ckpt["best"])
    state = trainer.state
    state.epoch = int(position["epoch"])
    state.global_step = int(position["global_step"])
    state.should_stop = bool(position["should_stop"])
    state.skipped_steps = int(position["skipped_steps"])
    state.skipped_in_a_row = int(position.get("skipped_in_a_row", 0))
    mine = ckpt["ranks"][trainer.comm.rank] if saved_world == world else None
    # Tracked state is each rank's own; after a world-size change every rank takes rank 0's.
    _load_tracked(trainer, (mine or ckpt["ranks"][0]).get("tracked") or {}, source)
    if mine is not None and mine.get("buffers"):
        for name, buffer in trainer.module.named_buffers():
            if name in mine["buffers"]:
                buffer.copy_(mine["buffers"][name])
    point = ResumePoint(batches_done=batches_done, data=dict(ckpt.get("data") or {}))
    if mine is not None:
        point.start_rng = mine["epoch_rng"] if batches_done else mine["rng"]
        point.step_rng = mine["rng"] if batches_done else None
        point.running = mine["running"] if batches_done else None
        point.skipped_steps = state.skipped_steps
    return point


def _load_part(target: Any, state: Any, name: str, source: str) -> None:
    if target is None and state is None:
        return
    if target is None:
        logger.info("{}: its {} state is not used (this run has no {})", source, name, name)
        return
    if state is None:
        logger.warning("{} has no {} state; this run's {} starts fresh", source, name, name)
        return
    try:
        target.load_state_dict(state)
    except (KeyError, ValueError, RuntimeError) as error:
        raise CheckpointError(
            f"cannot load the {name} state from {source}: {error}. Build the {name} the same "
            f"way as the run that wrote it."
        ) from error


def _load_more(targets: list[Any], states: list[Any], kind: str, source: str) -> None:
    """The second and later optimizers (or schedulers) of manual optimization."""
    if len(targets) != len(states):
        raise CheckpointError(
            f"{source} holds {len(states) + 1} {kind}s' states but this run has "
            f"{len(targets) + 1}; build the {kind}s the same way as the run that wrote it."
        )
    for index, (target, state) in enumerate(zip(targets, states, strict=True), start=1):
        _load_part(target, state, f"{kind} {index}", source)


def _load_tracked(trainer: Trainer, saved: Mapping[str, Any], source: str) -> None:
    for name, obj in trainer.tracked.items():
        _load_part(obj, saved.get(name), f"tracked {name!r}", source)
    unused = sorted(set(saved) - set(trainer.tracked))
    if unused:
        logger.info("{}: tracked state {} is not used (this run does not track it)", source, unused)


def check_data(point: ResumePoint, loader: Iterable[Any], rank: int) -> None:
    """Warn when the loader differs from the checkpoint's (its data order would too); refuse
    a mid-epoch position the loader cannot reach."""
    now = describe_loader(loader)
    changed = {
        k: (v, now.get(k))
        for k, v in point.data.items()
        if v is not None and now.get(k) is not None and now.get(k) != v
    }
    if changed:
        logger.bind(rank=rank).warning(
            "the training loader differs from the checkpoint's ({}): the data order will "
            "differ from an uninterrupted run",
            ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items()),
        )
    batches = now.get("batches_per_epoch")
    if point.batches_done and batches is not None and point.batches_done > batches:
        raise CheckpointError(
            f"the checkpoint stopped after batch {point.batches_done} of its epoch, but this "
            f"loader has only {batches} batches per epoch; resume with the same data and "
            f"batch size."
        )


__all__ = [
    "FORMAT",
    "VERSION",
    "ResumePoint",
    "apply_checkpoint",
    "build_checkpoint",
    "check_checkpoint",
    "check_data",
    "describe_loader",
    "plain_config",
    "rank_state",
]
