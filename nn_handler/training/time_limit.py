"""TimeLimit: ``trainer.max_time`` (Lightning's), a wall-clock limit on a fit: when it has
passed, training stops at the next check, on every rank at the same step, as ``max_steps``
would have stopped it there (a mid-epoch stop keeps the position: save_last writes it, and a
later fit or a resume continues exactly). The ranks agree with one tiny all_reduce every
``log_every_n_steps`` optimizer steps and at each epoch's end (no host sync in the other
steps); the clock is this process's, from the start of the fit (a run resumed in a new
allocation gets the whole budget again, where Lightning's Timer counts across resumes)."""

from __future__ import annotations

import datetime
import time

from nn_handler.training.hooks import Hook


class TimeLimit(Hook):
    """Stops the fit once ``max_time_s`` seconds have passed since it started; checks every
    ``every`` optimizer steps and at each epoch's end. Every rank must hold one alike."""

    order = 10  # after the other hooks at a step, before the CheckpointHook (its save)

    def __init__(self, max_time_s: float, every: int) -> None:
        self.max_time_s = max_time_s
        self.every = every
        self._deadline = 0.0
        #: The global step at which the limit stopped the last fit (None: it did not).
        self.stopped_at: int | None = None

    def before_train(self) -> None:
        self._deadline = time.monotonic() + self.max_time_s
        self.stopped_at = None

    def after_optimizer_step(self) -> None:
        if self.trainer.state.global_step % self.every == 0:
            self._check()

    def after_train_epoch(self) -> None:
        self._check()

    def _check(self) -> None:
        trainer = self.trainer
        state, comm = trainer.state, trainer.comm
        late = float(time.monotonic() >= self._deadline)
        if comm.world_size > 1:  # one rank past the limit stops them all
            late = float(comm.all_reduce(late, op="max"))
        if not late or self.stopped_at is not None:
            return
        self.stopped_at = state.global_step
        state.max_steps = state.global_step  # the loop ends the fit here, every rank alike
        if trainer.is_main_process:
            limit = datetime.timedelta(seconds=round(self.max_time_s))
            trainer.log.info(
                "max_time {} reached at step {}: training stops here{}",
                limit,
                state.global_step,
                " (its checkpoint keeps the position)" if trainer.checkpointing.hook else "",
            )


__all__ = ["TimeLimit"]
