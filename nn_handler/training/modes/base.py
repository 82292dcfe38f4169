"""StepMode: the one part through which the Trainer runs a step in the normal, reproducible or
fault-tolerant way, so the loop calls each lifecycle point without asking which mode it has.
The base class is the normal mode: ``Trainer.run_step`` trains micro-batch by micro-batch
(DDP's or FSDP's reduction), and every other member does nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

from nn_handler.checkpoint.registry import Part
from nn_handler.distributed.communicator import Communicator

if TYPE_CHECKING:
    from nn_handler.training.checkpointing import TrainerCheckpoints

#: A Trainer's ``training_step``: a batch in, a loss (or a dict with one) out.
TrainingStep = Callable[[Any], Any]


class Reporting(Protocol):
    """Who writes the run's experiment trackers, and the key the run is known by."""

    @property
    def writes(self) -> bool:
        """Whether this process writes the run's trackers."""

    @property
    def run_key(self) -> str | None:
        """The name every process that may write the trackers knows the run by (None: one
        process writes, and keeps its run in its checkpoints)."""


@dataclass(frozen=True)
class RankZero:
    """The Reporting of a run whose rank 0 writes the trackers (every mode but the members')."""

    rank: int

    @property
    def writes(self) -> bool:
        return self.rank == 0

    @property
    def run_key(self) -> str | None:
        return None


class StepMode:
    """How the Trainer's steps run among its ranks: the normal mode (this class), the
    reproducible mode's exact or float step, or a fault-tolerant member around one of them.
    Every rank holds the same mode and must call each method alike."""

    #: Whether ``step`` runs the whole optimizer step (forward, backward and the reduction of
    #: every micro-batch): the reproducible modes. False: ``Trainer.run_step`` runs each
    #: micro-batch itself (the normal mode).
    whole_steps = False

    def __init__(self, comm: Communicator) -> None:
        self.comm = comm
        #: Who writes the trackers (Trainer.is_reporting_process, Trainer.run_key).
        self.reporting: Reporting = RankZero(comm.rank)

    def check(self, train: Iterable[Any], val: Sequence[Iterable[Any]]) -> None:
        """Before the first step: refuse loaders the mode cannot train from (``val``: every
        validation set's)."""

    def begin_fit(self, global_step: int, checkpoints: TrainerCheckpoints) -> None:
        """A fit starts at ``global_step``, after its own resume (a member joins its run)."""

    def step(self, batch: Any, training_step: TrainingStep, global_step: int) -> torch.Tensor:
        """The whole optimizer step's forward, backward and reduction (``whole_steps``
        modes); returns the step's detached loss. Every rank must call this."""
        raise NotImplementedError(f"{type(self).__name__} runs no whole steps")

    def first_inputs(self, batch: Any) -> Any:
        """A micro-batch of ``batch`` to estimate the activations with (the memory plan)."""
        return batch

    def end_fit(self, completed: bool = False) -> None:
        """The fit ended (also when it raised; ``completed``: it did not): a member leaves
        its run."""

    def parts(self) -> list[Part]:
        """The mode's own state in checkpoints (none for the normal mode)."""
        return []

    def record_comm(self) -> Communicator:
        """The communicator an epoch's training record is averaged over: the ranks' (each
        saw its own batches); a reproducible mode's records are the same on every rank."""
        return self.comm


__all__ = ["RankZero", "Reporting", "StepMode", "TrainingStep"]
