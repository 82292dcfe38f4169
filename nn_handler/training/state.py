"""Where the Trainer's loop is (TrainerState) and what ``Trainer.track`` keeps (Stateful)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from nn_handler.checkpoint.registry import Stateful


@dataclass
class TrainerState:
    """Where the loop is; read it from hooks, never write it.

    Attributes:
        epoch: epochs completed (during an epoch: its 0-based index).
        global_step: optimizer steps taken, skipped ones included.
        batch_index: the batch within the epoch.
        skipped_steps: optimizer steps skipped for non-finite values, in this epoch (when the
            optimizer skips on the device: as of the last log step, the epoch's end or the
            last checkpoint).
        skipped_in_a_row: optimizer steps skipped in a row, up to the last one counted (0
            after a step that was taken).
        step_synced: whether the last batch ended an accumulation window (an optimizer step).
        last_loss: the last batch's loss, a detached device tensor (``float()`` syncs).
        last_scalars: the other scalars the last batch's ``training_step`` returned (detached
            tensors or numbers; empty when it returned none).
        should_stop: set when early stopping (or a hook) ends training after this epoch.
        batch: the batch being trained, from ``before_step`` to ``after_step`` (None
            outside a step).
        validation_seconds: time spent in mid-epoch validation (``val_check_interval``) so
            far, for monitors that time the steps around it.
        epochs: the epochs the current (or last) ``fit`` trains to, in total.
        max_steps: the optimizer steps it stops at (None: no limit).
        validated: whether the epoch that ended last ran its validation (False on the epochs
            ``check_val_every_n_epoch`` skips: monitors of ``val_`` keys skip them too).
    """

    epoch: int = 0
    global_step: int = 0
    batch_index: int = 0
    skipped_steps: int = 0
    skipped_in_a_row: int = 0
    step_synced: bool = False
    last_loss: torch.Tensor | None = None
    last_scalars: dict[str, Any] = field(default_factory=dict)
    should_stop: bool = False
    batch: Any = None
    validation_seconds: float = 0.0
    epochs: int = 0
    max_steps: int | None = None
    validated: bool = True

    def where(self) -> str:
        """Where the loop is, for an error message."""
        return f"training (epoch {self.epoch + 1}, step {self.global_step})"

    def counts(self, monitor: str) -> bool:
        """Whether a monitor of ``monitor`` (early stopping, save_best, a plateau scheduler)
        takes the epoch that just ended into account: not a ``val_`` key of an epoch that did
        not validate."""
        return self.validated or not monitor.startswith("val_")

    def ends_fit(self) -> bool:
        """Whether the loop stops after the epoch it is at (the same on every rank once the
        epoch's end is agreed): early stopping, the last epoch, or max_steps reached."""
        return (
            self.should_stop
            or self.epoch >= self.epochs
            or (self.max_steps is not None and self.global_step >= self.max_steps)
        )


__all__ = ["Stateful", "TrainerState"]
