"""TrainerFacade: the Trainer's one base class, its public surface over its parts.

It holds no state and no behaviour of its own: every method reads or calls a public attribute
of one of the parts the Trainer builds (``optimization``, ``evaluator``, ``checkpointing``,
``comm``), so the names users know from Lightning (``optimizer``, ``global_rank``,
``save_checkpoint``, ``resume``...) stay short to reach, and trainer.py stays the loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from nn_handler.checkpoint.registry import Stateful
from nn_handler.config.training import TrainerConfig
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError
from nn_handler.strategies import Strategy
from nn_handler.training.checkpointing import TrainerCheckpoints
from nn_handler.training.early_stopping import EarlyStopping
from nn_handler.training.ema import ModelEma
from nn_handler.training.evaluation import Evaluator, Metric
from nn_handler.training.history import History
from nn_handler.training.hooks import HookList
from nn_handler.training.optimization import Optimization
from nn_handler.training.position import LoopPosition
from nn_handler.training.precision import Precision
from nn_handler.training.run_settings import hyperparameters_of
from nn_handler.training.schedules import estimated_steps
from nn_handler.training.sharded_ema import ShardedEma
from nn_handler.training.state import TrainerState
from nn_handler.training.step_output import scalar_value

if TYPE_CHECKING:
    from nn_handler.training.memory_planning import MemoryPlanner
    from nn_handler.training.modes.base import StepMode


class TrainerFacade:
    """Views and delegations over the Trainer's parts. The Trainer's own attributes, set by
    ``Trainer.__init__`` and read-only after it (docs/training.md describes each):"""

    config: TrainerConfig
    comm: Communicator
    device: torch.device
    loss_fn: Callable[..., torch.Tensor] | None
    log: Any
    strategy: Strategy
    module: nn.Module
    model: nn.Module
    precision: Precision
    history: History
    state: TrainerState
    position: LoopPosition
    early_stopping: EarlyStopping | None
    hooks: HookList
    optimization: Optimization
    evaluator: Evaluator
    checkpointing: TrainerCheckpoints
    memory: MemoryPlanner
    mode: StepMode
    training_failed: bool
    epoch_notes: list[str]

    def __setattr__(self, name: str, value: Any) -> None:
        if name in OWN_ATTRIBUTES and name in self.__dict__:
            raise ConfigError(
                f"{type(self).__name__}.{name} is the Trainer's own attribute (docs/training.md "
                f"lists them); assigning it would change what the loop uses. Give your "
                f"attribute another name."
            )
        object.__setattr__(self, name, value)

    # ----------------------------------------------------------------- views
    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The (first) optimizer."""
        return self.optimization.optimizer

    @property
    def scheduler(self) -> Any:
        """The (first) LR scheduler."""
        return self.optimization.scheduler

    @property
    def ema(self) -> ModelEma | ShardedEma | None:
        return self.optimization.ema

    @property
    def metrics(self) -> dict[str, Metric]:
        return self.evaluator.metrics

    @property
    def is_main_process(self) -> bool:
        return self.comm.rank == 0

    @property
    def is_reporting_process(self) -> bool:
        """Whether this process writes the run's experiment trackers: rank 0; in a
        fault-tolerant run, the first member of the last step agreed on (when it is lost,
        the next member takes over, continuing the same tracker run: ``run_key``)."""
        return self.mode.reporting.writes

    @property
    def run_key(self) -> str | None:
        """The name by which every process that may write this run's trackers knows it: in a
        fault-tolerant run, the run id its members agreed on (a tracker finds its run by it);
        None otherwise (rank 0 alone writes, and keeps its run in its checkpoints)."""
        return self.mode.reporting.run_key

    @property
    def global_rank(self) -> int:
        """This process's rank in the whole run (Lightning's name)."""
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    def update_metrics(self, outputs: Any, targets: Any) -> dict[str, torch.Tensor | float]:
        """Feed a batch to ``metrics=``; returns the values to merge into validation_step's."""
        return self.evaluator.update_metrics(outputs, targets)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Every optimizer, in the order ``configure_optimizers`` returned them."""
        return list(self.optimization.optimizers)

    def lr_schedulers(self) -> list[Any]:
        """Every LR scheduler, in the order ``configure_optimizers`` returned them."""
        return list(self.optimization.schedulers)

    def hyperparameters(self) -> dict[str, Any]:
        """The run's settings as flat ``section.field`` keys with plain values (what the
        experiment trackers log once; training/run_settings.py)."""
        resolved = {
            "precision": self.precision.name,
            "world_size": self.comm.world_size,
            "strategy": self.strategy.name,
            "ema": self.ema is not None,
        }
        params = hyperparameters_of(self.checkpointing.run_config, resolved, self.optimizer)
        if self.state.epochs:  # the epochs this fit trains to (train(..., epochs=3)), once set
            params["trainer.epochs"] = self.state.epochs
        return params

    def estimated_stepping_batches(self, loader: Iterable[Any], epochs: int | None = None) -> int:
        """The optimizer steps ``fit(loader, epochs=epochs)`` will have taken in total when it
        ends (steps done included; limits, accumulation and max_steps applied)."""
        done = self.position.epoch_batches_done
        return estimated_steps(self.config, self.state, loader, epochs, done)

    def log_metrics(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Write scalars to every experiment tracker now, at ``step`` (default: the optimizer
        steps done), like Accelerate's ``accelerator.log``: from ``training_step``, a hook,
        anywhere, as often as you call it. The values are this rank's own, written by rank 0
        (reduce them first with ``self.comm``, on every rank, for a mean over ranks); on the
        other ranks the call does nothing (no host sync there). Values: numbers or
        one-element tensors."""
        if not self.is_reporting_process:
            return
        values = {str(key): scalar_value(key, value) for key, value in metrics.items()}
        done = self.state.global_step if step is None else step
        self.hooks.call("after_log", values, done)

    # ----------------------------------------------------------------- checkpoints
    def track(self, name: str, obj: Stateful) -> None:
        """Keep ``obj`` (anything with ``state_dict()`` and ``load_state_dict(state)``) in
        every checkpoint under ``name``: each rank's own state is saved and restored on that
        rank (after a change of world size every rank takes rank 0's). Call it on every rank
        before ``fit`` or ``resume``: in ``configure_optimizers``, a subclass's ``__init__``
        or right after building the handler. Hooks with ``state_dict``/``load_state_dict``
        are tracked by themselves, as ``hook.<ClassName>``."""
        self.checkpointing.track(name, obj)

    @property
    def tracked(self) -> dict[str, Stateful]:
        """The user's own checkpointed state, by name (see ``track``)."""
        return self.checkpointing.tracked

    def state_dict(self) -> dict[str, Any] | None:
        """The full checkpoint (see training/checkpointing.py) on rank 0, None on the other
        ranks. Every rank must call this (it gathers every rank's RNG state)."""
        return self.checkpointing.state_dict()

    def load_state_dict(
        self,
        checkpoint: Mapping[str, Any],
        source: str = "checkpoint",
        allow_world_size_change: bool | None = None,
    ) -> None:
        """Restore a checkpoint from ``state_dict``; the next ``fit`` continues exactly where
        it was written. Every rank must call this with the same one."""
        self.checkpointing.load(checkpoint, source, allow_world_size_change)

    def save_checkpoint(self, path: str | Path, budget_s: float | None = None) -> Path:
        """Write the full checkpoint to ``path`` atomically (a folder when sharded). Every rank
        must call this; all raise CheckpointError if the write failed."""
        return self.checkpointing.save(path, budget_s)

    def save_periodic(self, budget_s: float | None = None) -> Path:
        """Write the periodic checkpoint of the current position (named by epoch and step) and
        point latest.json at it. Every rank must call this."""
        return self.checkpointing.save_periodic(budget_s)

    def resume(
        self,
        path: str | Path = "latest",
        *,
        allow_world_size_change: bool | None = None,
        missing_ok: bool = False,
    ) -> Path | None:
        """Load a checkpoint so that the next ``fit`` continues the run exactly: a checkpoint
        file or sharded folder, a folder of checkpoints, or "latest" (the newest complete one
        in CheckpointConfig.dir; a damaged one falls back to the previous). Returns the path,
        or None when ``missing_ok`` and there is none. Every rank must call this; a failure
        on any rank raises CheckpointError on every rank."""
        return self.checkpointing.resume(path, allow_world_size_change, missing_ok)


#: The Trainer's own parts: assigning one after construction is a ConfigError (a subclass's
#: ``self.state = ...`` would silently change what the loop reads). ``training_failed`` is
#: a flag the loop sets itself.
OWN_ATTRIBUTES = frozenset(TrainerFacade.__annotations__) - {"training_failed"}


def refuse_taken_names(trainer: object) -> None:
    """A subclass that set one of the Trainer's own attributes before ``Trainer.__init__``
    would see it replaced without a word: a ConfigError instead."""
    taken = sorted(OWN_ATTRIBUTES & vars(trainer).keys())
    if taken:
        raise ConfigError(
            f"{type(trainer).__name__} set {', '.join(taken)} before Trainer.__init__: the "
            f"Trainer's own attributes (docs/training.md lists them); use other names."
        )


__all__ = ["OWN_ATTRIBUTES", "TrainerFacade", "refuse_taken_names"]
