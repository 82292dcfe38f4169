"""Trainer: the training loop, extended by subclassing and hooks. Its parts, each with its own
state: ``optimization`` (optimization.py), ``evaluator`` (evaluation.py), ``checkpointing``
(checkpointing.py, with its CheckpointHook), ``strategy`` (how the model is parallelised,
nn_handler/strategies/) and ``hooks``. docs/training.md shows the loop line for line:
``fit`` -> ``train_epoch`` -> ``run_step`` -> ``optimization.backward``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from loguru import logger
from torch import nn

from nn_handler.checkpoint.format import sharded_checkpoints
from nn_handler.checkpoint.registry import part_of
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.config.training import EmaConfig, PrecisionConfig, TrainerConfig
from nn_handler.distributed.communicator import Communicator, NullCommunicator
from nn_handler.distributed.faults.failure import failing_together
from nn_handler.errors import ConfigError
from nn_handler.strategies import Strategy, select_strategy
from nn_handler.training.batch import batch_size_of, move_to_device, set_epoch
from nn_handler.training.checkpoint_hook import CheckpointHook
from nn_handler.training.checkpointing import TrainerCheckpoints
from nn_handler.training.early_stopping import (
    EarlyStopping,
    agree_at_the_epoch_end,
    reconsidered_stop,
)
from nn_handler.training.epoch import (
    epoch_batches,
    epoch_record,
    epochs_of_fit,
    summary,
    validate_mid_epoch,
)
from nn_handler.training.epoch_plan import EpochPlan, plan_epoch
from nn_handler.training.evaluation import Evaluator, Metric
from nn_handler.training.facade import TrainerFacade, refuse_taken_names
from nn_handler.training.history import PARTIAL, History, Record
from nn_handler.training.hooks import Hook, HookList
from nn_handler.training.memory_planning import MemoryPlanner
from nn_handler.training.metrics import MetricKeys, RunningLoss
from nn_handler.training.modes.choice import checkpoint_of_this_process, select_mode
from nn_handler.training.optimization import Optimization, OptimizerFactory
from nn_handler.training.position import LoopPosition
from nn_handler.training.precision import Precision
from nn_handler.training.profiling import ProfilerHook
from nn_handler.training.progress import ProgressBar
from nn_handler.training.run_settings import run_config_of, run_fingerprint
from nn_handler.training.schedules import epoch_length, per_step_for_a_run_length_factory
from nn_handler.training.state import TrainerState
from nn_handler.training.step_output import loss_of, manual_loss, record_extras
from nn_handler.training.time_limit import TimeLimit
from nn_handler.training.validation_sets import Evaluate, ValidationSets, named
from nn_handler.training.watched_keys import check_trainer_monitors, monitored

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Trainer(TrainerFacade):
    """Trains one model on this rank's data; every rank must call ``fit``/``evaluate`` alike.
    ``optimizer``/``scheduler``: instances or factories (``lambda params: Adam(params)``,
    ``lambda opt: StepLR(opt, 10)``, ``lambda opt, steps: ...``). docs/training.md lists what a
    subclass may use."""

    #: False: ``training_step`` steps the optimizers itself (``self.optimizers()``,
    #: ``self.manual_backward``), as for GANs; needed for several optimizers.
    automatic_optimization: bool = True

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        scheduler: Any = None,
        *,
        config: TrainerConfig | None = None,
        precision: PrecisionConfig | None = None,
        ema: EmaConfig | None = None,
        communicator: Communicator | None = None,
        device: torch.device | str | None = None,
        metrics: Mapping[str, Metric] | None = None,
        hooks: Iterable[Hook] = (),
        checkpoint: CheckpointConfig | None = None,
    ) -> None:
        refuse_taken_names(self)
        config = per_step_for_a_run_length_factory(config or TrainerConfig(), scheduler)
        self.config = config
        self.comm = comm = communicator or NullCommunicator()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.loss_fn = loss_fn
        self.log = logger.bind(rank=comm.rank)
        self.precision = Precision(precision or PrecisionConfig(), self.device)
        self.strategy: Strategy = select_strategy(comm, self.device, config, self.precision.name)
        self.module, self.model = self.strategy.setup(model)
        self.history = History()
        self.state = TrainerState()
        self.position = LoopPosition(self.state, replicated=config.reproducible is not None)
        self.early_stopping = (
            EarlyStopping(config.early_stopping) if config.early_stopping else None
        )
        checkpoint = checkpoint or CheckpointConfig()
        run_config = run_config_of(config, precision, ema, checkpoint)
        self.checkpointing = TrainerCheckpoints(
            self.position, comm, self.device, checkpoint_of_this_process(config, checkpoint),
            run_config, enabled=not config.fast_dev_run, group=self.strategy.checkpoint_group,
            sharded=sharded_checkpoints(checkpoint, self.strategy.collective_state),
            fingerprint=lambda: run_fingerprint(
                self.hyperparameters(), self.optimization.initial_lr
            ),
        )  # fmt: skip
        own: list[Hook] = [ProfilerHook(config.profile)] if config.profile is not None else []
        if config.max_time is not None:  # stops at a step, as max_steps (time_limit.py)
            own.append(TimeLimit(config.max_time, config.log_every_n_steps))
        if self.checkpointing.manager is not None:
            self.checkpointing.hook = CheckpointHook(self.checkpointing, self.history, self.device)
            own.append(self.checkpointing.hook)
        self.hooks = HookList([*hooks, *own], self)
        self.optimization = Optimization(config, self.precision, self.strategy, self.state, ema)
        # A position written mid-epoch counts the skipped steps the device has not told yet.
        self.position.before_save = lambda: self.optimization.settle(check=False)
        self.evaluator = Evaluator(
            config, self.strategy, self.optimization, self.hooks, metrics, self._use_model
        )
        #: Whether the last ``fit`` raised (read by after_train hooks: trackers mark the run).
        self.training_failed = False
        #: Lines hooks add to this epoch's log line (a monitor's verdict), cleared per epoch.
        self.epoch_notes: list[str] = []
        self._active: nn.Module = self.model
        self._non_blocking = config.non_blocking and self.device.type == "cuda"
        self._train_keys = MetricKeys("training value")  # the keys agreed last, every rank
        self._step_region = f"training step ({type(self.strategy).__name__}: forward, backward)"
        built = self.configure_optimizers(optimizer, scheduler)
        self.optimization.adopt(built, self.module, self.automatic_optimization)
        #: The memory plan (printed, checked against the budget here and at the first step).
        self.memory = MemoryPlanner(self.strategy, config, self.device)
        self.memory.at_start(self.optimization.optimizers)
        #: How a step runs among the ranks (modes/): normal, reproducible, a member's.
        self.mode = select_mode(
            config, self.module, comm, self.device, self.precision,
            self.automatic_optimization, self.metrics, self.strategy.exact_gradients,
        )  # fmt: skip
        parts = [*self.strategy.checkpoint_parts(), *self.optimization.parts()]
        parts += self.mode.parts()
        if self.early_stopping is not None:
            parts.append(part_of("early_stopping", self.early_stopping))
        parts += [part_of("history", self.history, missing="error"), *self.position.parts()]
        self.checkpointing.adopt(parts, self.hooks.hooks)

    def release_wrappers(self) -> None:
        """Drop the strategy's wrappers (DDP, compile) before the process group goes."""
        self.strategy.release()
        object.__setattr__(self, "model", self.module)
        self._active = self.module

    def _use_model(self, module: nn.Module | None) -> None:
        self._active = module if module is not None else self.model

    # ----------------------------------------------------------------- override points
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the active model (wrapped in training, plain or EMA in evaluation)."""
        return self._active(*args, **kwargs)

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, targets) of a batch; the default takes a pair. Override for other layouts."""
        if isinstance(batch, (list, tuple)) and len(batch) == 2:
            return batch[0], batch[1]
        raise ConfigError(
            f"the default steps expect (inputs, targets) batches, got {type(batch).__name__}"
            f"{f' of length {len(batch)}' if isinstance(batch, (list, tuple)) else ''}; "
            f"override Trainer.split_batch or training_step/validation_step."
        )

    def compute_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        """The loss of one batch; the default calls ``loss_fn(outputs, targets)``."""
        if self.loss_fn is None:
            raise ConfigError("no loss_fn: pass loss_fn= or override Trainer.compute_loss.")
        return self.loss_fn(outputs, targets)

    def training_step(self, batch: Any) -> torch.Tensor | Mapping[str, torch.Tensor]:
        """The loss of one training batch (a tensor, or a dict with a 'loss' entry)."""
        inputs, targets = self.split_batch(batch)
        return self.compute_loss(self.forward(inputs), targets)

    def validation_step(self, batch: Any) -> Mapping[str, torch.Tensor | float]:
        """Per-batch means to average over the validation set (weighted by batch size): the
        loss (without a loss_fn, none) and ``update_metrics(outputs, targets)``. An override
        that wants ``metrics=`` must call ``update_metrics`` too (or the evaluation says so)."""
        inputs, targets = self.split_batch(batch)
        outputs = self.forward(inputs)
        values: dict[str, torch.Tensor | float] = {}
        if self.loss_fn is not None or type(self).compute_loss is not Trainer.compute_loss:
            values["loss"] = self.compute_loss(outputs, targets)  # no loss_fn: metrics alone
        return {**values, **self.update_metrics(outputs, targets)}

    def predict_step(self, batch: Any) -> torch.Tensor:
        """Per-sample outputs of one batch (dim 0 = samples) of its inputs (first element)."""
        inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        output: torch.Tensor = self.forward(inputs)
        return output

    def configure_optimizers(self, optimizer: Any, scheduler: Any) -> tuple[Any, Any]:
        """Build the optimizer and scheduler (override to construct them yourself; ``track``
        works here). Called once, after the model is wrapped; factories receive
        ``self.model.parameters()`` and the optimizer. Returns (optimizer, scheduler), or (a
        list of optimizers, a list of schedulers or None) for manual optimization."""
        return self.optimization.build(optimizer, scheduler, self.model)

    def manual_backward(self, loss: torch.Tensor) -> None:
        """Backward for manual optimization: call it in ``training_step``, not loss.backward()."""
        loss.backward()  # type: ignore[no-untyped-call]

    # ----------------------------------------------------------------- the loop
    def fit(
        self,
        train_loader: Iterable[Any],
        val_loader: Iterable[Any] | None = None,
        epochs: int | None = None,
    ) -> History:
        """Train until ``epochs`` epochs are complete in total (default: config.epochs), so a
        resumed trainer continues where it stopped. Every rank must call this. Returns the
        History (losses and metrics the same on every rank, timings each rank's own)."""
        epochs = epochs_of_fit(self.config, self.state, epochs, self.log)
        sets = ValidationSets.of(val_loader)  # one loader, or several by name
        checkpoint = self.checkpointing.config if self.checkpointing.manager else None
        watched = monitored(self.early_stopping, checkpoint, self.scheduler, self.config)
        check_trainer_monitors(type(self), Trainer, self.metrics, bool(sets), watched, sets.names)
        hooks, state, failed, val = self.hooks, self.state, True, sets or None
        self.memory.validates = bool(sets)  # the plan's validation item
        self.mode.check(train_loader, sets.loaders)
        self.evaluator.sanity_check(sets.loaders, self.validation_step)
        try:
            with failing_together(self.comm, state.where, self.release_wrappers):
                self.optimization.begin_fit(train_loader, epochs)
                self.checkpointing.begin_fit(train_loader)
                self.mode.begin_fit(state.global_step, self.checkpointing)  # after a resume
                self._reconsider_early_stop(state)
                self.optimization.check_horizon(train_loader, epochs, self.position)
                state.epochs, state.max_steps = epochs, self.config.max_steps
                hooks.call_agreed("before_train", self.comm)
                hooks.call("before_train", collective=True)
                while not state.ends_fit():
                    plan = self._begin_epoch(train_loader, val)
                    record: Record = {"epoch": float(state.epoch + 1)}
                    record.update(self.train_epoch(train_loader, epochs, val, plan=plan))
                    if self.position.mid_epoch:  # max_steps ended this fit inside the epoch
                        self._end_partial_epoch(record, epochs)
                        break
                    self._end_epoch(record, val, epochs)
            failed = False
        finally:
            self.training_failed = failed
            self.mode.end_fit(completed=not failed)
            hooks.call_after_train(failed, self.log)
        return self.history

    def _reconsider_early_stop(self, state: TrainerState) -> None:
        """A resumed stop that early stopping decided stands, unless its settings changed."""
        stopped_early = self.position.stopped_early
        if changed := reconsidered_stop(self.early_stopping, state.should_stop, stopped_early):
            state.should_stop = self.position.stopped_early = changed[0]
            self.log.info(changed[1])

    def _begin_epoch(self, train_loader: Iterable[Any], val_loader: Any) -> EpochPlan:
        self.position.start_epoch(train_loader)
        self.epoch_notes.clear()
        set_epoch(train_loader, self.state.epoch)
        # Every rank's number of batches travels with the hooks' agreement, into the plan.
        length = epoch_length(self.config, train_loader)
        share = [-1 if length is None else length]
        shared = self.hooks.call_agreed("before_epoch", self.comm, share=lambda: share)
        self.hooks.call("before_epoch", collective=True)
        lengths = [row[0] for row in shared]
        return plan_epoch(
            self.config, self.comm, train_loader, val_loader, self.state.epoch, lengths
        )

    def train_epoch(
        self,
        loader: Iterable[Any],
        epochs: int,
        val_loader: Any = None,
        plan: EpochPlan | None = None,
    ) -> Record:
        """One pass over ``loader`` (``val_loader``, one or several, validated every
        val_check_interval), as ``plan`` says (None: planned here, the ranks' lengths compared
        in one all_gather)."""
        config, state, hooks, position = self.config, self.state, self.hooks, self.position
        self.optimization.require_optimizer()
        self.model.train()
        if plan is None:
            plan = plan_epoch(config, self.comm, loader, val_loader, state.epoch)
        total = plan.batches
        running = position.running = RunningLoss(config.log_every_n_steps)
        self.optimization.reset_window()
        title = f"epoch {state.epoch + 1}/{epochs}"
        bar = ProgressBar(config.progress_bar and self.is_main_process, total, title)
        state.skipped_steps = 0
        started = time.perf_counter()
        partial = False
        try:
            point = position.take_resume()
            batches, first = epoch_batches(
                loader, point, running, plan, state, self.comm, self.device
            )
            position.batches_done = first  # resumed: done, for a save inside the next step
            bar.update(first)
            watched = self.comm.watching and self.strategy.reduces_gradients
            for index, batch in enumerate(batches, start=first):
                start, end = plan.window(index)
                state.batch_index, state.batch = index, batch
                synced = state.step_synced = index + 1 == end
                hooks.call("before_step")
                # The stall watchdog counts the step's DDP/FSDP collectives as one.
                with self.comm.watched(self._step_region) if watched else _NO_REGION:
                    loss = self.run_step(batch, synced, end - start)
                state.last_loss = loss
                running.add(loss, batch_size_of(batch))
                if synced:
                    position.batches_done = index + 1
                    running.end_window(end - start, self.optimization.skipped)
                hooks.call("after_step")
                if log_step := (index + 1) % config.log_every_n_steps == 0:
                    self.optimization.settle()  # the device's verdicts on skipped steps
                bar.after_batch(index, first, log_step, running, started)
                if not synced:
                    continue
                if plan.validates_after(index):
                    validate_mid_epoch(self.evaluate, val_loader, state, self.log, total)
                hooks.call("after_optimizer_step")  # the CheckpointHook last
                if state.max_steps is not None and state.global_step >= state.max_steps:
                    # This fit ends (every rank alike: the same steps everywhere); the run
                    # does not: a later fit with a larger max_steps finishes the epoch.
                    partial = total is None or index + 1 < total
                    break
        finally:
            bar.close()
            position.running = running if partial else None  # kept: the epoch goes on later
            state.batch = None
        self.optimization.settle()
        keys, skipped = self._train_keys, state.skipped_steps
        manual = not self.automatic_optimization
        comm = self.mode.record_comm()
        return epoch_record(running, comm, self.device, keys, started, skipped, manual)

    def run_step(self, batch: Any, sync: bool = True, window: int = 1) -> torch.Tensor:
        """One micro-batch: forward and backward, then the optimizer step when ``sync`` (the
        window's last). ``window`` micro-batches make one step: the loss is divided by it so
        the gradient is the window's mean. Returns the detached loss."""
        optimization = self.optimization
        if self.mode.whole_steps:  # the reproducible modes: one whole step, reduced exactly
            first, device = self.mode.first_inputs, self.device  # the memory plan's (once)
            self.memory.before_first_step(
                lambda: self.split_batch(move_to_device(first(batch), device))[0]
            )
            optimization.open_window()
            loss = self.mode.step(batch, self.training_step, self.state.global_step)
            self.optimizer_step()
            return loss
        batch = move_to_device(batch, self.device, self._non_blocking)
        self.memory.before_first_step(lambda: self.split_batch(batch)[0])
        if not self.automatic_optimization:  # training_step steps the optimizers itself
            with self.precision.autocast():
                output = self.training_step(batch)
            self.state.last_scalars = record_extras(self.position.running, output, batch)
            optimization.after_manual_step()
            return manual_loss(output, self.device)
        optimization.open_window()  # the window's first micro-batch zeroes the gradients
        # Gradients are synchronised across ranks only on the last micro-batch of a window.
        with contextlib.nullcontext() if sync else self.strategy.no_sync():
            with self.precision.autocast():
                output = self.training_step(batch)
                loss = loss_of(output)
            self.state.last_scalars = record_extras(self.position.running, output, batch)
            loss = optimization.backward(loss, window)
        if sync:
            self.optimizer_step()
        return loss

    def optimizer_step(self) -> bool:
        """Unscale, clip, NaN/inf check, step (or skip), EMA, scheduler; False when skipped on
        the host (one the device skips returns True and is counted at the next log step)."""
        return self.optimization.step()

    def _end_epoch(self, record: Record, val_loader: Any, epochs: int) -> None:
        state, hooks = self.state, self.hooks
        hooks.call("after_train_epoch")  # every rank is here: collectives allowed
        record["lr"] = float(self.optimization.require_optimizer().param_groups[0]["lr"])
        evaluate: Evaluate = lambda loader, name: self.evaluator.evaluate(  # noqa: E731
            loader, None, self.validation_step, name
        )  # its hooks agree with after_epoch's; an overridden evaluate, with its own agreement
        if type(self).evaluate is not Trainer.evaluate:
            evaluate = lambda loader, name: (named(self.evaluate(loader), name), None)  # noqa: E731
        sets = ValidationSets.of(val_loader).due(state.epoch, self.config.check_val_every_n_epoch)
        values, validation_error = sets.validate(evaluate)
        state.validated = bool(sets)  # monitors of val_ keys skip an epoch without
        record.update(values)
        self.optimization.step_per_epoch(record)
        self.history.append(record)
        state.epoch += 1
        self.position.end_epoch()
        self.position.stopped_early = agree_at_the_epoch_end(  # (rank 0's is saved)
            hooks, self.comm, self.early_stopping, self.history.last, state, validation_error
        )
        hooks.call("after_epoch", collective=True)
        notes = "".join(f"; {note}" for note in self.epoch_notes)
        self.log.info("epoch {}/{}: {}{}", state.epoch, epochs, summary(self.history.last), notes)
        if state.should_stop and self.early_stopping is not None:
            self.log.info(self.early_stopping.describe())

    def _end_partial_epoch(self, record: Record, epochs: int) -> None:
        """max_steps ended this fit inside an epoch (Lightning's rule: the fit, not the run):
        the History records it (``partial_batches``), with no validation, epoch hooks or early
        stopping; the position is saved and kept, so a later fit with a larger max_steps, from
        here or from its checkpoint, continues exactly (docs/training.md)."""
        position = self.position
        record["lr"] = float(self.optimization.require_optimizer().param_groups[0]["lr"])
        record[PARTIAL] = float(position.batches_done)
        self.history.append(record)
        if self.checkpointing.hook is not None:
            self.checkpointing.hook.end_fit()
        position.hold()
        self.log.info(
            "epoch {}/{} stopped at step {} after {} batches: {}", self.state.epoch + 1,
            epochs, self.state.global_step, position.batches_done, summary(record),
        )  # fmt: skip

    def evaluate(self, loader: Iterable[Any], use_ema: bool | None = None) -> dict[str, float]:
        """Exact metrics over ``loader`` (loss and configured metrics); every rank must call
        this and gets the same values. Uses the EMA weights when ``use_ema`` (default: the
        EmaConfig's validate_with_ema). A failure on any rank raises on every rank."""
        results, error = self.evaluator.evaluate(loader, use_ema, self.validation_step)
        self.comm.raise_if_any_failed(error, "after_validation hooks")
        return results

    def predict(self, loader: Iterable[Any], use_ema: bool | None = None) -> torch.Tensor:
        """Every sample's output in dataset order (LoaderFactory.eval_loader); every rank."""
        return self.evaluator.predict(loader, use_ema, self.predict_step)


_NO_REGION = contextlib.nullcontext()


__all__ = ["Metric", "OptimizerFactory", "SchedulerFactory", "Trainer", "TrainerState"]
