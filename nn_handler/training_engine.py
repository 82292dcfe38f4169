"""Seed 003's TrainingEngine workflow, as a thin adapter over the Trainer.

    from nn_handler.training_engine import (
        TrainingEngine, launch_distributed_training, distributed_train_worker)

``TrainingEngine(model, device, distributed=..., local_rank=..., world_size=..., use_amp=...,
use_ema=..., ema_decay=..., experiment_name=...)`` trains with ``engine.train(train_loader,
val_loader, optimizer, criterion, scheduler, num_epochs, save_best, save_last)``; everything
else (DDP, SyncBatchNorm, AMP, EMA, exact metrics, rank-0 logging, atomic checkpoints in
``checkpoints/<experiment_name>/``) is the Trainer's. ``distributed_train_worker`` is the
per-rank workflow ``launch_distributed_training`` runs; if the process group cannot be set up
it trains in a single process and logs a warning, as the seed documents.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger
from torch import nn
from torch.utils.data import DataLoader, Dataset

from nn_handler.config import (
    CheckpointConfig,
    DistributedConfig,
    EmaConfig,
    LoaderConfig,
    PrecisionConfig,
    TrainerConfig,
)
from nn_handler.data.factory import LoaderFactory
from nn_handler.distributed.communicator import Communicator, NullCommunicator, TorchCommunicator
from nn_handler.distributed.device import resolve_device
from nn_handler.distributed.env import DistributedInfo, parse_distributed_env
from nn_handler.distributed.launcher import launch_distributed_training
from nn_handler.distributed.lifecycle import init_dist, shutdown_dist
from nn_handler.errors import ConfigError, DistributedError
from nn_handler.training.history import History
from nn_handler.training.trainer import Trainer


class TrainingEngine:
    """Seed 003's engine: one model on one device, trained by ``train``.

    With ``distributed=True`` the default process group must exist (call
    ``setup_distributed`` first, or run under ``launch_distributed_training`` / torchrun);
    the model is wrapped in DDP with synchronised BatchNorm. ``use_amp`` is fp16 with a
    GradScaler on CUDA and bf16 elsewhere; ``use_ema`` keeps an EMA of the weights (validation
    uses it), warmed up (``min(decay, (1 + n) / (10 + n))``) unless ``ema_warmup=False`` gives
    the seed's plain ``decay`` from the first step. Checkpoints go to
    ``checkpoint_dir/experiment_name``.
    """

    def __init__(
        self,
        model: nn.Module,
        device: torch.device | str | None = None,
        distributed: bool = False,
        local_rank: int = 0,
        world_size: int = 1,
        backend: str = "auto",
        use_amp: bool = False,
        use_ema: bool = False,
        ema_decay: float = 0.9999,
        experiment_name: str = "experiment",
        ema_warmup: bool = True,
        checkpoint_dir: str | Path = "checkpoints",
        progress_bar: bool = True,
    ) -> None:
        if distributed and not (dist.is_available() and dist.is_initialized()):
            raise DistributedError(
                "TrainingEngine(distributed=True) needs the process group: call "
                "TrainingEngine.setup_distributed(rank, world_size) in every process first "
                "(launch_distributed_training and torchrun scripts using it do)."
            )
        self.model = model
        self.device = (
            torch.device(device) if device is not None else resolve_device("auto", local_rank)
        )
        self.distributed = distributed
        self.local_rank = local_rank
        self.world_size = dist.get_world_size() if distributed else world_size
        self.backend = backend
        self.use_amp = use_amp
        self.use_ema = use_ema
        self.ema_decay = ema_decay
        self.ema_warmup = ema_warmup
        self.experiment_name = experiment_name
        self.checkpoint_dir = Path(checkpoint_dir) / experiment_name
        self.progress_bar = progress_bar
        self.comm: Communicator = TorchCommunicator() if distributed else NullCommunicator()
        self.is_main_process = self.comm.rank == 0
        self.trainer: Trainer | None = None

    # ----------------------------------------------------------------- process group
    @staticmethod
    def setup_distributed(rank: int, world_size: int, backend: str = "auto") -> None:
        """Join the default process group as ``rank`` of ``world_size`` (MASTER_ADDR and
        MASTER_PORT, or 127.0.0.1:29500). A no-op when it already exists."""
        init_dist(backend, rank=rank, world_size=world_size)

    @staticmethod
    def cleanup_distributed() -> None:
        """Leave and destroy the default process group, if any."""
        shutdown_dist()

    # ----------------------------------------------------------------- training
    def train(
        self,
        train_loader: DataLoader[Any],
        val_loader: DataLoader[Any] | None,
        optimizer: torch.optim.Optimizer,
        criterion: Callable[..., torch.Tensor],
        scheduler: Any = None,
        num_epochs: int = 10,
        save_best: bool = False,
        save_last: bool = False,
    ) -> History:
        """Train for ``num_epochs`` and return the History (per-epoch train loss, validation
        loss, learning rate the same on every rank; timings each rank's own). ``save_best`` keeps
        ``best.pt`` by validation loss, ``save_last`` a checkpoint after every epoch, in
        ``checkpoint_dir/experiment_name``. Every rank must call this."""
        if save_best and val_loader is None:
            raise ConfigError("save_best=True needs a val_loader (it watches val_loss).")
        saving = save_best or save_last
        checkpoint = CheckpointConfig(
            dir=str(self.checkpoint_dir) if saving else None,
            save_last=save_last,
            every_n_epochs=1 if save_last else None,
            save_best=save_best,
            monitor="val_loss",
            resume="never",
        )
        self.trainer = Trainer(
            self.model,
            optimizer,
            criterion,
            scheduler,
            config=TrainerConfig(
                epochs=num_epochs,
                sync_batchnorm=self.distributed,
                progress_bar=self.progress_bar,
            ),
            precision=PrecisionConfig(precision="amp" if self.use_amp else "32"),
            ema=EmaConfig(enabled=self.use_ema, decay=self.ema_decay, warmup=self.ema_warmup),
            communicator=self.comm,
            device=self.device,
            checkpoint=checkpoint,
        )
        return self.trainer.fit(train_loader, val_loader, num_epochs)

    def _reduce_tensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """The mean of ``tensor`` over ranks (itself in one process). Every rank must call
        this."""
        return self.comm.all_reduce(tensor, op="mean")


def distributed_train_worker(
    rank: int,
    world_size: int,
    *,
    model_fn: Callable[[], nn.Module],
    train_dataset: Dataset[Any],
    val_dataset: Dataset[Any] | None = None,
    batch_size: int = 32,
    num_workers: int = 0,
    optimizer_fn: Callable[[Any], torch.optim.Optimizer],
    criterion_fn: Callable[[], Callable[..., torch.Tensor]],
    scheduler_fn: Callable[[torch.optim.Optimizer], Any] | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    train_kwargs: Mapping[str, Any] | None = None,
    backend: str = "auto",
) -> History:
    """Seed 003's per-rank workflow: join the group, build the model, loaders (per-rank
    ``batch_size``, DistributedSampler), optimizer, criterion and scheduler, train with a
    TrainingEngine, leave the group. Returns the History.

    When the group cannot be set up, training falls back to a single process, as seed 003
    documents, with a warning: rank 0 trains alone and every other rank returns an empty
    History without training (N processes each training "as rank 0" would write one
    checkpoint folder at once). Under torchrun or SLURM there is no fallback: the
    DistributedError is raised, and the launcher reports it.
    """
    distributed = world_size > 1
    owns_group = False
    if distributed:
        existed = dist.is_available() and dist.is_initialized()
        try:
            TrainingEngine.setup_distributed(rank, world_size, backend)
            owns_group = not existed
        except (DistributedError, ConfigError, RuntimeError) as error:
            launcher = parse_distributed_env(os.environ).launcher
            if launcher in ("torchrun", "slurm", "kubeflow", "skypilot"):
                raise DistributedError(
                    f"rank {rank}: distributed setup failed under {launcher} ({error}); not "
                    f"falling back to a single process, which would train {world_size} "
                    f"independent copies."
                ) from error
            if rank != 0:
                logger.bind(rank=rank).warning(
                    "distributed setup failed ({}); rank 0 trains in a single process, this "
                    "rank {} does not train",
                    error,
                    rank,
                )
                return History()
            logger.bind(rank=rank).warning(
                "distributed setup failed ({}); training in a single process instead", error
            )
            distributed, rank, world_size = False, 0, 1
    try:
        local_rank = int(os.environ.get("LOCAL_RANK", rank)) if distributed else 0
        info = DistributedInfo(
            rank=rank,
            world_size=world_size,
            local_rank=local_rank,
            local_world_size=world_size,
            launcher="manual" if distributed else "single",
        )
        device = resolve_device(DistributedConfig().device, info.local_rank)
        loaders = LoaderFactory(
            LoaderConfig(batch_size=batch_size, num_workers=num_workers), info, device
        )
        model = model_fn()
        optimizer = optimizer_fn(model.parameters())
        scheduler = scheduler_fn(optimizer) if scheduler_fn is not None else None
        engine = TrainingEngine(
            model,
            device,
            distributed=distributed,
            local_rank=local_rank,
            world_size=world_size,
            **dict(engine_kwargs or {}),
        )
        train_loader = loaders.train_loader(train_dataset)
        val_loader = loaders.eval_loader(val_dataset) if val_dataset is not None else None
        history = engine.train(
            train_loader,
            val_loader,
            optimizer,
            criterion_fn(),
            scheduler,
            **dict(train_kwargs or {}),
        )
        if engine.trainer is not None:
            engine.trainer.release_wrappers()
        return history
    finally:
        if owns_group:
            TrainingEngine.cleanup_distributed()


__all__ = ["TrainingEngine", "distributed_train_worker", "launch_distributed_training"]
