"""Trainer: the training loop, extended by subclassing and hooks.

The loop, in pseudocode (every rank runs it on its own shard)::

    for epoch in range(done, epochs):
        loader.set_epoch(epoch)
        for each batch:                      # window = accumulate_grad_batches micro-batches
            run_step(batch)                  # forward (autocast), backward; on the last
                                             # micro-batch of a window: sync, clip, step, EMA
        train_loss <- one all_reduce         # no host sync inside the epoch
        metrics <- evaluate(val_loader)      # exact: every sample once, sums and counts
        scheduler.step(); history.append(record); early stopping (same decision everywhere)

Override ``training_step``, ``validation_step``, ``predict_step``, ``compute_loss`` or
``configure_optimizers``; call ``forward`` inside them so the right model runs (the DDP
model while training, the plain or EMA model while evaluating).
"""

from __future__ import annotations

import inspect
import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sized
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from loguru import logger
from torch import nn

from nn_handler.checkpoint.manager import CheckpointManager
from nn_handler.checkpoint.rng import capture_rng, restore_rng
from nn_handler.config.checkpoint import CheckpointConfig
from nn_handler.config.training import EmaConfig, PrecisionConfig, TrainerConfig
from nn_handler.data.exact import gather_in_dataset_order
from nn_handler.distributed.communicator import Communicator, NullCommunicator
from nn_handler.errors import (
    CheckpointError,
    ConfigError,
    NonFiniteError,
    UnevenDataError,
)
from nn_handler.strategies import Strategy, select_strategy
from nn_handler.training.batch import batch_size_of, move_to_device
from nn_handler.training.checkpointing import build_checkpoint, describe_loader, plain_config
from nn_handler.training.early_stopping import EarlyStopping
from nn_handler.training.ema import ModelEma
from nn_handler.training.fault_tolerance import FaultTolerance
from nn_handler.training.history import History, Record
from nn_handler.training.hooks import Hook, HookList
from nn_handler.training.limits import limited, stepping_batches
from nn_handler.training.metrics import (
    MetricFn,
    RunningLoss,
    StatefulMetric,
    WeightedMeans,
    compute_stateful,
)
from nn_handler.training.monitors import check_monitors
from nn_handler.training.nonfinite import BufferSnapshot, GradientFiniteCheck
from nn_handler.training.precision import Precision
from nn_handler.training.progress import ProgressBar

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
Metric = MetricFn | StatefulMetric


@runtime_checkable
class Stateful(Protocol):
    """What ``Trainer.track`` keeps in checkpoints."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass
class TrainerState:
    """Where the loop is; read it from hooks, never write it.

    Attributes:
        epoch: epochs completed (during an epoch: its 0-based index).
        global_step: optimizer steps taken, skipped ones included.
        batch_index: the batch within the epoch.
        skipped_steps: optimizer steps skipped for non-finite values, in this epoch.
        skipped_in_a_row: optimizer steps skipped in a row, up to the last one (0 after a
            step that was taken).
        step_synced: whether the last batch ended an accumulation window (an optimizer step).
        last_loss: the last batch's loss, a detached device tensor (``float()`` syncs).
        should_stop: set when early stopping (or a hook) ends training after this epoch.
    """

    epoch: int = 0
    global_step: int = 0
    batch_index: int = 0
    skipped_steps: int = 0
    skipped_in_a_row: int = 0
    step_synced: bool = False
    last_loss: torch.Tensor | None = None
    should_stop: bool = False


def _length(loader: Iterable[Any]) -> int | None:
    if isinstance(loader, Sized):
        try:
            return len(loader)
        except TypeError:
            return None
    return None


def _required_positional(fn: Callable[..., Any]) -> int:
    try:
        parameters = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin or C callable: the one-argument form
        return 1
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(1 for p in parameters if p.kind in kinds and p.default is inspect.Parameter.empty)


def _is_scalar(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, int | float) and not isinstance(value, bool)


def _set_epoch(loader: Iterable[Any], epoch: int) -> None:
    batch_sampler = getattr(loader, "batch_sampler", None)
    candidates: list[Any] = [
        loader,
        getattr(loader, "sampler", None),
        getattr(batch_sampler, "sampler", None),
    ]
    for target in candidates:
        if target is not None and callable(getattr(target, "set_epoch", None)):
            target.set_epoch(epoch)
            return


class Trainer:
    """Trains one model on this rank's data; every rank must call ``fit``/``evaluate`` alike.

    How the model is parallelised is the Strategy's (``TrainerConfig.strategy``, see
    nn_handler/strategies/): with 'auto', a run of more than one rank wraps the model in
    DistributedDataParallel (with synchronised BatchNorm when configured), one rank trains it
    as it is; either is compiled if configured. ``optimizer`` and ``scheduler`` are instances
    or factories (``lambda params: torch.optim.Adam(params)``, ``lambda opt: StepLR(opt, 10)``)
    called after wrapping.
    """

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
        self.strategy: Strategy = select_strategy(self.comm, self.device, self.config)
        self.module, self.model = self.strategy.setup(model)
        self.metrics: dict[str, Metric] = dict(metrics or {})
        self._stateful = {k: m for k, m in self.metrics.items() if isinstance(m, StatefulMetric)}
        for metric in self._stateful.values():
            if isinstance(metric, nn.Module):
                metric.to(self.device)
        self.history = History()
        self.state = TrainerState()
        self.early_stopping = (
            EarlyStopping(self.config.early_stopping) if self.config.early_stopping else None
        )
        self.hooks = HookList(hooks, self)
        self._scheduler_factory: Callable[[Any, int], Any] | None = None
        self._pending_scheduler_state: Any = None
        #: The user's own checkpointed state, by name (see ``track``).
        self.tracked: dict[str, Stateful] = {}
        for hook in self.hooks.hooks:
            if isinstance(hook, Stateful):
                name = f"hook.{type(hook).__name__}"
                self.tracked[
                    name if name not in self.tracked else f"{name}.{len(self.tracked)}"
                ] = hook
        # Last among the parts a subclass may read (state, history, hooks, metrics, strategy).
        self.optimizer, self.scheduler = self.configure_optimizers(optimizer, scheduler)
        self._check_scheduler()
        self.ema = ModelEma(self.module, ema) if ema is not None and ema.enabled else None
        self._params = [p for p in self.module.parameters() if p.requires_grad]
        self._guard = self.config.nonfinite != "off" and self.precision.scaler is None
        self._finite = GradientFiniteCheck(self._params)
        snapshot = BufferSnapshot(self.module)
        self._buffers = snapshot if self._guard and snapshot.has_buffers else None
        self._window_losses: list[torch.Tensor] = []
        self._non_blocking = self.config.non_blocking and self.device.type == "cuda"
        self._active: nn.Module = self.model
        self._metric_updates = 0
        #: The run's configuration as plain values, stored in checkpoints (NNHandler puts its
        #: whole HandlerConfig here).
        self.run_config: dict[str, Any] = {
            "trainer": plain_config(self.config),
            "precision": plain_config(precision or PrecisionConfig()),
            "ema": plain_config(ema or EmaConfig()),
            "checkpoint": plain_config(checkpoint or CheckpointConfig()),
        }
        self.epoch_rng: dict[str, Any] | None = None
        self.batches_done = 0
        self.data_description: dict[str, Any] = {}
        self._running: RunningLoss | None = None
        self.fault_tolerance = FaultTolerance(self, checkpoint or CheckpointConfig())

    # ----------------------------------------------------------------- construction
    @property
    def is_main_process(self) -> bool:
        return self.comm.rank == 0

    def track(self, name: str, obj: Stateful) -> None:
        """Keep ``obj`` (anything with ``state_dict()`` and ``load_state_dict(state)``) in
        every checkpoint under ``name``: each rank's own state is saved and restored on that
        rank, so per-rank sums or counters resume exactly. Call it on every rank before ``fit``
        or ``resume`` (which restore it), e.g. in ``configure_optimizers`` or right after
        building the handler. Hooks with ``state_dict``/``load_state_dict`` are tracked by
        themselves, as ``hook.<ClassName>``."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"track needs a non-empty str name, got {name!r}.")
        missing = [
            m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))
        ]
        if missing:
            raise ConfigError(
                f"track({name!r}, ...): {type(obj).__name__} has no {' or '.join(missing)}; "
                f"track an object with state_dict() and load_state_dict(state)."
            )
        if name in self.tracked and self.tracked[name] is not obj:
            raise ConfigError(f"track: the name {name!r} is already tracked for another object.")
        self.tracked[name] = obj

    def release_wrappers(self) -> None:
        """Drop the strategy's wrappers (DDP, compile), keeping the plain module for evaluation.

        Call before the process group is destroyed (NNHandler.close does): a DDP reducer
        freed after ``destroy_process_group`` can hang or abort the process at exit.
        """
        self.strategy.release()
        self.model = self.module
        self._active = self.module

    def configure_optimizers(
        self, optimizer: torch.optim.Optimizer | OptimizerFactory | None, scheduler: Any
    ) -> tuple[torch.optim.Optimizer | None, Any]:
        """Build the optimizer and scheduler (override to construct them yourself).

        Called once, after the model is wrapped and once ``state``, ``history``, ``hooks``,
        ``metrics`` and ``strategy`` exist; factories receive ``self.model.parameters()`` and
        the optimizer respectively.
        """
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise ConfigError(
                    f"optimizer must be a torch.optim.Optimizer or a factory taking the "
                    f"parameters, got {type(optimizer).__name__}."
                )
            optimizer = optimizer(self.model.parameters())
        if scheduler is not None and optimizer is None:
            raise ConfigError("a scheduler needs an optimizer: pass optimizer= as well.")
        if scheduler is not None and not hasattr(scheduler, "step") and callable(scheduler):
            if _required_positional(scheduler) >= 2:
                # lambda opt, total_steps: ... -> built when fit knows the run's length.
                self._scheduler_factory = scheduler
                return optimizer, None
            scheduler = scheduler(optimizer)
        return optimizer, scheduler

    def _build_deferred_scheduler(self, loader: Iterable[Any], epochs: int) -> None:
        factory, self._scheduler_factory = self._scheduler_factory, None
        if factory is None:
            return
        self.scheduler = factory(self.optimizer, self.estimated_stepping_batches(loader, epochs))
        self._check_scheduler()
        pending, self._pending_scheduler_state = self._pending_scheduler_state, None
        if pending is not None and self.scheduler is not None:
            self.scheduler.load_state_dict(pending)

    def _check_scheduler(self) -> None:
        plateau = isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
        if plateau and self.config.scheduler_interval == "step":
            raise ConfigError(
                "ReduceLROnPlateau steps on an epoch metric: use "
                "TrainerConfig(scheduler_interval='epoch')."
            )

    def hyperparameters(self) -> dict[str, Any]:
        """The run's settings, flat (for experiment loggers)."""
        params: dict[str, Any] = {f"trainer.{k}": v for k, v in self.config.model_dump().items()}
        params["precision"] = self.precision.name
        params["world_size"] = self.comm.world_size
        params["ema"] = self.ema is not None
        if self.optimizer is not None:
            params["optimizer"] = type(self.optimizer).__name__
            params["lr"] = self.optimizer.param_groups[0]["lr"]
        return params

    # ----------------------------------------------------------------- override points
    def forward(self, inputs: Any) -> Any:
        """Run the active model: the DDP-wrapped one in training, the plain (or EMA) one in
        evaluation."""
        return self._active(inputs)

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
        """Per-batch means to average over the validation set (weighted by batch size).

        The default returns the loss and ``update_metrics(outputs, targets)``: every metric
        function's value, with stateful (torchmetrics) metrics updated. An override that
        wants ``metrics=`` must call ``update_metrics`` too (or the evaluation says so).
        """
        inputs, targets = self.split_batch(batch)
        outputs = self.forward(inputs)
        values: dict[str, torch.Tensor | float] = {"loss": self.compute_loss(outputs, targets)}
        values.update(self.update_metrics(outputs, targets))
        return values

    def update_metrics(self, outputs: Any, targets: Any) -> dict[str, torch.Tensor | float]:
        """Feed one validation batch to ``metrics=``: stateful (torchmetrics) metrics are
        updated, and the metric functions' values are returned (to include in what
        ``validation_step`` returns, which averages them over the set)."""
        self._metric_updates += 1
        values: dict[str, torch.Tensor | float] = {}
        for name, metric in self.metrics.items():
            if isinstance(metric, StatefulMetric):
                metric.update(outputs, targets)
            else:
                values[name] = metric(outputs, targets)
        return values

    def predict_step(self, batch: Any) -> torch.Tensor:
        """Per-sample outputs of one batch (dim 0 = samples); the default runs the model on
        the batch's inputs (its first element when it is a tuple or list)."""
        inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        output: torch.Tensor = self.forward(inputs)
        return output

    # ----------------------------------------------------------------- one step
    def run_step(self, batch: Any, sync: bool = True, window: int = 1) -> torch.Tensor:
        """One micro-batch: forward and backward, then the optimizer step when ``sync``.

        ``window`` is the number of micro-batches accumulated into this optimizer step; the
        loss is divided by it so the gradient is the window's mean. Returns the detached loss.
        """
        batch = move_to_device(batch, self.device, self._non_blocking)
        if not sync:
            # Gradients are synchronised across ranks only on the last micro-batch of a window.
            with self.strategy.no_sync():
                return self._forward_backward(batch, window)
        loss = self._forward_backward(batch, window)
        if sync:
            self.optimizer_step()
        return loss

    def _forward_backward(self, batch: Any, window: int) -> torch.Tensor:
        buffers = self._buffers
        if buffers is not None and not buffers.taken:  # the first micro-batch of a step
            buffers.take()
        with self.precision.autocast():
            output = self.training_step(batch)
            loss = self._loss_of(output)
        if isinstance(output, Mapping) and len(output) > 1 and self._running is not None:
            # Other scalars the step returned: sample-weighted per epoch, no host sync here.
            extras = {
                k: v.detach().reshape(()) if isinstance(v, torch.Tensor) else v
                for k, v in output.items()
                if k != "loss" and _is_scalar(v)
            }
            if extras:
                self._running.extras.update(extras, batch_size_of(batch))
        if self._guard and self.strategy.reduces_gradients:
            # Backward seeded with 0 * loss + 1/window: NaN when the loss is NaN/inf, so this
            # rank's gradients turn NaN and DDP's averaging carries that to every rank; one
            # check of the synchronised gradients then decides for all ranks.
            self.precision.backward(loss, loss.detach().mul(0.0).add_(1.0 / window))
            return loss.detach()
        self.precision.backward(loss / window if window > 1 else loss)
        detached = loss.detach()
        if self._guard:  # without DDP the window's losses join the gradients' finite check
            self._window_losses.append(detached)
        return detached

    def optimizer_step(self) -> bool:
        """Unscale, clip, check, then step (or skip) on every rank alike; returns whether the
        optimizer stepped. Also updates the EMA and a per-step scheduler, and zeroes grads."""
        optimizer = self.optimizer or self._require_optimizer()
        if self.precision.scaler is not None:
            self.precision.unscale(optimizer)
        if self.config.gradient_clip_val is not None:
            self.strategy.clip_grad_norm(
                self._params,
                self.config.gradient_clip_val,
                self.config.gradient_clip_norm_type,
            )
        stepped = self._finite.all_finite(self._window_losses) if self._guard else True
        self._window_losses.clear()
        if stepped:
            scaler = self.precision.scaler
            if scaler is not None:
                scale = scaler.get_scale()
                self.precision.step(optimizer)
                stepped = scaler.get_scale() >= scale
            else:
                optimizer.step()
            if self._buffers is not None:
                self._buffers.taken = False
            self.state.skipped_in_a_row = 0
        else:
            if self._buffers is not None:
                self._buffers.restore()
            self._on_nonfinite()
        if stepped:
            if self.ema is not None:
                self.ema.update()
            if self.scheduler is not None and self.config.scheduler_interval == "step":
                self.scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        self.state.global_step += 1
        return stepped

    def _on_nonfinite(self) -> None:
        where = f"epoch {self.state.epoch + 1}, optimizer step {self.state.global_step + 1}"
        if self.config.nonfinite == "raise":
            raise NonFiniteError(
                f"the loss or gradients were NaN/inf on at least one rank at {where}; every "
                f"rank stops here. Use TrainerConfig(nonfinite='skip') to skip such steps."
            )
        state = self.state
        state.skipped_steps += 1
        state.skipped_in_a_row += 1
        limit = self.config.max_consecutive_skipped_steps
        if limit is not None and state.skipped_in_a_row >= limit:
            raise NonFiniteError(
                f"the loss or gradients were NaN/inf on at least one rank for "
                f"{state.skipped_in_a_row} optimizer steps in a row (the last at {where}); the "
                f"run has diverged, so every rank stops here. Lower the learning rate, check the "
                f"data, or raise TrainerConfig(max_consecutive_skipped_steps=...)."
            )
        self.log.warning("skipped the optimizer step at {}: NaN/inf loss or gradients", where)

    def _loss_of(self, output: torch.Tensor | Mapping[str, torch.Tensor]) -> torch.Tensor:
        if isinstance(output, torch.Tensor):
            return output
        if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            return output["loss"]
        keys = f" with keys {sorted(output)}" if isinstance(output, Mapping) else ""
        raise ConfigError(
            f"training_step must return the loss tensor or a dict with a 'loss' tensor, got "
            f"{type(output).__name__}{keys}."
        )

    def _require_optimizer(self) -> torch.optim.Optimizer:
        if self.optimizer is None:
            raise ConfigError(
                "training needs an optimizer: pass optimizer= (an instance or a factory such as "
                "lambda params: torch.optim.Adam(params, lr=1e-3)) or override "
                "configure_optimizers."
            )
        return self.optimizer

    # ----------------------------------------------------------------- epochs
    def train_epoch(self, loader: Iterable[Any], epochs: int) -> Record:
        """One pass over ``loader``; returns the epoch's train loss, samples and timing."""
        self._require_optimizer()
        self.model.train()
        total = limited(_length(loader), self._train_limit())
        accumulate = self.config.accumulate_grad_batches
        if accumulate > 1 and total is None:
            raise ConfigError(
                "gradient accumulation needs a loader with len() (to close the last window of "
                "an epoch on every rank alike); set accumulate_grad_batches=1 or pass a sized "
                "loader."
            )
        self._check_equal_lengths(total)
        running = RunningLoss(self.config.log_every_n_steps)
        self._running = running
        self._window_losses.clear()  # nothing left over from an epoch that raised
        bar = ProgressBar(
            self.config.progress_bar and self.is_main_process,
            total,
            f"epoch {self.state.epoch + 1}/{epochs}",
        )
        show = bar.active  # the running values are read (a host sync) only for a shown bar
        self.state.skipped_steps = 0
        started = time.perf_counter()
        try:
            batches, first = self._batches(loader, running)
            bar.update(first)
            # The per-batch path, with its lookups hoisted: in one process it is what the loop
            # costs on top of the model (benchmarks/training_step.py).
            state, hooks, log_every = self.state, self.hooks, self.config.log_every_n_steps
            before = hooks.has("before_step")
            after = hooks.has("after_step")
            run_step, add, end_window, update = (
                self.run_step,
                running.add,
                running.end_window,
                bar.update,
            )
            after_optimizer_step = self.fault_tolerance.after_optimizer_step
            per_step = self.fault_tolerance.wants_step_calls()
            max_steps = self.config.max_steps
            if total is not None:  # limit_train_batches / fast_dev_run
                batches = itertools.islice(batches, max(total - first, 0))
            for index, batch in enumerate(batches, start=first):
                start = index - index % accumulate
                end = start + accumulate if total is None else min(start + accumulate, total)
                state.batch_index = index
                synced = state.step_synced = index + 1 == end
                if before:
                    hooks.call("before_step")
                loss = run_step(batch, synced, end - start)
                state.last_loss = loss
                add(loss, batch_size_of(batch))
                if synced:
                    self.batches_done = index + 1
                    end_window(end - start, state.skipped_in_a_row > 0)
                if after:
                    hooks.call("after_step")
                update()
                if show and (index + 1) % log_every == 0:
                    elapsed = time.perf_counter() - started
                    bar.show(
                        loss=running.local_mean(),
                        samples_s=running.samples / elapsed,
                        **running.extras.local_means(),
                    )
                if synced and per_step:
                    after_optimizer_step()
                if synced and max_steps is not None and state.global_step >= max_steps:
                    state.should_stop = True  # every rank alike: the same steps everywhere
                    break
        finally:
            bar.close()
            self._running = None
        loss_value, samples, extras = running.compute(self.comm, self.device)
        elapsed = time.perf_counter() - started
        record = {
            "train_loss": loss_value,
            "samples_per_sec": samples / elapsed if elapsed > 0 else 0.0,
            "epoch_time": elapsed,
            "skipped_steps": float(self.state.skipped_steps),
        }
        record.update({f"train_{key}": value for key, value in extras.items()})
        return record

    def _check_equal_lengths(self, total: int | None) -> None:
        """Every rank must take the same number of steps (DDP's gradient all_reduce pairs the
        ranks' steps): one tiny all_gather per epoch compares the loaders' lengths."""
        if self.comm.world_size == 1:
            return
        mine = torch.tensor([-1 if total is None else total], dtype=torch.int64)
        lengths = [int(n.item()) for n in self.comm.all_gather(mine.to(self.device))]
        if len(set(lengths)) == 1:
            return
        described = ", ".join(
            f"rank {rank}: {'no len()' if n < 0 else n}" for rank, n in enumerate(lengths)
        )
        raise UnevenDataError(
            f"the training loaders have different numbers of batches per rank ({described}) in "
            f"epoch {self.state.epoch + 1}; every rank must take the same number of optimizer "
            f"steps. Pass the dataset instead of a DataLoader (the LoaderFactory gives every "
            f"rank equal batches) or use a DistributedSampler over the whole dataset."
        )

    def _batches(self, loader: Iterable[Any], running: RunningLoss) -> tuple[Iterator[Any], int]:
        """The epoch's batch iterator and the index of its first batch: after a mid-epoch
        resume, the batches already trained are read and discarded (so the data order and
        the RNG streams continue exactly) and the partial loss and RNG state are restored."""
        iterator = iter(loader)
        point = self.fault_tolerance.take_resume_point()
        if point is None or not point.batches_done:
            return iterator, 0
        for done in range(point.batches_done):
            try:
                next(iterator)
            except StopIteration:
                raise CheckpointError(
                    f"the checkpoint stopped after batch {point.batches_done} of epoch "
                    f"{self.state.epoch + 1}, but the loader ended after {done} batches; resume "
                    f"with the same data and batch size."
                ) from None
        if point.running is not None:
            running.load_state_dict(point.running, self.device)
        self.state.skipped_steps = point.skipped_steps
        if point.step_rng is not None:
            restore_rng(point.step_rng)
        return iterator, point.batches_done

    @torch.no_grad()
    def evaluate(self, loader: Iterable[Any], use_ema: bool | None = None) -> dict[str, float]:
        """Exact metrics over ``loader`` (loss and configured metrics); every rank must call
        this and gets the same values. Uses the EMA weights when ``use_ema`` (default: the
        EmaConfig's validate_with_ema)."""
        module = self._eval_module(use_ema)
        was_training = module.training
        module.eval()
        means = WeightedMeans()
        self._active = module

        limit = self.config.fast_dev_run or self.config.limit_val_batches
        count = limited(_length(loader), limit)
        batches_to_run = loader if count is None else itertools.islice(loader, count)

        def validate() -> None:
            self._metric_updates = batches = 0
            for batch in batches_to_run:
                batch = move_to_device(batch, self.device, self._non_blocking)
                with self.precision.autocast():
                    values = self.validation_step(batch)
                means.update(values, batch_size_of(batch))
                batches += 1
            if self.metrics and batches and not self._metric_updates:
                raise ConfigError(
                    f"validation_step is overridden and never called "
                    f"self.update_metrics(outputs, targets), so metrics "
                    f"{sorted(self.metrics)} saw none of the {batches} validation batches; "
                    f"call it in validation_step (the default does) and merge its result into "
                    f"what you return."
                )

        try:
            self._together("evaluate: the validation loop", validate)
            results = means.compute(self.comm, self.device)
            for name, metric in self._stateful.items():
                results[name] = compute_stateful(metric)
                metric.reset()
        finally:
            self._active = self.model
            module.train(was_training)
        self._together(
            "after_validation hooks", lambda: self.hooks.call("after_validation", results)
        )
        return results

    @torch.no_grad()
    def predict(self, loader: Iterable[Any], use_ema: bool | None = None) -> torch.Tensor:
        """Every sample's output, in dataset order, on every rank; every rank must call this.

        With more than one rank ``loader`` must be an evaluation loader (with ``indices``:
        ``LoaderFactory.eval_loader``), so the outputs can be put back in dataset order.
        """
        indices = getattr(loader, "indices", None)
        if indices is None and self.comm.world_size > 1:
            raise ConfigError(
                "predict with several ranks needs an evaluation loader from "
                "LoaderFactory.eval_loader (it knows each sample's dataset index); pass the "
                "dataset to NNHandler.predict instead of a DataLoader."
            )
        module = self._eval_module(use_ema)
        was_training = module.training
        module.eval()
        self._active = module
        outputs: list[torch.Tensor] = []

        def run() -> None:
            for batch in loader:
                batch = move_to_device(batch, self.device, self._non_blocking)
                with self.precision.autocast():
                    outputs.append(self.predict_step(batch).float())

        try:
            self._together("predict: the prediction loop", run)
        finally:
            self._active = self.model
            module.train(was_training)
        local = torch.cat(outputs) if outputs else torch.empty(0, device=self.device)
        if indices is None:
            return local
        if self.comm.world_size > 1:
            # A rank without samples has no output to take the per-sample shape from: it
            # takes its peers' (one small exchange), so every rank gathers (0, ...) alike.
            tails = self.comm.all_gather_object(tuple(local.shape[1:]) if outputs else None)
            tail = next((t for t in tails if t is not None), ())
            if not outputs:
                local = torch.empty((0, *tail), device=self.device)
        return gather_in_dataset_order(local, indices, self.comm)  # type: ignore[no-any-return]

    def _eval_module(self, use_ema: bool | None) -> nn.Module:
        if use_ema is None:
            use_ema = self.ema is not None and self.ema.config.validate_with_ema
        if use_ema and self.ema is None:
            raise ConfigError("use_ema=True but EMA is off: set EmaConfig(enabled=True).")
        # The plain module, never the DDP wrapper: ranks may see different batch counts here.
        return self.ema.module if use_ema and self.ema is not None else self.module

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
        check_monitors(self, validates=val_loader is not None)
        failed = True
        try:
            with self.fault_tolerance.failing_together():
                self._build_deferred_scheduler(train_loader, epochs)
                self.fault_tolerance.begin_fit(train_loader)
                self._warn_if_the_schedule_ends_early(epochs, train_loader)
                self._together("before_train hooks", lambda: self.hooks.call("before_train"))
                with self.fault_tolerance.watching():
                    while self.state.epoch < epochs and not self._stop_before_epoch():
                        self._run_epoch(train_loader, val_loader, epochs)
                    self.fault_tolerance.end_fit()
            failed = False
        finally:
            self._after_train(failed)
        return self.history

    def _stop_before_epoch(self) -> bool:
        max_steps = self.config.max_steps
        return self.state.should_stop or (
            max_steps is not None and self.state.global_step >= max_steps
        )

    def _train_limit(self) -> int | float | None:
        return self.config.fast_dev_run or self.config.limit_train_batches

    def estimated_stepping_batches(self, loader: Iterable[Any], epochs: int | None = None) -> int:
        """The optimizer steps ``fit(loader, epochs=epochs)`` will have taken in total when it
        ends (steps already done included; limit_train_batches, accumulation and max_steps
        applied): the length a per-step LR schedule needs. ``loader`` must have len()."""
        batches = limited(_length(loader), self._train_limit())
        if batches is None:
            raise ConfigError(
                "estimated_stepping_batches needs a loader with len(); pass the number of "
                "steps to the scheduler yourself for an iterable loader."
            )
        epochs = epochs if epochs is not None else self.config.epochs
        if self.config.fast_dev_run:
            epochs = self.state.epoch + 1
        return stepping_batches(
            batches,
            self.config.accumulate_grad_batches,
            epochs,
            epochs_done=self.state.epoch,
            steps_done=self.state.global_step,
            max_steps=self.config.max_steps,
        )

    def _warn_if_the_schedule_ends_early(self, epochs: int, loader: Iterable[Any]) -> None:
        """An LR schedule with a horizon (T_max, total_steps, total_iters) that this fit would
        step past: it does not stretch to the run (a finished cosine rises again), so say so
        before training, e.g. when a resumed run's epochs are extended."""
        horizon = next(
            (
                (name, int(getattr(self.scheduler, name)))
                for name in ("T_max", "total_steps", "total_iters")
                if isinstance(getattr(self.scheduler, name, None), int)
            ),
            None,
        )
        if horizon is None:
            return
        name, length = horizon
        unit = "epochs"
        total = epochs
        if self.config.scheduler_interval == "step":
            if _length(loader) is None:
                return
            total = self.estimated_stepping_batches(loader, epochs)
            unit = "optimizer steps"
        if total <= length:
            return
        self.log.warning(
            "the LR scheduler {} has {}={} but this run goes to {} {}: past its end it goes on "
            "with its own formula (a cosine schedule's learning rate rises again). Build it "
            "for {} {} to anneal over the whole run (extending epochs on resume keeps the "
            "saved {}).",
            type(self.scheduler).__name__,
            name,
            length,
            total,
            unit,
            total,
            unit,
            name,
        )

    def _after_train(self, failed: bool) -> None:
        try:
            self.hooks.call("after_train")
        except Exception:
            if not failed:
                raise
            self.log.exception("an after_train hook raised while training was failing")

    def _run_epoch(
        self, train_loader: Iterable[Any], val_loader: Iterable[Any] | None, epochs: int
    ) -> None:
        point = self.fault_tolerance.resume_point
        if point is not None and point.start_rng is not None:
            restore_rng(point.start_rng)
        self.epoch_rng = capture_rng()
        self.data_description = describe_loader(train_loader)
        _set_epoch(train_loader, self.state.epoch)
        self._together("before_epoch hooks", lambda: self.hooks.call("before_epoch"))
        record: Record = {"epoch": float(self.state.epoch + 1)}
        record.update(self.train_epoch(train_loader, epochs))
        record["lr"] = float(self._require_optimizer().param_groups[0]["lr"])
        if val_loader is not None:
            record.update({f"val_{k}": v for k, v in self.evaluate(val_loader).items()})
        self._step_scheduler_per_epoch(record)
        self.history.append(record)
        self.state.epoch += 1
        self.batches_done = 0
        self._together("early stopping and after_epoch hooks", self._end_epoch)
        self.state.should_stop = self._agree(self.state.should_stop)
        self.fault_tolerance.after_epoch(record)
        self.log.info("epoch {}/{}: {}", self.state.epoch, epochs, _summary(record))
        if self.state.should_stop and self.early_stopping is not None:
            self.log.info(
                "early stopping: {} has not improved for {} epochs (best {:.6g} at epoch {})",
                self.early_stopping.config.monitor,
                self.early_stopping.wait,
                self.early_stopping.best,
                self.early_stopping.best_epoch,
            )

    # ----------------------------------------------------------------- checkpoints
    @property
    def checkpoints(self) -> CheckpointManager | None:
        """The CheckpointManager of CheckpointConfig.dir (None without a folder)."""
        return self.fault_tolerance.manager

    @property
    def checkpoint_config(self) -> CheckpointConfig:
        return self.fault_tolerance.config

    def state_dict(self) -> dict[str, Any] | None:
        """The full checkpoint (see training/checkpointing.py) on rank 0, None on the other
        ranks. Every rank must call this (it gathers every rank's RNG state)."""
        return build_checkpoint(self, self._running)

    def load_state_dict(
        self,
        checkpoint: Mapping[str, Any],
        source: str = "checkpoint",
        allow_world_size_change: bool | None = None,
    ) -> None:
        """Restore a checkpoint from ``state_dict``; the next ``fit`` continues exactly
        where it was written (mid-epoch too). ``allow_world_size_change`` (default:
        CheckpointConfig.allow_world_size_change) accepts another number of ranks between
        epochs. Every rank must call this with the same one."""
        self.fault_tolerance.load(checkpoint, source, allow_world_size_change)

    def save_checkpoint(self, path: str | Path, budget_s: float | None = None) -> Path:
        """Write the full checkpoint to ``path`` atomically (rank 0 writes). Every rank must
        call this; all raise CheckpointError if the write failed."""
        return self.fault_tolerance.save(path, budget_s)

    def save_periodic(self, budget_s: float | None = None) -> Path:
        """Write the periodic checkpoint of the current position (named by epoch and step) and
        point latest.json at it. Every rank must call this."""
        return self.fault_tolerance.save_periodic(budget_s)

    def resume(
        self,
        path: str | Path = "latest",
        *,
        allow_world_size_change: bool | None = None,
        missing_ok: bool = False,
    ) -> Path | None:
        """Load a checkpoint so that the next ``fit`` continues the run exactly.

        ``path`` is a checkpoint file, a checkpoint folder, or "latest" (the newest complete
        checkpoint in CheckpointConfig.dir; an unreadable newest one falls back to the previous).
        Rank 0 chooses the file and every rank loads it (map_location: this rank's device).
        Returns the path, or None when ``missing_ok`` and there is none.
        ``allow_world_size_change`` defaults to CheckpointConfig.allow_world_size_change.
        Every rank must call this; a failure on any rank raises CheckpointError on every rank.
        """
        return self.fault_tolerance.resume(path, allow_world_size_change, missing_ok)

    def _end_epoch(self) -> None:
        stopper = self.early_stopping
        if stopper is not None and stopper.update(self.history.last, self.state.epoch):
            self.state.should_stop = True
        self.hooks.call("after_epoch")

    def _together(self, what: str, action: Callable[[], None]) -> None:
        """Run ``action`` on this rank, then agree with every rank on whether it failed
        anywhere: a hook or validation step that raises on one rank raises RankFailedError on
        every rank instead of leaving the others waiting in their next collective (one tiny
        all_gather; in one process the original error is re-raised unchanged)."""
        error: Exception | None = None
        try:
            action()
        except Exception as caught:
            error = caught
        self.comm.raise_if_any_failed(error, what)

    def _step_scheduler_per_epoch(self, record: Record) -> None:
        if self.scheduler is None or self.config.scheduler_interval != "epoch":
            return
        if isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            monitor = self.config.scheduler_monitor
            if monitor not in record:
                raise ConfigError(
                    f"ReduceLROnPlateau monitors {monitor!r}, but the epoch record has only "
                    f"{sorted(record)}; set TrainerConfig(scheduler_monitor=...)."
                )
            self.scheduler.step(record[monitor])
        else:
            self.scheduler.step()

    def _agree(self, flag: bool) -> bool:
        """Rank 0's decision, on every rank (one tiny broadcast per epoch)."""
        if self.comm.world_size == 1:
            return flag
        decision = self.comm.broadcast(torch.tensor([int(flag)], device=self.device), src=0)
        return bool(decision.item())


def _summary(record: Record) -> str:
    shown = {k: v for k, v in record.items() if k != "epoch" and (k != "skipped_steps" or v)}
    return ", ".join(f"{k}={v:.4g}" for k, v in shown.items())


__all__ = ["Metric", "OptimizerFactory", "SchedulerFactory", "Trainer", "TrainerState"]
