"""MemberMode: the step mode of a fault-tolerant run's member (TrainerConfig.fault_tolerance).
It wraps the mode whose steps are summed (the reproducible mode's exact or float step, which
knows nothing of it) and runs each of its steps among the run's members (steps.py): the
members agree on a step, each trains the micro-batches it owns, and a step the run abandons is
redone by the members left."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from nn_handler.checkpoint.registry import Part
from nn_handler.config.fault_tolerance import FaultToleranceConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps, SummedStep
from nn_handler.training.modes.base import StepMode, TrainingStep

if TYPE_CHECKING:
    from nn_handler.training.checkpointing import TrainerCheckpoints


class MemberMode(StepMode):
    """``inner``'s steps, run by this process as one member of the run ``config`` describes;
    ``summed``: the step ``inner`` sums through (its communicator becomes the members')."""

    whole_steps = True

    def __init__(
        self,
        config: FaultToleranceConfig,
        inner: StepMode,
        summed: SummedStep,
        comm: Communicator,
    ) -> None:
        super().__init__(comm)
        self.inner = inner
        #: The member's part of the run: its replica, its verdicts, the steps it redid.
        self.steps = FaultTolerantSteps(config, summed, comm)
        self.reporting = self.steps  # the first member of the last agreed step writes

    def check(self, train: Iterable[Any], val: Sequence[Iterable[Any]]) -> None:
        self.inner.check(train, val)

    def begin_fit(self, global_step: int, checkpoints: TrainerCheckpoints) -> None:
        """Join the run at ``global_step`` (after this member's own resume, if any). Behind
        it, the member loads the checkpoint state of one that is not; when the run cannot go
        on, it saves an emergency checkpoint (with a folder). See FaultTolerantSteps."""
        source = "the state of a member of the run"
        self.steps.begin_fit(
            global_step,
            checkpoints.state_dict,
            functools.partial(checkpoints.load, source=source, allow_world_size_change=True),
            functools.partial(checkpoints.save_periodic, final=True)
            if checkpoints.manager is not None
            else None,
            checkpoints.own_run,
            checkpoints.fingerprint(),
            functools.partial(_preempted, checkpoints),
        )

    def step(self, batch: Any, training_step: TrainingStep, global_step: int) -> torch.Tensor:
        """The inner step on this member's micro-batches, redone until the run commits it."""
        run = functools.partial(
            self.inner.step, training_step=training_step, global_step=global_step
        )  # a partial, not a lambda: one frame less between train and backward
        return self.steps.step(batch, run, global_step)

    def first_inputs(self, batch: Any) -> Any:
        return self.inner.first_inputs(batch)

    def end_fit(self, completed: bool = False) -> None:
        """Leave the run (the others go on without this member); ``completed``: it ended
        with the run's last step."""
        self.steps.end_fit(completed)

    def parts(self) -> list[Part]:
        return self.inner.parts()

    def record_comm(self) -> Communicator:
        return self.inner.record_comm()


def _preempted(checkpoints: TrainerCheckpoints) -> bool:
    """Whether this member received a preemption (a SIGTERM or a notice), said in its vote on
    the step it is in: it stops after that step (CheckpointHook). One that comes after the
    vote waits for the next step's (the watch's ``hold``), so that a member never leaves
    without having said so: the others would find it gone in their next collective."""
    hook = checkpoints.hook
    watch = hook.watch if hook is not None else None
    if watch is None:
        return False
    leaving: bool = watch.requested
    watch.hold = not leaving
    return leaving


__all__ = ["MemberMode"]
