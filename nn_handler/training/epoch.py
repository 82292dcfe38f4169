"""One training epoch: the per-batch loop with its accumulation windows, progress, the
optimizer-step points (hooks, checkpoints), mid-epoch validation and a mid-epoch resume's
skipped batches. Mixed into Trainer; override ``train_epoch`` there."""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from nn_handler.checkpoint.rng import restore_rng
from nn_handler.data.reshard import rest_of_epoch
from nn_handler.errors import CheckpointError, ConfigError, UnevenDataError
from nn_handler.training.batch import batch_size_of, loader_length
from nn_handler.training.checkpoint_hook import CheckpointHook
from nn_handler.training.history import Record
from nn_handler.training.limits import limited, val_check_every, window
from nn_handler.training.metrics import MetricKeys, RunningLoss
from nn_handler.training.parts import TrainerParts
from nn_handler.training.position import ResumePoint
from nn_handler.training.progress import ProgressBar


class EpochMixin(TrainerParts):
    """``train_epoch`` and what it calls."""

    checkpoint_hook: CheckpointHook | None
    automatic_optimization: bool
    _window_losses: list[torch.Tensor]
    _window_open: bool
    _train_keys: MetricKeys
    _agreed_lengths: tuple[int, list[int]] | None

    if TYPE_CHECKING:  # provided by the Trainer's other parts

        def run_step(self, batch: Any, sync: bool = True, window: int = 1) -> torch.Tensor: ...

        def evaluate(
            self, loader: Iterable[Any], use_ema: bool | None = None
        ) -> dict[str, float]: ...

        def _train_limit(self) -> int | float | None: ...

        def _require_optimizer(self) -> torch.optim.Optimizer: ...

        @property
        def is_main_process(self) -> bool: ...

    def train_epoch(
        self, loader: Iterable[Any], epochs: int, val_loader: Iterable[Any] | None = None
    ) -> Record:
        """One pass over ``loader``; returns the epoch's train loss, samples and timing.
        ``val_loader`` is validated inside the epoch when ``val_check_interval`` says so."""
        self._require_optimizer()
        self.model.train()
        total = limited(loader_length(loader), self._train_limit())
        accumulate = self.config.accumulate_grad_batches
        if accumulate > 1 and total is None:
            raise ConfigError(
                "gradient accumulation needs a loader with len() (to close the last window of "
                "an epoch on every rank alike); set accumulate_grad_batches=1 or pass a sized "
                "loader."
            )
        self._check_equal_lengths(total, loader)
        every = self._val_check_every(total, val_loader)
        running = RunningLoss(self.config.log_every_n_steps)
        self.position.running = running
        self._window_losses.clear()  # nothing left over from an epoch that raised
        self._window_open = False  # nor its partial window's gradients: zeroed at the start
        bar = ProgressBar(
            self.config.progress_bar and self.is_main_process,
            total,
            f"epoch {self.state.epoch + 1}/{epochs}",
        )
        show = bar.active  # the running values are read (a host sync) only for a shown bar
        self.state.skipped_steps = 0
        started = time.perf_counter()
        try:
            batches, first = self._batches(loader, running, total)
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
            after_optimizer_step = self._after_optimizer_step
            checkpoint_hook = self.checkpoint_hook
            per_step = hooks.has("after_optimizer_step") or (
                checkpoint_hook is not None and checkpoint_hook.wants_step_calls()
            )
            max_steps = self.config.max_steps
            watched = self.strategy.reduces_gradients and self.comm.watching
            region = self.comm.watched if watched else None
            region_name = f"training step ({type(self.strategy).__name__}: forward, backward)"
            if total is not None and self._train_limit() is not None:  # a limited epoch
                batches = itertools.islice(batches, max(total - first, 0))
            for index, batch in enumerate(batches, start=first):
                start, end = window(index, accumulate, total)
                state.batch_index = index
                state.batch = batch
                synced = state.step_synced = index + 1 == end
                if before:
                    hooks.call("before_step")
                if region is None:
                    loss = run_step(batch, synced, end - start)
                else:  # the stall watchdog counts the step's DDP/FSDP collectives as one
                    with region(region_name):
                        loss = run_step(batch, synced, end - start)
                state.last_loss = loss
                add(loss, batch_size_of(batch))
                if synced:
                    self.position.batches_done = index + 1
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
                # (The epoch's end validates anyway: not again at its last batch.)
                if synced and every and (index + 1) % every == 0 and index + 1 != total:
                    self._validate_mid_epoch(val_loader, index + 1, total)
                if synced and per_step:
                    after_optimizer_step()
                if synced and max_steps is not None and state.global_step >= max_steps:
                    state.should_stop = True  # every rank alike: the same steps everywhere
                    break
        finally:
            bar.close()
            self.position.running = None
            self.state.batch = None
        loss_value, samples, extras = running.compute(self.comm, self.device, self._train_keys)
        elapsed = time.perf_counter() - started
        record = {
            "train_loss": loss_value,
            "samples_per_sec": samples / elapsed if elapsed > 0 else 0.0,
            "epoch_time": elapsed,
            "skipped_steps": float(self.state.skipped_steps),
        }
        record.update({f"train_{key}": value for key, value in extras.items()})
        if not self.automatic_optimization and math.isnan(loss_value):
            del record["train_loss"]  # a manual training_step that returned no "loss"
        return record

    def _val_check_every(self, total: int | None, val_loader: Iterable[Any] | None) -> int | None:
        interval = self.config.val_check_interval
        if interval is None or val_loader is None:
            return None
        try:
            return val_check_every(total, interval, self.config.accumulate_grad_batches)
        except ValueError:
            raise ConfigError(
                f"val_check_interval={interval} is a fraction of the epoch, and the training "
                f"loader has no len(); pass an int number of batches instead."
            ) from None

    def _validate_mid_epoch(self, val_loader: Any, batches: int, total: int | None) -> None:
        """Validation inside the epoch (val_check_interval), before this step's checkpoint
        (whose RNG state then includes it, so a resume continues exactly)."""
        started = time.perf_counter()
        metrics = self.evaluate(val_loader)
        self.state.validation_seconds += time.perf_counter() - started
        self.log.info(
            "validation at step {} (epoch {}, batch {}/{}): {}",
            self.state.global_step,
            self.state.epoch + 1,
            batches,
            total if total is not None else "?",
            summary({f"val_{k}": v for k, v in metrics.items()}),
        )

    def _check_equal_lengths(self, total: int | None, loader: Iterable[Any]) -> None:
        """Every rank must take the same number of steps (DDP's gradient all_reduce pairs the
        ranks' steps): the loaders' lengths, exchanged by ``fit`` with the before_epoch
        agreement, or here in one tiny all_gather when ``train_epoch`` is called alone."""
        agreed, self._agreed_lengths = self._agreed_lengths, None
        if self.comm.world_size == 1:
            return
        mine = -1 if total is None else total
        # The same loader fit passed (the same decision on every rank): already exchanged.
        if agreed is not None and agreed[0] == id(loader):
            lengths = agreed[1]
        else:
            shared = self.comm.raise_if_any_failed(None, "comparing the loaders' lengths", [mine])
            lengths = [row[0] for row in shared]
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

    def _batches(
        self, loader: Iterable[Any], running: RunningLoss, total: int | None
    ) -> tuple[Iterator[Any], int]:
        """The epoch's batch iterator and the index of its first batch: after a mid-epoch
        resume, the batches already trained are read and discarded (so the data order and
        the RNG streams continue exactly) and the partial loss and RNG state are restored."""
        point = self.position.take_resume()
        if point is not None and point.batches_done and point.saved_world is not None:
            return self._rest_of_epoch(loader, point, total)
        iterator = iter(loader)
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

    def _rest_of_epoch(
        self, loader: Iterable[Any], point: ResumePoint, total: int | None
    ) -> tuple[Iterator[Any], int]:
        """A mid-epoch position written by another number of ranks: the epoch's samples not
        yet visited, re-sharded over this run's ranks (data/reshard.py); its batches are
        numbered to end where this run's epoch ends."""
        rest = rest_of_epoch(
            loader,
            saved_world=int(point.saved_world or 1),
            saved_batch_size=int(point.data.get("batch_size") or 0),
            batches_done=point.batches_done,
            rank=self.comm.rank,
            world_size=self.comm.world_size,
        )
        self.state.skipped_steps = point.skipped_steps
        first = max((total or len(rest)) - len(rest), 0)
        return iter(rest), first

    def _after_optimizer_step(self) -> None:
        """The user's ``after_optimizer_step`` hooks, then the checkpoint policy's."""
        self.hooks.call("after_optimizer_step")
        if self.checkpoint_hook is not None:
            self.checkpoint_hook.after_optimizer_step()


def summary(record: Record) -> str:
    """An epoch record as ``key=value`` pairs (``*_pct`` keys as percentages)."""
    shown = {k: v for k, v in record.items() if k != "epoch" and (k != "skipped_steps" or v)}
    return ", ".join(
        f"{k[:-4]}={v:.0f}%" if k.endswith("_pct") else f"{k}={v:.4g}" for k, v in shown.items()
    )


__all__ = ["EpochMixin", "summary"]
