"""Evaluation and prediction: the Trainer's validation loop, metrics and predict, exact over
ranks (every sample once). Mixed into Trainer; override ``validation_step`` /
``predict_step`` there."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from nn_handler.data.exact import gather_in_dataset_order
from nn_handler.errors import ConfigError
from nn_handler.training.batch import batch_size_of, loader_length, move_to_device
from nn_handler.training.limits import limited
from nn_handler.training.metrics import MetricFn, StatefulMetric, compute_stateful
from nn_handler.training.parts import TrainerParts
from nn_handler.training.sharded_ema import ShardedEma
from nn_handler.training.weighted_means import MetricKeys, WeightedMeans

Metric = MetricFn | StatefulMetric


class EvaluationMixin(TrainerParts):
    """``evaluate``, ``predict`` and the per-batch ``validation_step`` / ``predict_step``."""

    metrics: dict[str, Metric]
    _stateful: dict[str, StatefulMetric]
    _metric_updates: int
    _eval_keys: MetricKeys
    _non_blocking: bool
    _active: nn.Module

    def forward(self, inputs: Any) -> Any:
        raise NotImplementedError

    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        raise NotImplementedError

    def compute_loss(self, outputs: Any, targets: Any) -> torch.Tensor:
        raise NotImplementedError

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
        stateful = self._stateful  # sorted out once: an isinstance of a Protocol costs ~15 us
        for name, metric in self.metrics.items():
            if stateful.get(name) is metric:
                stateful[name].update(outputs, targets)
            else:
                values[name] = metric(outputs, targets)  # type: ignore[operator]
        return values

    def predict_step(self, batch: Any) -> torch.Tensor:
        """Per-sample outputs of one batch (dim 0 = samples); the default runs the model on
        the batch's inputs (its first element when it is a tuple or list)."""
        inputs = batch[0] if isinstance(batch, (list, tuple)) else batch
        output: torch.Tensor = self.forward(inputs)
        return output

    def evaluate(self, loader: Iterable[Any], use_ema: bool | None = None) -> dict[str, float]:
        """Exact metrics over ``loader`` (loss and configured metrics); every rank must call
        this and gets the same values. Uses the EMA weights when ``use_ema`` (default: the
        EmaConfig's validate_with_ema). A failure on any rank raises on every rank.

        The metrics and the agreement on failure travel in one all_reduce (plus one tiny
        all_gather for the after_validation hooks, and torchmetrics' own synchronisation)."""
        results, hooks_error = self._evaluate(loader, use_ema)
        self.comm.raise_if_any_failed(hooks_error, "after_validation hooks")
        return results

    @torch.no_grad()
    def _evaluate(
        self, loader: Iterable[Any], use_ema: bool | None
    ) -> tuple[dict[str, float], Exception | None]:
        """``evaluate`` but for the agreement on the after_validation hooks: returns what they
        raised on this rank (fit agrees on it with the after_epoch hooks, in one exchange)."""
        means = WeightedMeans()
        limit = self.config.fast_dev_run or self.config.limit_val_batches
        count = limited(loader_length(loader), limit)
        self._metric_updates = 0

        def validate(batch: Any) -> None:
            means.update(self.validation_step(batch), batch_size_of(batch))

        def finish(batches: int) -> None:
            if self.metrics and batches and not self._metric_updates:
                raise ConfigError(
                    f"validation_step is overridden and never called "
                    f"self.update_metrics(outputs, targets), so metrics "
                    f"{sorted(self.metrics)} saw none of the {batches} validation batches; "
                    f"call it in validation_step (the default does) and merge its result into "
                    f"what you return."
                )
            means.fold()  # a value that cannot be averaged fails here, inside the agreement

        error = self._eval_pass(loader, use_ema, count, validate, finish)
        if error is not None and self.comm.world_size == 1:
            raise error
        # A failed rank sends nothing of its own, so the reduction has one shape everywhere.
        reduced = means if error is None else WeightedMeans()
        failed = [float(error is not None)]
        results, (failures,) = reduced.reduce(self.comm, self.device, self._eval_keys, failed)
        if failures:
            self.comm.raise_if_any_failed(error, "the validation loop")
        for name, metric in self._stateful.items():
            results[name] = compute_stateful(metric)
            metric.reset()
        try:
            self.hooks.call("after_validation", results)
        except Exception as error:
            return results, error
        return results, None

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
        outputs: list[torch.Tensor] = []

        def collect(batch: Any) -> None:
            outputs.append(self.predict_step(batch).float())

        error = self._eval_pass(loader, use_ema, None, collect)
        self.comm.raise_if_any_failed(error, "the prediction loop")
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

    def _eval_pass(
        self,
        loader: Iterable[Any],
        use_ema: bool | None,
        count: int | None,
        per_batch: Callable[[Any], None],
        after: Callable[[int], None] | None = None,
    ) -> Exception | None:
        """The one loop evaluation and prediction share: the plain (or EMA) module in eval
        mode, ``per_batch(batch)`` under autocast for the first ``count`` batches (None: all),
        then ``after(batches seen)``. Returns what either raised on this rank (None: nothing);
        the caller agrees on it with every rank."""
        batches = loader if count is None else itertools.islice(loader, count)
        error: Exception | None = None
        with self._eval_weights(use_ema) as module:
            was_training = module.training
            module.eval()
            self._active = module
            try:
                with self.strategy.evaluation():  # every rank enters it (sharded models gather)
                    seen = 0
                    try:
                        for batch in batches:
                            batch = move_to_device(batch, self.device, self._non_blocking)
                            with self.precision.autocast():
                                per_batch(batch)
                            seen += 1
                        if after is not None:
                            after(seen)
                    except Exception as caught:
                        error = caught
            finally:
                self._active = self.model
                module.train(was_training)
        return error

    @contextlib.contextmanager
    def _eval_weights(self, use_ema: bool | None) -> Iterator[nn.Module]:
        """The module to evaluate: the plain module, or its EMA (a copy, or for a sharded
        model the averaged shards swapped in for the duration)."""
        if use_ema is None:
            use_ema = self.ema is not None and self.ema.config.validate_with_ema
        if use_ema and self.ema is None:
            raise ConfigError("use_ema=True but EMA is off: set EmaConfig(enabled=True).")
        ema = self.ema if use_ema else None
        if isinstance(ema, ShardedEma):
            with ema.applied() as module:
                yield module
        else:
            # The plain module, never the DDP wrapper: ranks may see different batch counts.
            yield ema.module if ema is not None else self.module


__all__ = ["EvaluationMixin", "Metric"]
