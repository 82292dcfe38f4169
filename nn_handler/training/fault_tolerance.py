"""FaultTolerance: the Trainer's checkpoints, resuming, preemption and failure propagation.

The Trainer calls it at fixed points of the loop (start of fit, after each optimizer step,
after each epoch, end of fit) and delegates its public ``save_checkpoint`` / ``save_periodic``
/ ``resume`` / ``load_state_dict`` to it. What a checkpoint holds is in checkpointing.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nn_handler.checkpoint.io import load_file
from nn_handler.checkpoint.manager import (
    CheckpointManager,
    agree_on,
    restart_count,
    write_together,
)
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.distributed.failure import fail_together
from nn_handler.errors import (
    CheckpointError,
    ConfigError,
    NonFiniteError,
    RankFailedError,
    TrainingInterrupted,
    TrainingPreempted,
    UnevenDataError,
)
from nn_handler.training.checkpointing import ResumePoint, apply_checkpoint, check_data
from nn_handler.training.history import Record
from nn_handler.training.preemption import PreemptionWatch

if TYPE_CHECKING:
    from nn_handler.training.trainer import Trainer

#: Errors every rank raises together (after agreeing), so the group needs no abort.
AGREED_ERRORS = (RankFailedError, NonFiniteError, CheckpointError, UnevenDataError)


class FaultTolerance:
    """Checkpoint policy, resume, SIGTERM preemption and failure propagation of one Trainer.

    Attributes:
        config: the CheckpointConfig.
        manager: the CheckpointManager of ``config.dir`` (None without a folder).
        resume_point: what a loaded checkpoint still has to restore when the loop restarts.
    """

    def __init__(self, trainer: Trainer, config: CheckpointConfig) -> None:
        self.trainer = trainer
        self.config = config
        # A fast_dev_run neither writes nor resumes checkpoints: it is a smoke test of the loop.
        enabled = config.dir is not None and not trainer.config.fast_dev_run
        self.manager = CheckpointManager(config, trainer.comm) if enabled else None
        self.resume_point: ResumePoint | None = None
        self.watch: PreemptionWatch | None = None
        self._first_fit = True

    # ----------------------------------------------------------------- the loop's calls
    def begin_fit(self, train_loader: Iterable[Any]) -> None:
        """Resume per the policy (first fit only) and check the loader against a checkpoint."""
        trainer = self.trainer
        self._auto_resume()
        if self.resume_point is None:
            trainer.state.should_stop = False
        else:
            check_data(self.resume_point, train_loader, trainer.comm.rank)

    def take_resume_point(self) -> ResumePoint | None:
        point, self.resume_point = self.resume_point, None
        return point

    @contextlib.contextmanager
    def failing_together(self) -> Iterator[None]:
        """Turn an error on one rank into a stop on every rank (see distributed/failure.py):
        never a hang until the process-group timeout."""
        trainer = self.trainer
        try:
            yield
        except AGREED_ERRORS:
            raise
        except TrainingPreempted:  # every rank agreed to stop: nothing to propagate
            raise
        except (Exception, SystemExit, KeyboardInterrupt) as error:
            if trainer.comm.world_size == 1:
                raise
            if not isinstance(error, Exception):  # this rank is leaving: say so, then leave
                fail_together(
                    error,
                    trainer.comm.rank,
                    trainer.comm.world_size,
                    "training",
                    trainer.release_wrappers,
                )
                raise
            state = trainer.state
            failure = fail_together(
                error,
                trainer.comm.rank,
                trainer.comm.world_size,
                f"training (epoch {state.epoch + 1}, step {state.global_step})",
                trainer.release_wrappers,
            )
            if failure is error:
                raise
            raise failure from error

    def watching(self) -> contextlib.AbstractContextManager[Any]:
        """SIGTERM and Ctrl-C handling around the loop (when checkpoints and handle_sigterm
        are on; Ctrl-C also needs handle_sigint)."""
        if self.manager is None or not self.config.handle_sigterm:
            self.watch = None
            return contextlib.nullcontext()
        trainer, config = self.trainer, self.config
        self.watch = PreemptionWatch(
            trainer.comm,
            trainer.device,
            config.preemption_check_interval_s,
            interrupt=config.handle_sigint,
        )
        return self.watch

    def wants_step_calls(self) -> bool:
        """Whether ``after_optimizer_step`` has anything to do in this fit (step
        checkpoints or a preemption watch); the loop skips the call otherwise."""
        saves = self.manager is not None and self.config.save_last and self.config.every_n_steps
        return bool(saves) or self.watch is not None

    def after_optimizer_step(self) -> None:
        """Step checkpoints and the preemption check (the same steps on every rank)."""
        every, step = self.config.every_n_steps, self.trainer.state.global_step
        if self.manager is not None and self.config.save_last and every and step % every == 0:
            self.save_periodic()
        if self.watch is not None and self.watch.agreed(step):
            self.preempt()

    def after_epoch(self, record: Record) -> None:
        """Epoch checkpoints, best.pt, and a forced preemption check."""
        manager, config, state = self.manager, self.config, self.trainer.state
        if manager is None:
            return
        path: Path | None = None
        every = config.every_n_epochs
        if config.save_last and every is not None and state.epoch % every == 0:
            path = self.save_periodic()
        if config.save_best:
            if config.monitor not in record:
                raise ConfigError(
                    f"save_best monitors {config.monitor!r}, but the epoch record has only "
                    f"{sorted(record)}; set CheckpointConfig(monitor=...)."
                )
            value = float(record[config.monitor])
            if manager.improves(value):
                checkpoint = self.trainer.state_dict() if path is None else None
                manager.update_best(value, path, checkpoint)
        if self.watch is not None and self.watch.agreed(state.global_step, force=True):
            self.preempt()

    def end_fit(self) -> None:
        """The last position is saved (save_last) unless it already is."""
        manager = self.manager
        if manager is None or not self.config.save_last:
            return
        if manager.last_saved_step != self.trainer.state.global_step:
            self.save_periodic()

    def preempt(self) -> None:
        """Every rank agreed that a SIGTERM or a Ctrl-C arrived: write the emergency
        checkpoint (within the budget) and leave with TrainingPreempted (TrainingInterrupted
        for a Ctrl-C)."""
        manager = self.require_manager("preemption")
        config, trainer = self.config, self.trainer
        step = trainer.state.global_step
        path: Path | None = None
        # Decided from memory, the same on every rank (a directory listing could differ
        # between machines, and only some ranks would then enter the collective save).
        if manager.last_saved_step == step:
            path = manager.last_saved_path
        else:
            try:
                path = self.save_periodic(budget_s=config.preemption_budget_s)
            except CheckpointError as error:
                trainer.log.error("no emergency checkpoint: {}", error)
        interrupted = self.watch is not None and self.watch.agreed_interrupt
        manager.mark_preempted("interrupted" if interrupted else "preempted")
        saved = str(path) if path else None
        stop = (
            TrainingInterrupted(saved, step)
            if interrupted
            else TrainingPreempted(config.preemption_exit_code, saved, step)
        )
        trainer.log.warning(
            "{} after optimizer step {}: exiting with status {} (checkpoint {})",
            "interrupted" if interrupted else "preempted",
            step,
            stop.code,
            path,
        )
        raise stop

    # ----------------------------------------------------------------- saving and loading
    def require_manager(self, what: str) -> CheckpointManager:
        if self.manager is None:
            raise ConfigError(
                f"{what} needs a checkpoint folder: set CheckpointConfig(dir=...) "
                f"(HandlerConfig.checkpoint.dir)."
            )
        return self.manager

    def save(self, path: str | Path, budget_s: float | None = None) -> Path:
        return write_together(self.trainer.comm, self.trainer.state_dict(), path, budget_s)

    def save_periodic(self, budget_s: float | None = None) -> Path:
        manager = self.require_manager("save_periodic")
        checkpoint = self.trainer.state_dict()
        state = self.trainer.state
        return manager.save_periodic(checkpoint, state.epoch, state.global_step, budget_s)

    def load(
        self, checkpoint: Mapping[str, Any], source: str, allow_world_size_change: bool | None
    ) -> None:
        if allow_world_size_change is None:
            allow_world_size_change = self.config.allow_world_size_change
        self.resume_point = apply_checkpoint(
            self.trainer, checkpoint, source, allow_world_size_change
        )
        self._first_fit = False

    def resume(
        self, path: str | Path, allow_world_size_change: bool | None, missing_ok: bool
    ) -> Path | None:
        comm, device = self.trainer.comm, self.trainer.device
        if str(path) == "latest" or Path(path).is_dir():
            target, checkpoint = self._load_latest(path, missing_ok)
            if target is None:
                return None
        else:
            target, problem, checkpoint = Path(path), None, None
            try:
                checkpoint = load_file(target, device)
            except Exception as error:
                problem = error
            agree_on(comm, problem, f"loading checkpoint {target}")
        self.load(checkpoint, str(target), allow_world_size_change)
        return target

    def _load_latest(self, path: str | Path, missing_ok: bool) -> tuple[Path | None, Any]:
        """Rank 0 picks the newest readable checkpoint; every rank loads that one."""
        comm, device = self.trainer.comm, self.trainer.device
        if str(path) == "latest":
            manager = self.require_manager("resume('latest')")
        else:
            manager = CheckpointManager(CheckpointConfig(dir=str(path)), comm, clean=False)
        name: str | None = None
        checkpoint: Any = None
        problem: BaseException | None = None
        if comm.rank == 0:
            try:
                found = manager.load_latest(device)
                if found is not None:
                    name, checkpoint = str(found[0]), found[1]
            except Exception as error:
                problem = error
        if comm.world_size > 1:
            name = comm.broadcast_object(name)
            if name is not None and comm.rank != 0:
                try:
                    checkpoint = load_file(name, device)
                except Exception as error:
                    problem = error
        agree_on(comm, problem, f"loading the latest checkpoint in {manager.dir}")
        if name is None:
            if missing_ok:
                return None, None
            raise CheckpointError(f"no complete checkpoint in {manager.dir} to resume from.")
        return Path(name), checkpoint

    def _auto_resume(self) -> None:
        first, self._first_fit = self._first_fit, False
        policy, trainer = self.config.resume, self.trainer
        if not first or self.resume_point is not None or self.manager is None:
            return
        if policy == "auto" or (policy == "on_restart" and restart_count(os.environ) > 0):
            found = self.resume("latest", allow_world_size_change=None, missing_ok=True)
            if found is None:
                trainer.log.info("resume={!r}: no checkpoint yet, starting afresh", policy)
            else:
                trainer.log.info("resume={!r}: resumed from {}", policy, found)
            return
        existing = self.manager.periodic()
        if existing and trainer.is_main_process:
            trainer.log.warning(
                "{} already holds {} checkpoint(s) and this run starts afresh (resume={!r}, "
                "not a restart): its checkpoints will be rotated together with them. Use a new "
                "folder, or resume='auto' to continue the run that wrote them.",
                self.manager.dir,
                len(existing),
                policy,
            )


__all__ = ["AGREED_ERRORS", "FaultTolerance"]
