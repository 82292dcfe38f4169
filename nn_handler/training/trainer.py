"""Trainer: the training loop, extended by subclassing and hooks.

The loop, in pseudocode (every rank runs it on its own shard), with the file of each part::

    for epoch in range(done, epochs):            # trainer.py: fit, _run_epoch
        loader.set_epoch(epoch)
        for each batch:                          # epoch.py: train_epoch
            run_step(batch)                      # step.py: forward (autocast), backward; on
                                                 # the last micro-batch of a window: sync,
                                                 # clip, step, EMA, per-step scheduler
            [evaluate every val_check_interval]  # epoch.py, evaluation.py
            after_optimizer_step hooks           # hooks.py; checkpoint_hook.py: step
                                                 # checkpoints and the preemption check
        train_loss <- one all_reduce             # no host sync inside the epoch
        after_train_epoch hooks                  # e.g. the throughput monitor's all_reduce
        metrics <- evaluate(val_loader)          # evaluation.py: exact, every sample once
        scheduler.step()                         # optimization.py
        history.append(record); early stopping; after_epoch hooks; CheckpointHook.after_epoch

The model's parallelism is the Strategy's (nn_handler/strategies/); what a checkpoint holds
is a registry of named parts (checkpoint_api.py, position.py, checkpointing.py).

Override ``training_step``, ``validation_step``, ``predict_step``, ``compute_loss`` or
``configure_optimizers``; call ``forward`` inside them so the right model runs (the DDP
model while training, the plain or EMA model while evaluating).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from loguru import logger
from torch import nn

from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.config.training import EmaConfig, PrecisionConfig, TrainerConfig
from nn_handler.distributed.communicator import Communicator, NullCommunicator
from nn_handler.errors import ConfigError
from nn_handler.strategies import Strategy, select_strategy
from nn_handler.training.batch import loader_length, set_epoch
from nn_handler.training.checkpoint_api import CheckpointMixin
from nn_handler.training.checkpointing import plain_config
from nn_handler.training.early_stopping import EarlyStopping
from nn_handler.training.ema import ModelEma
from nn_handler.training.epoch import EpochMixin, summary
from nn_handler.training.evaluation import EvaluationMixin, Metric
from nn_handler.training.fault_tolerance import failing_together
from nn_handler.training.history import History, Record
from nn_handler.training.hooks import Hook, HookList
from nn_handler.training.limits import limited
from nn_handler.training.metrics import StatefulMetric
from nn_handler.training.monitors import RECORD_METHODS, check_monitors, expected_keys, monitored
from nn_handler.training.nonfinite import BufferSnapshot, GradientFiniteCheck
from nn_handler.training.optimization import OptimizationMixin, OptimizerFactory
from nn_handler.training.position import LoopPosition
from nn_handler.training.precision import Precision
from nn_handler.training.profiling import ProfilerHook
from nn_handler.training.sharded_ema import ShardedEma
from nn_handler.training.state import Stateful, TrainerState
from nn_handler.training.step import StepMixin
from nn_handler.training.weighted_means import MetricKeys

SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class Trainer(CheckpointMixin, EpochMixin, EvaluationMixin, StepMixin, OptimizationMixin):
    """Trains one model on this rank's data; every rank must call ``fit``/``evaluate`` alike.

    How the model is parallelised is the Strategy's (``TrainerConfig.strategy``, see
    nn_handler/strategies/): with 'auto', a run of more than one rank wraps the model in
    DistributedDataParallel (with synchronised BatchNorm when configured), one rank trains it
    as it is; either is compiled if configured. ``optimizer`` and ``scheduler`` are instances
    or factories (``lambda params: torch.optim.Adam(params)``, ``lambda opt: StepLR(opt, 10)``)
    called after wrapping.
    """

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
        self.config = config or TrainerConfig()
        self.comm = communicator or NullCommunicator()
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.loss_fn = loss_fn
        self.precision = Precision(precision or PrecisionConfig(), self.device)
        self.log = logger.bind(rank=self.comm.rank)
        self.strategy: Strategy = select_strategy(
            self.comm, self.device, self.config, self.precision.name
        )
        self.module, self.model = self.strategy.setup(model)
        self.metrics: dict[str, Metric] = dict(metrics or {})
        self._stateful = {k: m for k, m in self.metrics.items() if isinstance(m, StatefulMetric)}
        for metric in self._stateful.values():
            if isinstance(metric, nn.Module):
                metric.to(self.device)
        self.history = History()
        self.state = TrainerState()
        self.position = LoopPosition(self.state)
        self.early_stopping = (
            EarlyStopping(self.config.early_stopping) if self.config.early_stopping else None
        )
        if self.config.profile is not None:
            hooks = [*hooks, ProfilerHook(self.config.profile)]
        self.hooks = HookList(hooks, self)
        self._scheduler_factory: Callable[[Any, int], Any] | None = None
        self._pending_scheduler_state: Any = None
        self._tracked: dict[str, Stateful] = {}
        # Last among the parts a subclass may read (state, history, hooks, metrics, strategy).
        self._adopt_optimizers(self.configure_optimizers(optimizer, scheduler))
        self._check_scheduler()
        self.ema: ModelEma | ShardedEma | None = None
        if ema is not None and ema.enabled:
            strategy = self.strategy
            self.ema = (  # a sharded model's EMA stays sharded: one averaged shard per rank
                ShardedEma(self.module, ema, strategy)
                if strategy.collective_state
                else ModelEma(self.module, ema)
            )
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self._guard = self.config.nonfinite != "off" and self.precision.scaler is None
        self._finite = GradientFiniteCheck(self._params)
        snapshot = BufferSnapshot(self.module)
        self._buffers = snapshot if self._guard and snapshot.has_buffers else None
        self._window_losses: list[torch.Tensor] = []
        self._window_open = False  # the next micro-batch starts an optimizer step
        # The key sets of the last reductions, the same on every rank (one all_reduce each).
        self._eval_keys = MetricKeys()
        self._train_keys = MetricKeys()
        # (the loader, every rank's number of batches) as fit agreed them for this epoch.
        self._agreed_lengths: tuple[int, list[int]] | None = None
        self._non_blocking = self.config.non_blocking and self.device.type == "cuda"
        self._active: nn.Module = self.model
        self._metric_updates = 0
        #: Whether the last ``fit`` raised (read by after_train hooks: trackers mark the run).
        self.training_failed = False
        #: Lines hooks add to this epoch's log line (a monitor's verdict), cleared per epoch.
        self.epoch_notes: list[str] = []
        #: The run's configuration as plain values, stored in checkpoints (NNHandler puts its
        #: whole HandlerConfig here).
        run_config: dict[str, Any] = {
            "trainer": plain_config(self.config),
            "precision": plain_config(precision or PrecisionConfig()),
            "ema": plain_config(ema or EmaConfig()),
            "checkpoint": plain_config(checkpoint or CheckpointConfig()),
        }
        self._build_checkpointing(checkpoint or CheckpointConfig(), run_config, self.hooks.hooks)

    # ----------------------------------------------------------------- construction
    @property
    def is_main_process(self) -> bool:
        return self.comm.rank == 0

    def release_wrappers(self) -> None:
        """Drop the strategy's wrappers (DDP, compile), keeping the plain module for evaluation.

        Call before the process group is destroyed (NNHandler.close does): a DDP reducer
        freed after ``destroy_process_group`` can hang or abort the process at exit.
        """
        self.strategy.release()
        self.model = self.module
        self._active = self.module

    def hyperparameters(self) -> dict[str, Any]:
        """The run's settings as flat ``section.field`` keys with plain values (what the
        experiment trackers log once): the run configuration (NNHandler's whole config), the
        resolved precision, the world size, the optimizer's class and first learning rate."""
        config = self.run_config
        params = flatten(config["handler"] if set(config) == {"handler"} else config)
        params["precision"] = self.precision.name
        params["world_size"] = self.comm.world_size
        params["strategy"] = self.strategy.name
        params["ema"] = self.ema is not None
        if self.optimizer is not None:
            params["optimizer"] = type(self.optimizer).__name__
            params["lr"] = self.optimizer.param_groups[0]["lr"]
        return params

    # ----------------------------------------------------------------- override points
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the active model: the DDP-wrapped one in training, the plain (or EMA) one in
        evaluation. Arguments are passed through (``self.forward(z, part="generator")``)."""
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
        epochs = epochs if epochs is not None else self.config.epochs
        if epochs < 1:
            raise ConfigError(f"epochs must be at least 1, got {epochs}.")
        if self.config.fast_dev_run:
            epochs = self.state.epoch + 1
        self._check_monitors(validates=val_loader is not None)
        checkpoint_hook = self.checkpoint_hook
        failed = True
        try:
            with failing_together(self.comm, self.state, self.release_wrappers):
                self._build_deferred_scheduler(train_loader, epochs)
                self.checkpointing.begin_fit(train_loader)
                self._warn_if_the_schedule_ends_early(epochs, train_loader)
                self._together("before_train hooks", lambda: self.hooks.call("before_train"))
                with checkpoint_hook.watching() if checkpoint_hook else contextlib.nullcontext():
                    while self.state.epoch < epochs and not self._stop_before_epoch():
                        self._run_epoch(train_loader, val_loader, epochs)
                    if checkpoint_hook is not None:
                        checkpoint_hook.end_fit()
            failed = False
        finally:
            self._after_train(failed)
        return self.history

    def _check_monitors(self, validates: bool) -> None:
        """Monitored keys (early stopping, save_best, ReduceLROnPlateau) the run will never
        record are a ConfigError before the first step."""
        base = Trainer
        overridden = {m for m in RECORD_METHODS if getattr(type(self), m) is not getattr(base, m)}
        checkpoint = self.checkpoint_config if self.checkpoints is not None else None
        check_monitors(
            expected_keys(overridden, self.metrics, validates),
            monitored(self.early_stopping, checkpoint, self.scheduler, self.config),
            validates,
            own_training_keys=type(self).training_step is not base.training_step,
        )

    def _stop_before_epoch(self) -> bool:
        max_steps = self.config.max_steps
        return self.state.should_stop or (
            max_steps is not None and self.state.global_step >= max_steps
        )

    def _after_train(self, failed: bool) -> None:
        self.training_failed = failed
        try:
            self.hooks.call("after_train")
        except Exception:
            if not failed:
                raise
            self.log.exception("an after_train hook raised while training was failing")

    def _run_epoch(
        self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int
    ) -> None:
        self.position.start_epoch(train_loader)
        self.epoch_notes.clear()
        set_epoch(train_loader, self.state.epoch)
        # The loaders' lengths travel with the hooks' agreement (train_epoch checks them).
        length = limited(loader_length(train_loader), self._train_limit())
        shared = self._together(
            "before_epoch hooks",
            lambda: self.hooks.call("before_epoch"),
            share=lambda: [-1 if length is None else length],
        )
        self._agreed_lengths = (id(train_loader), [row[0] for row in shared])
        record: Record = {"epoch": float(self.state.epoch + 1)}
        if self.config.val_check_interval is not None and val_loader is not None:
            record.update(self.train_epoch(train_loader, epochs, val_loader=val_loader))
        else:  # a subclass's train_epoch(loader, epochs) keeps working
            record.update(self.train_epoch(train_loader, epochs))
        self.hooks.call("after_train_epoch")  # every rank is here: collectives allowed
        record["lr"] = float(self._require_optimizer().param_groups[0]["lr"])
        validation_error: Exception | None = None
        if val_loader is not None:
            if type(self).evaluate is Trainer.evaluate:  # its hooks agree with after_epoch's
                metrics, validation_error = self._evaluate(val_loader, None)
            else:  # an overridden evaluate runs as it is, with its own agreement
                metrics = self.evaluate(val_loader)
            record.update({f"val_{k}": v for k, v in metrics.items()})
        self._step_scheduler_per_epoch(record)
        self.history.append(record)
        self.state.epoch += 1
        self.position.end_epoch()

        def end_epoch() -> None:
            if validation_error is not None:  # this rank's after_validation hooks raised
                raise validation_error
            self._end_epoch()

        # One agreement for the after_validation and after_epoch hooks and early stopping,
        # carrying rank 0's stop decision (no collective of their own).
        shared = self._together(
            "after_validation hooks, early stopping and after_epoch hooks",
            end_epoch,
            share=lambda: [int(self.state.should_stop)],
        )
        self.state.should_stop = bool(shared[0][0])
        if self.checkpoint_hook is not None:
            self.checkpoint_hook.after_epoch()
        notes = "".join(f"; {note}" for note in self.epoch_notes)
        self.log.info(
            "epoch {}/{}: {}{}", self.state.epoch, epochs, summary(self.history.last), notes
        )
        if self.state.should_stop and self.early_stopping is not None:
            self.log.info(
                "early stopping: {} has not improved for {} epochs (best {:.6g} at epoch {})",
                self.early_stopping.config.monitor,
                self.early_stopping.wait,
                self.early_stopping.best,
                self.early_stopping.best_epoch,
            )

    def _end_epoch(self) -> None:
        stopper = self.early_stopping
        if stopper is not None and stopper.update(self.history.last, self.state.epoch):
            self.state.should_stop = True
        self.hooks.call("after_epoch")

    def _together(
        self,
        what: str,
        action: Callable[[], None],
        share: Callable[[], Sequence[int]] | None = None,
    ) -> list[list[int]]:
        """Run ``action`` on this rank, then agree with every rank on whether it failed
        anywhere: a hook or validation step that raises on one rank raises RankFailedError on
        every rank instead of leaving the others waiting in their next collective (one tiny
        all_gather; in one process the original error is re-raised unchanged). ``share()``,
        read after ``action`` (a few integers, as many on every rank), travels with it:
        returns every rank's."""
        error: Exception | None = None
        try:
            action()
        except Exception as caught:
            error = caught
        return self.comm.raise_if_any_failed(error, what, share() if share else ())


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``a.b.c`` keys; lists and other values as they are."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


__all__ = ["Metric", "OptimizerFactory", "SchedulerFactory", "Trainer", "TrainerState"]
