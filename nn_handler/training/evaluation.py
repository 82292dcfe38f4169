"""Evaluator: the Trainer's part for validation, metrics and prediction, exact over ranks
(every sample once). The per-batch steps are the Trainer's (``validation_step``,
``predict_step``), passed in by the call."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nn_handler.config.training import TrainerConfig
from nn_handler.data.exact import gather_in_dataset_order
from nn_handler.data.fixed_batches import FixedEvalLoader
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError
from nn_handler.strategies import Strategy
from nn_handler.training.batch import batch_size_of, loader_length, move_to_device
from nn_handler.training.hooks import HookList
from nn_handler.training.limits import limited
from nn_handler.training.metrics import MetricFn, StatefulMetric, compute_stateful
from nn_handler.training.optimization import Optimization
from nn_handler.training.precision import Precision
from nn_handler.training.reproducible.exact_means import ExactMeans
from nn_handler.training.sharded_ema import ShardedEma
from nn_handler.training.validation_sets import named
from nn_handler.training.weighted_means import MetricKeys, WeightedMeans

Metric = MetricFn | StatefulMetric


class Evaluator:
    """Evaluation and prediction of one Trainer: its metrics, the exact reduction of their
    means over ranks (every sample once) and the loop both share.

    ``activate(module)`` tells the Trainer which module its ``forward`` runs while evaluating
    (``activate(None)``: the training model again); the EMA is ``optimization``'s.

    Attributes:
        metrics: the ``metrics=`` given to the Trainer, by name.
    """

    def __init__(
        self,
        config: TrainerConfig,
        strategy: Strategy,
        optimization: Optimization,
        hooks: HookList,
        metrics: Mapping[str, Metric] | None,
        activate: Callable[[nn.Module | None], None],
    ) -> None:
        if strategy.module is None:
            raise ConfigError("the Evaluator needs a strategy whose setup(model) has run.")
        self.config = config
        self.comm: Communicator = strategy.comm
        self.device = device = strategy.device
        self.strategy = strategy
        self.precision: Precision = optimization.precision
        self.hooks = hooks
        self.module: nn.Module = strategy.module
        self._optimization = optimization  # its EMA, once configure_optimizers has run
        self.metrics: dict[str, Metric] = dict(metrics or {})
        self._stateful = {k: m for k, m in self.metrics.items() if isinstance(m, StatefulMetric)}
        for metric in self._stateful.values():
            if isinstance(metric, nn.Module):
                metric.to(device)
        self._activate = activate
        self._metric_updates = 0
        # The key sets of the last reductions, the same on every rank (one all_reduce each).
        self._keys = MetricKeys("validation metric")
        self._non_blocking = config.non_blocking and device.type == "cuda"

    def update_metrics(self, outputs: Any, targets: Any) -> dict[str, torch.Tensor | float]:
        """Feed one validation batch to the metrics: stateful (torchmetrics) metrics are
        updated, and the metric functions' values are returned."""
        self._metric_updates += 1
        values: dict[str, torch.Tensor | float] = {}
        stateful = self._stateful  # sorted out once: an isinstance of a Protocol costs ~15 us
        for name, metric in self.metrics.items():
            if stateful.get(name) is metric:
                stateful[name].update(outputs, targets)
            else:
                values[name] = metric(outputs, targets)  # type: ignore[operator]
        return values

    @torch.no_grad()
    def evaluate(
        self,
        loader: Iterable[Any],
        use_ema: bool | None,
        validation_step: Callable[[Any], Mapping[str, torch.Tensor | float]],
        name: str | None = None,
    ) -> tuple[dict[str, float], Exception | None]:
        """Exact metrics over ``loader``, the same on every rank (one all_reduce carries them
        and the agreement on a failed validation step), then the after_validation hooks: what
        they raised on this rank is returned, for the caller to agree on. ``name``: the
        validation set's, when there are several (``loss/<name>``: validation_sets.py). Every
        rank must call this."""
        means: WeightedMeans | ExactMeans = WeightedMeans()
        if isinstance(loader, FixedEvalLoader):  # the reproducible mode's fixed batches
            means = ExactMeans(loader.batch_ids, loader.total_batches)
        limit = self.config.fast_dev_run or self.config.limit_val_batches
        count = limited(loader_length(loader), limit)
        self._metric_updates = 0

        def validate(batch: Any) -> None:
            means.update(validation_step(batch), batch_size_of(batch))

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
        reduced = means if error is None else _emptied(means)
        failed = [float(error is not None)]
        results, (failures,) = reduced.reduce(self.comm, self.device, self._keys, failed)
        if failures:
            self.comm.raise_if_any_failed(error, "the validation loop")
        for key, metric in self._stateful.items():
            results[key] = compute_stateful(metric)
            metric.reset()
        results = named(results, name)
        try:
            self.hooks.call("after_validation", results)
        except Exception as error:
            return results, error
        return results, None

    @torch.no_grad()
    def sanity_check(
        self,
        loaders: Sequence[Iterable[Any]],
        validation_step: Callable[[Any], Mapping[str, torch.Tensor | float]],
    ) -> None:
        """Lightning's sanity check (trainer.num_sanity_val_steps): that many batches of each
        validation set before training, so a broken validation fails in seconds, on every
        rank, not after an epoch. Nothing is recorded or told to hooks; the random generators
        and the metrics' states are left as they were. Every rank must call this."""
        batches = self.config.num_sanity_val_steps
        if batches == 0 or not loaders:
            return
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            for loader in loaders:
                count = None if batches < 0 else batches
                error = self._eval_pass(loader, None, count, validation_step)
                self.comm.raise_if_any_failed(error, "the validation sanity check")
        for metric in self._stateful.values():
            metric.reset()

    @torch.no_grad()
    def predict(
        self,
        loader: Iterable[Any],
        use_ema: bool | None,
        predict_step: Callable[[Any], torch.Tensor],
    ) -> torch.Tensor:
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
            outputs.append(predict_step(batch).float())

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
        per_batch: Callable[[Any], object],
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
            self._activate(module)
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
                self._activate(None)
                module.train(was_training)
        return error

    @contextlib.contextmanager
    def _eval_weights(self, use_ema: bool | None) -> Iterator[nn.Module]:
        """The module to evaluate: the plain module, or its EMA (a copy, or for a sharded
        model the averaged shards swapped in for the duration)."""
        averaged = self._optimization.ema
        if use_ema is None:
            use_ema = averaged is not None and averaged.config.validate_with_ema
        if use_ema and averaged is None:
            raise ConfigError("use_ema=True but EMA is off: set EmaConfig(enabled=True).")
        ema = averaged if use_ema else None
        if isinstance(ema, ShardedEma):
            with ema.applied() as module:
                yield module
        else:
            # The plain module, never the DDP wrapper: ranks may see different batch counts.
            yield ema.module if ema is not None else self.module


def _emptied(means: WeightedMeans | ExactMeans) -> WeightedMeans | ExactMeans:
    """The same kind of means without this rank's values (what a failed rank reduces)."""
    if isinstance(means, ExactMeans):
        return ExactMeans(means.batch_ids, means.total_batches)
    return WeightedMeans()


__all__ = ["Evaluator", "Metric"]
