"""NNHandler: builds the run's parts from one HandlerConfig and wires them; no training logic.

    handler = NNHandler(model, optimizer=lambda p: torch.optim.Adam(p, 1e-3),
                        loss_fn=nn.CrossEntropyLoss(), config=HandlerConfig(...))
    history = handler.train(train_dataset, val_dataset, epochs=10)

The same script runs in one process, under ``nn_handler.launch``, under torchrun and under
SLURM: the DistributedContext reads where this process stands from the environment.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from loguru import logger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from nn_handler.config import HandlerConfig
from nn_handler.data.factory import LoaderFactory
from nn_handler.distributed.communicator import Communicator
from nn_handler.distributed.context import DistributedContext
from nn_handler.distributed.env import DistributedInfo, parse_distributed_env
from nn_handler.errors import ConfigError, HandlerClosedError
from nn_handler.lr_finder import LRFinderResult, find_lr
from nn_handler.monitoring import ThroughputMonitor
from nn_handler.run_logging import add_log_sinks, observers, remove_log_sinks
from nn_handler.training.history import History
from nn_handler.training.hooks import Hook
from nn_handler.training.saved_run import open_saved, run_config_of, saved_handler_config
from nn_handler.training.trainer import Metric, OptimizerFactory, Trainer

ConfigLike = HandlerConfig | Mapping[str, Any] | str | Path | None


def as_handler_config(config: ConfigLike) -> HandlerConfig:
    """A HandlerConfig from an instance, a dict, or a JSON/YAML file path."""
    if config is None:
        return HandlerConfig()
    if isinstance(config, HandlerConfig):
        return config
    if isinstance(config, (str, Path)):
        return HandlerConfig.from_file(config)
    if isinstance(config, Mapping):
        return HandlerConfig.from_dict(config)
    raise ConfigError(
        f"config must be a HandlerConfig, a dict or a path to a JSON/YAML file, got "
        f"{type(config).__name__}."
    )


def world_view(context: DistributedContext, communicator: Communicator) -> DistributedInfo:
    """Where this process stands, as the communicator says: the one source the loaders, the
    strategy and the Trainer all read. A communicator of its own (a test double) may describe
    any world when the context is a single process; inside a real group it must agree with
    the group, or the loaders would shard for one world and the gradients average over another.
    """
    info = context.info
    rank, world_size = communicator.rank, communicator.world_size
    if (rank, world_size) == (info.rank, info.world_size):
        return info
    if info.world_size > 1:
        raise ConfigError(
            f"the communicator passed to NNHandler reports rank {rank} of world size "
            f"{world_size}, but this process is rank {info.rank} of a group of "
            f"{info.world_size}; pass a communicator over that group (or none)."
        )
    # An in-process double: every rank it describes lives on this machine.
    return dataclasses.replace(
        info, rank=rank, world_size=world_size, local_rank=rank, local_world_size=world_size
    )


class NNHandler:
    """One model's training run: a DistributedContext, a Communicator, a LoaderFactory and a
    Trainer, built from one config.

    Every rank constructs it the same way (construction joins the process group when the
    environment describes several processes) and calls ``train``/``evaluate``/``predict``
    alike. ``communicator`` replaces the context's (a test double, say); ``context`` is a
    DistributedContext to use (the caller then owns it). ``trainer_class`` is the Trainer
    subclass to use. Call ``close`` (or use ``with``) to leave the group.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        loss_fn: Any = None,
        scheduler: Any = None,
        config: ConfigLike = None,
        communicator: Communicator | None = None,
        *,
        metrics: Mapping[str, Metric] | None = None,
        hooks: Iterable[Hook] = (),
        trainer_class: type[Trainer] = Trainer,
        context: DistributedContext | None = None,
    ) -> None:
        self.config = as_handler_config(config)
        self._closed = False
        self._owns_context = context is None
        self.context = context or DistributedContext(self.config.distributed)
        self.context.setup()
        self._sinks: list[int] = []
        try:
            self._build(
                model, optimizer, loss_fn, scheduler, communicator, metrics, hooks, trainer_class
            )
        except BaseException:
            # Leave the group this constructor joined: nothing else holds it now.
            if self._owns_context:
                self.context.teardown()
            remove_log_sinks(self._sinks)
            raise

    def _build(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None,
        loss_fn: Any,
        scheduler: Any,
        communicator: Communicator | None,
        metrics: Mapping[str, Metric] | None,
        hooks: Iterable[Hook],
        trainer_class: type[Trainer],
    ) -> None:
        self.communicator = communicator or self.context.communicator
        info = world_view(self.context, self.communicator)
        member = self.config.trainer.fault_tolerance
        label = None if member is None else f"member {member.member_name()}"
        self._sinks = add_log_sinks(self.config.logging, info.rank, label)
        self.loaders = LoaderFactory(self.config.loader, info, self.context.device)
        given = list(hooks)
        hooks = [*given, *observers(self.config.logging, given)]
        #: The run's ThroughputMonitor (yours or the default one); None with monitor off.
        self.monitor: ThroughputMonitor | None = next(
            (hook for hook in hooks if isinstance(hook, ThroughputMonitor)), None
        )
        self.trainer = trainer_class(
            model,
            optimizer,
            loss_fn,
            scheduler,
            config=self.config.trainer,
            precision=self.config.precision,
            ema=self.config.ema,
            communicator=self.communicator,
            device=self.context.device,
            metrics=metrics,
            hooks=hooks,
            checkpoint=self.config.checkpoint,
        )
        # The trainer's settings as it resolved them (a run-length scheduler steps per step).
        self.config = self.config.model_copy(update={"trainer": self.trainer.config})
        self.trainer.checkpointing.run_config = run_config_of(self.config)

    # ----------------------------------------------------------------- parts
    @property
    def model(self) -> nn.Module:
        """The user's model (on the device, without DDP or compile wrappers)."""
        return self.trainer.module

    @property
    def device(self) -> torch.device:
        return self.context.device

    @property
    def history(self) -> History:
        return self.trainer.history

    @property
    def rank(self) -> int:
        return self.communicator.rank

    @property
    def world_size(self) -> int:
        return self.communicator.world_size

    @property
    def is_main_process(self) -> bool:
        return self.communicator.rank == 0

    @property
    def is_reporting_process(self) -> bool:
        """Whether this process is the one that writes the run's own files (a plot, a
        History, a summary): rank 0; in a fault-tolerant run, whose members are each rank 0
        of a group of their own, the first member of the last step agreed on (one member),
        as for the experiment trackers. ``if handler.is_reporting_process:`` writes once in
        every kind of run."""
        return bool(self.trainer.is_reporting_process)

    # ----------------------------------------------------------------- work
    def _train_loader(self, data: Any) -> Iterable[Any]:
        if isinstance(data, DataLoader):
            return data
        reproducible = self.config.trainer.reproducible
        if reproducible is not None:
            member = self.config.trainer.fault_tolerance is not None  # trains a share
            return self.loaders.reproducible_train_loader(
                _dataset(data), reproducible, None, member
            )
        return self.loaders.train_loader(_dataset(data))

    def _eval_loader(self, data: Any) -> Iterable[Any]:
        if isinstance(data, DataLoader):
            return data
        if self.config.trainer.reproducible is not None:
            return self.loaders.reproducible_eval_loader(_dataset(data))
        return self.loaders.eval_loader(_dataset(data))

    def _val_loaders(self, data: Any) -> Any:
        """None, one loader, or several validation sets: a dict of datasets or loaders by
        name, or a list of them (validation_sets.py names their metrics)."""
        if isinstance(data, Mapping):
            return {name: self._eval_loader(one) for name, one in data.items()}
        several = isinstance(data, (list, tuple)) and bool(data)
        if several and all(isinstance(one, (Dataset, DataLoader)) for one in data):
            return [self._eval_loader(one) for one in data]
        return None if data is None else self._eval_loader(data)

    def train(
        self,
        train_data: Any,
        val_data: Any = None,
        epochs: int | None = None,
        *,
        ckpt_path: str | Path | None = None,
    ) -> History:
        """Train on a dataset (loaders built by the LoaderFactory) or a ready DataLoader, until
        ``epochs`` epochs are complete in total (default: config.trainer.epochs); validate on
        ``val_data`` after each epoch (one set, or several: a dict by name or a list, each
        set's metrics recorded as ``val_<metric>/<name>``). ``ckpt_path`` (Lightning's):
        first ``resume`` it (a checkpoint, a folder of them, or "latest"; "last" is the
        same). Every rank must call this. Returns the History."""
        self._check_open("train")
        if ckpt_path is not None:
            self.resume("latest" if ckpt_path == "last" else ckpt_path)
        train_loader = self._train_loader(train_data)
        return self.trainer.fit(train_loader, self._val_loaders(val_data), epochs)

    def lr_find(
        self,
        train_data: Any,
        *,
        min_lr: float = 1e-8,
        max_lr: float = 1.0,
        num_training: int = 100,
        early_stop_threshold: float | None = 4.0,
    ) -> LRFinderResult:
        """Lightning's LR finder: ``num_training`` optimizer steps on ``train_data`` at rates
        growing from ``min_lr`` to ``max_lr``; returns the curve (``.suggestion()``,
        ``.plot(path)``), the same on every rank, with the model, the optimizer and the loop
        put back exactly as they were. Every rank must call this (nn_handler/lr_finder.py)."""
        self._check_open("lr_find")
        loader = self._train_loader(train_data)
        return find_lr(self.trainer, loader, min_lr, max_lr, num_training, early_stop_threshold)

    def estimated_stepping_batches(self, train_data: Any, epochs: int | None = None) -> int:
        """The optimizer steps ``train(train_data, epochs=epochs)`` takes in total (see
        ``Trainer.estimated_stepping_batches``). A scheduler factory of two arguments,
        ``lambda optimizer, total_steps: OneCycleLR(optimizer, 0.1, total_steps=total_steps)``,
        gets this number by itself when ``train`` starts."""
        return self.trainer.estimated_stepping_batches(self._train_loader(train_data), epochs)

    def evaluate(self, data: Any, use_ema: bool | None = None) -> dict[str, float]:
        """Exact loss and metrics over ``data`` (every sample once); the same on every rank.
        Every rank must call this."""
        self._check_open("evaluate")
        return self.trainer.evaluate(self._eval_loader(data), use_ema)

    def predict(self, data: Any, use_ema: bool | None = None) -> torch.Tensor:
        """Every sample's output in dataset order, on every rank. Every rank must call this."""
        self._check_open("predict")
        return self.trainer.predict(self._eval_loader(data), use_ema)

    # ----------------------------------------------------------------- checkpoints
    def save(self, path: str | Path) -> Path:
        """Write a full checkpoint (weights, optimizer, scheduler, scaler, EMA, history, config,
        data position, every rank's RNG) to ``path`` atomically; rank 0 writes (with sharded
        checkpoints ``path`` is a folder every rank writes its shards into). Every rank must
        call this."""
        self._check_open("save")
        return self.trainer.save_checkpoint(path)

    def resume(
        self, path: str | Path = "latest", *, allow_world_size_change: bool | None = None
    ) -> Path | None:
        """Load a checkpoint (a file, a folder or "latest" in config.checkpoint.dir) so that
        the next ``train`` continues the run exactly. ``allow_world_size_change`` defaults to
        config.checkpoint.allow_world_size_change. Every rank must call this."""
        self._check_open("resume")
        return self.trainer.resume(path, allow_world_size_change=allow_world_size_change)

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's weights and buffers with plain keys (Accelerate's
        ``get_state_dict``): under FSDP gathered to rank 0 on the CPU (every rank must call
        this; the other ranks get an empty dict), otherwise this rank's own model's."""
        self._check_open("full_state_dict")
        return self.trainer.strategy.module_state_dict(self.trainer.module)

    @classmethod
    def load(
        cls,
        path: str | Path,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        loss_fn: Any = None,
        scheduler: Any = None,
        config: ConfigLike = None,
        communicator: Communicator | None = None,
        **kwargs: Any,
    ) -> NNHandler:
        """A handler restored from a checkpoint file (or sharded checkpoint folder), on this
        machine's hardware.

        The config defaults to the checkpoint's own, without its checkpoint folder: a loaded
        handler writes (and rotates) checkpoints only where a ``config`` you pass points it,
        so the run that wrote ``path`` never loses a file to it. Weights (and EMA weights,
        history and position) always load; the optimizer and scheduler states load when you
        pass them. A GPU checkpoint loads on CPU and the other way round; another world size
        is allowed (the data is re-sharded; mid-epoch, the rest of the epoch visits each
        remaining sample once; a warning says so). Every rank must call this.
        """
        opened = open_saved(path)  # a folder of checkpoints: its newest
        if config is None:
            saved = saved_handler_config(opened, str(path), _alone(communicator))
            config = _without_checkpoint_dir(saved, path)
        handler = cls(model, optimizer, loss_fn, scheduler, config, communicator, **kwargs)
        try:
            checkpointing = handler.trainer.checkpointing
            checkpointing.load(
                opened.contents,
                opened.where,
                True,
                opened.folder,
                verified=opened.verified,
                for_inference=True,
            )
        except BaseException:
            handler.close()
            raise
        return handler

    # ----------------------------------------------------------------- lifecycle
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise HandlerClosedError(
                f"handler.{what}() was called on a closed NNHandler (closed by "
                f"handler.close() or at the end of its `with` block, which left the process "
                f"group and removed its log sinks). Call it inside the `with` block, or build "
                f"a new NNHandler."
            )

    def close(self) -> None:
        """Leave the process group this handler joined (not one of a context passed in) and
        remove its log sinks; the handler cannot train, evaluate or save after it. Idempotent;
        every rank must call it."""
        self._closed = True
        self.trainer.checkpointing.close()
        self.trainer.release_wrappers()
        if self._owns_context:
            self.context.teardown()
        remove_log_sinks(self._sinks)
        self._sinks = []

    def __enter__(self) -> NNHandler:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NNHandler({type(self.model).__name__}, rank={self.rank}/{self.world_size}, "
            f"device={self.device}, precision={self.trainer.precision.name!r})"
        )


def _alone(communicator: Communicator | None) -> bool:
    """Whether the handler about to be built runs in one process."""
    if communicator is not None:
        return communicator.world_size == 1
    return parse_distributed_env(os.environ).world_size == 1


def _without_checkpoint_dir(saved: Any, source: str | Path) -> ConfigLike:
    """The saved handler config with checkpointing off (its folder belongs to the run that
    wrote ``source``)."""
    if not isinstance(saved, Mapping):
        return None
    checkpoint = saved.get("checkpoint")
    if not isinstance(checkpoint, Mapping) or checkpoint.get("dir") is None:
        return saved
    logger.bind(rank=0).info(
        "NNHandler.load({}): checkpoints are off in the loaded handler (its saved folder {} "
        "belongs to the run that wrote it); pass config= with checkpoint.dir to save",
        source,
        checkpoint["dir"],
    )
    return {**saved, "checkpoint": {**checkpoint, "dir": None, "resume": "never"}}


def _dataset(data: Any) -> Dataset[Any]:
    if isinstance(data, Dataset):
        return data
    raise ConfigError(
        f"expected a torch Dataset or DataLoader, got {type(data).__name__}; wrap tensors in "
        f"torch.utils.data.TensorDataset."
    )


__all__ = ["ConfigLike", "NNHandler", "as_handler_config", "world_view"]
