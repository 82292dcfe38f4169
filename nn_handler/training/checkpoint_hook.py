"""CheckpointHook: periodic and best checkpoints and preemption at the loop's hook points; a
``collective`` hook, run last at each point after the other hooks' error agreement.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from nn_handler.checkpoint.manager import CheckpointManager
from nn_handler.checkpoint.registry import Part
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.distributed.faults.preemption import PreemptionWatch, preemption_budget
from nn_handler.errors import CheckpointError, ConfigError, TrainingInterrupted, TrainingPreempted
from nn_handler.training.checkpointing import TrainerCheckpoints
from nn_handler.training.history import History
from nn_handler.training.hooks import Hook


class CheckpointHook(Hook):
    """The checkpoint policy of ``CheckpointConfig`` for one fit (needs a checkpoint folder);
    ``watch``: the SIGTERM / Ctrl-C watch during a fit."""

    collective = True
    order = 1000  # after every other hook: a checkpoint holds what they did at this point

    def __init__(
        self, checkpoints: TrainerCheckpoints, history: History, device: torch.device
    ) -> None:
        self.checkpoints = checkpoints
        self.manager: CheckpointManager = checkpoints.require_manager("CheckpointHook")
        self.config: CheckpointConfig = checkpoints.config
        self.state = checkpoints.position.state
        self.history = history
        self.device = device
        self.watch: PreemptionWatch | None = None
        self._stop: TrainingPreempted | None = None  # what preempt() raised in this fit
        #: Seconds the training thread spent in step checkpoints and preemption checks so far
        #: (the throughput monitor's "checkpoint" part of a step).
        self.step_seconds = 0.0
        #: When the last of them ended (``time.perf_counter``): the throughput monitor's
        #: epoch wall time ends there when it follows the epoch's last step.
        self.step_ended = 0.0

    def parts(self) -> list[Part]:
        """The ``best`` value save_best compares with and the top-k checkpoints' values and
        names, kept in checkpoints."""

        def load(value: Any, _source: str) -> None:
            self.manager.best_value = float(value)

        def load_top(entries: Any, _source: str) -> None:
            self.manager.top.load_state_dict(entries)

        return [
            Part("best", lambda: self.manager.best_value, load, missing="ignore"),
            Part("top_k", self.manager.top.state_dict, load_top, missing="ignore"),
        ]

    def before_train(self) -> None:
        """SIGTERM and Ctrl-C handling until ``after_train`` (when handle_sigterm is on;
        Ctrl-C also needs handle_sigint)."""
        self.watch = None
        config = self.config
        if config.handle_sigterm:
            self.watch = PreemptionWatch(
                self.checkpoints.comm,
                self.device,
                config.preemption_check_interval_s,
                interrupt=config.handle_sigint,
                notice=config.preemption_notice,
                notice_interval_s=config.preemption_notice_interval_s,
            ).__enter__()

    def after_train(self) -> None:
        """The signal handlers of before the fit are back (also when training raised; after a
        preemption, further SIGTERMs wait for this process's shutdown for a while)."""
        watch, self.watch = self.watch, None
        stop, self._stop = self._stop, None
        if watch is None:
            return
        if not self.trainer.training_failed:
            watch.__exit__(None, None, None)  # finishes its last check (a collective)
        elif stop is not None:
            watch.__exit__(type(stop), stop, None)
        else:
            watch.__exit__(Exception, None, None)

    # ----------------------------------------------------------------- hook points
    def after_optimizer_step(self) -> None:
        """Step checkpoints and the preemption check (the same steps on every rank)."""
        every, step = self.config.every_n_steps, self.state.global_step
        if self.watch is None and not (self.config.save_last and every):
            return
        started = time.perf_counter()
        try:
            if self.config.save_last and every and step % every == 0:
                self.checkpoints.save_periodic()
            if self.watch is not None and self.watch.agreed(step):
                self.preempt()
        finally:
            self.step_ended = time.perf_counter()
            self.step_seconds += self.step_ended - started

    def after_epoch(self) -> None:
        """Epoch checkpoints, best.pt and the top-k, a forced preemption check, and the
        fit's end."""
        config, state = self.config, self.state
        ranking = None
        if config.save_best and state.counts(
            config.monitor
        ):  # ranked first: the epoch's checkpoint holds its own ranking
            ranking = self.manager.rank(self._monitored(), state.epoch, state.global_step)
        path: Path | None = None
        every = config.every_n_epochs
        if config.save_last and every is not None and state.epoch % every == 0:
            path = self.checkpoints.save_periodic()
        if ranking is not None and (ranking.best or ranking.top):
            # Links need the files of a complete checkpoint (a store copies after the upload).
            self.checkpoints.finish(uploads=False)
            self.manager.keep(ranking, path, write=self.checkpoints.save)
        if self.watch is not None and self.watch.agreed(state.global_step, force=True):
            self.preempt()
        if state.ends_fit():
            self.end_fit()

    def _monitored(self) -> float:
        record, monitor = self.history.last, self.config.monitor
        if monitor not in record:
            raise ConfigError(
                f"save_best monitors {monitor!r}, but the epoch record has only "
                f"{sorted(record)}; set CheckpointConfig(monitor=...)."
            )
        return float(record[monitor])

    def end_fit(self) -> None:
        """The last position is saved (save_last) unless it already is, and a checkpoint
        still written in the background is committed."""
        if self.config.save_last and self.manager.last_saved_step != self.state.global_step:
            self.checkpoints.save_periodic(final=True)
        self.checkpoints.finish()

    def preempt(self) -> None:
        """Every rank agreed that a SIGTERM or a Ctrl-C arrived: write the emergency
        checkpoint (within the budget) and leave with TrainingPreempted (TrainingInterrupted
        for a Ctrl-C)."""
        manager, config, log = self.manager, self.config, self.checkpoints.log
        step = self.state.global_step
        path: Path | None = None
        # Decided from memory, the same on every rank (a directory listing could differ
        # between machines, and only some ranks would then enter the collective save).
        if manager.last_saved_step == step:
            path = manager.last_saved_path
            try:
                self.checkpoints.finish()  # it may still be writing in the background
            except CheckpointError as error:
                log.error("the last checkpoint did not complete: {}", error)
                path = None
        else:
            try:
                path = self.checkpoints.save_periodic(
                    budget_s=preemption_budget(config.preemption_budget_s, os.environ),
                    final=True,
                )
            except CheckpointError as error:
                log.error("no emergency checkpoint: {}", error)
        interrupted = self.watch is not None and self.watch.agreed_interrupt
        landed = manager.mark_preempted("interrupted" if interrupted else "preempted")
        saved = manager.location(path) if path else None
        note = ""
        if path is not None and not landed and saved != str(path):  # elsewhere: not there
            saved, note = str(path), f": a local copy only, its upload to {manager.where} failed"
        stop = (
            TrainingInterrupted(saved, step)
            if interrupted
            else TrainingPreempted(config.preemption_exit_code, saved, step)
        )
        log.warning(
            "{} after optimizer step {}: exiting with status {} (checkpoint {}{})",
            "interrupted" if interrupted else "preempted",
            step,
            stop.code,
            saved,
            note,
        )
        self._stop = stop
        raise stop


__all__ = ["CheckpointHook"]
