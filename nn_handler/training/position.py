"""LoopPosition: where the training loop is, as checkpoint parts.

It absorbs what only checkpoints need: the RNG state at the start of the epoch, the batches
done in it, the loader's description and the partial epoch loss. Its parts:

- ``trainer`` (shared): epochs completed, optimizer steps, batches done, skipped steps, stop;
- ``data`` (shared): the loader's seed, batch size and batches per epoch;
- ``rng``, ``epoch_rng``, ``running`` (per rank): the RNG state now and at the epoch start, and
  the partial epoch loss.

Restoring them leaves a ResumePoint that the loop takes when it restarts: mid-epoch it re-reads
(and discards) the batches already trained, so the data order, the RNG streams and the summed
losses continue exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from loguru import logger

from nn_handler.checkpoint.registry import Part
from nn_handler.checkpoint.rng import capture_rng, restore_rng
from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.training.metrics import RunningLoss
from nn_handler.training.state import TrainerState


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
        saved_world: the number of ranks that wrote it, when this run has another (a
            mid-epoch position then continues with the rest of the epoch re-sharded).
    """

    start_rng: dict[str, Any] | None = None
    step_rng: dict[str, Any] | None = None
    batches_done: int = 0
    running: dict[str, Any] | None = None
    skipped_steps: int = 0
    data: dict[str, Any] = field(default_factory=dict)
    saved_world: int | None = None


def _nothing() -> None:
    return None


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


class LoopPosition:
    """The loop's position (TrainerState plus what only checkpoints need).

    Attributes:
        state: the Trainer's TrainerState (shared, not copied).
        batches_done: batches of the current epoch that ended an optimizer step.
        epoch_rng: this rank's RNG state at the start of the current epoch.
        data: the current loader's description.
        running: the current epoch's partial loss (None between epochs).
        resume: what a restored checkpoint still has to restore (None: nothing).
    """

    def __init__(self, state: TrainerState, replicated: bool = False) -> None:
        self.state = state
        self.replicated = replicated  # the running loss is the same on every rank
        self.batches_done = 0
        self.epoch_rng: dict[str, Any] | None = None
        self.data: dict[str, Any] = {}
        self.running: RunningLoss | None = None
        self.resume: ResumePoint | None = None
        #: Whether early stopping (not a hook) set ``state.should_stop``.
        self.stopped_early = False
        #: Called before the position is recorded (the Trainer's: count the skipped steps
        #: decided on the device, so ``state`` is up to date; no collective).
        self.before_save: Callable[[], None] = _nothing

    # ----------------------------------------------------------------- the loop's calls
    def start_epoch(self, loader: Iterable[Any]) -> None:
        """Restore a resumed epoch's starting RNG, then remember it and the loader."""
        if self.resume is not None and self.resume.start_rng is not None:
            restore_rng(self.resume.start_rng)
        self.epoch_rng = capture_rng()
        self.data = describe_loader(loader)

    def end_epoch(self) -> None:
        self.batches_done = 0

    @property
    def epoch_batches_done(self) -> int:
        """The batches of the current epoch trained so far, by this fit or before a resume,
        a join or a held epoch (0: between epochs)."""
        return self.resume.batches_done if self.resume is not None else self.batches_done

    @property
    def mid_epoch(self) -> bool:
        """Whether an epoch is in progress (between ``train_epoch``s: one that max_steps
        ended before its last batch)."""
        return self.running is not None

    def hold(self) -> None:
        """The epoch in progress stops here and goes on at the next fit, exactly as from a
        checkpoint written now: the batches done are re-read and skipped, the RNG streams and
        the partial loss restored."""
        if self.running is None:
            return
        self.before_save()
        self.resume = ResumePoint(
            start_rng=self.epoch_rng,
            step_rng=capture_rng(),
            batches_done=self.batches_done,
            running=self.running.state_dict(),
            skipped_steps=self.state.skipped_steps,
            data=dict(self.data),
        )
        self.running = None

    def take_resume(self) -> ResumePoint | None:
        point, self.resume = self.resume, None
        return point

    def check_saveable(self) -> None:
        """A checkpoint inside an epoch must be taken at the end of an accumulation window
        (the accumulated gradients are not saved). The same answer on every rank."""
        if self.running is not None and not self.state.step_synced:
            raise ConfigError(
                f"cannot checkpoint in the middle of an accumulation window (batch "
                f"{self.state.batch_index + 1} of epoch {self.state.epoch + 1}): the "
                f"accumulated gradients are not saved. Save when trainer.state.step_synced is "
                f"True."
            )

    # ----------------------------------------------------------------- checkpoint parts
    def parts(self) -> list[Part]:
        return [
            Part("trainer", self._save_position, self._load_position, missing="error"),
            Part("data", self._save_data, self._load_data, missing="ignore"),
            Part("rng", self._save_rng, self._load_rng, per_rank=True, missing="ignore"),
            Part(
                "epoch_rng",
                self._save_epoch_rng,
                self._load_epoch_rng,
                per_rank=True,
                missing="ignore",
            ),
            Part(
                "running",
                self._save_running,
                self._load_running,
                per_rank=True,
                missing="ignore",
                on_resize="rank0" if self.replicated else "keep",
            ),
        ]

    def saved_batches_done(self, shared: dict[str, Any]) -> int:
        """The batches done recorded in a checkpoint's shared states."""
        return int((shared.get("trainer") or {}).get("batches_done", 0))

    # A checkpoint written while a restored one's position is still to be taken by the loop
    # (saved between a resume and the fit: a fault-tolerant member sends its state to a
    # joining one there) is that position, not the loop's own, which has not moved yet.
    def _save_position(self) -> dict[str, Any]:
        self.before_save()
        state, point = self.state, self.resume
        return {
            "epoch": state.epoch,
            "global_step": state.global_step,
            "batches_done": self.batches_done if point is None else point.batches_done,
            "skipped_steps": state.skipped_steps,
            "skipped_in_a_row": state.skipped_in_a_row,
            "should_stop": state.should_stop,
            "stopped_early": self.stopped_early,
        }

    def _save_data(self) -> dict[str, Any]:
        return dict(self.data if self.resume is None else self.resume.data)

    def _save_rng(self) -> dict[str, Any]:
        point = self.resume
        pending = (
            None if point is None else point.step_rng if point.batches_done else point.start_rng
        )
        return capture_rng() if pending is None else pending

    def _save_epoch_rng(self) -> dict[str, Any] | None:
        point = self.resume
        return self.epoch_rng if point is None or not point.batches_done else point.start_rng

    def _save_running(self) -> dict[str, Any] | None:
        if self.resume is not None:
            return self.resume.running
        return self.running.state_dict() if self.running is not None else None

    def _load_position(self, saved: dict[str, Any], _source: str) -> None:
        state = self.state
        state.epoch = int(saved["epoch"])
        state.global_step = int(saved["global_step"])
        state.should_stop = bool(saved["should_stop"])
        self.stopped_early = bool(saved.get("stopped_early", False))
        state.skipped_steps = int(saved["skipped_steps"])
        state.skipped_in_a_row = int(saved.get("skipped_in_a_row", 0))
        self.resume = ResumePoint(
            batches_done=int(saved["batches_done"]), skipped_steps=state.skipped_steps
        )

    def _point(self) -> ResumePoint:
        if self.resume is None:  # the shared 'trainer' part is restored first
            self.resume = ResumePoint()
        return self.resume

    def _load_data(self, saved: dict[str, Any], _source: str) -> None:
        self._point().data = dict(saved)

    def _load_rng(self, saved: dict[str, Any], _source: str) -> None:
        point = self._point()
        if point.batches_done:
            point.step_rng = saved
        else:
            point.start_rng = saved

    def _load_epoch_rng(self, saved: dict[str, Any], _source: str) -> None:
        point = self._point()
        if point.batches_done:
            point.start_rng = saved

    def _load_running(self, saved: dict[str, Any], _source: str) -> None:
        point = self._point()
        if point.batches_done:
            point.running = saved


def check_data(point: ResumePoint, loader: Iterable[Any], rank: int) -> None:
    """Warn when the loader differs from the checkpoint's (its data order would too); refuse
    a mid-epoch position the loader cannot reach."""
    now = describe_loader(loader)
    resized = point.saved_world is not None  # batches per epoch follow the world size
    changed = {
        k: (v, now.get(k))
        for k, v in point.data.items()
        if v is not None
        and now.get(k) is not None
        and now.get(k) != v
        and not (resized and k == "batches_per_epoch")
    }
    if changed:
        logger.bind(rank=rank).warning(
            "the training loader differs from the checkpoint's ({}): the data order will "
            "differ from an uninterrupted run",
            ", ".join(f"{k}: {a} -> {b}" for k, (a, b) in changed.items()),
        )
    if point.saved_world is not None:  # the batch count follows the world size
        return
    batches = now.get("batches_per_epoch")
    if point.batches_done and batches is not None and point.batches_done > batches:
        raise CheckpointError(
            f"the checkpoint stopped after batch {point.batches_done} of its epoch, but this "
            f"loader has only {batches} batches per epoch; resume with the same data and "
            f"batch size."
        )


__all__ = ["LoopPosition", "ResumePoint", "check_data", "describe_loader"]
