"""ReproducibleMode: the Trainer's part for TrainerConfig.reproducible. It refuses, before the
first step, what it cannot keep identical at any world size, and runs each step's micro-batches
through ExactStep (exact_step.py)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from nn_handler.checkpoint.registry import Part
from nn_handler.config.fault_tolerance import FaultToleranceConfig
from nn_handler.config.training import ReproducibleConfig
from nn_handler.data.fixed_batches import FixedBatchLoader, FixedEvalLoader, StepBatch
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import ConfigError
from nn_handler.strategies.exact_gradients import ExactGradients
from nn_handler.training.batch import is_scalar, move_to_device
from nn_handler.training.checkpointing import TrainerCheckpoints
from nn_handler.training.fault_tolerance.steps import FaultTolerantSteps
from nn_handler.training.metrics import StatefulMetric
from nn_handler.training.precision import Precision
from nn_handler.training.reproducible.exact_step import ExactStep
from nn_handler.training.reproducible.float_step import FloatStep
from nn_handler.training.step_output import loss_of

_LOADER_FIX = (
    "pass the dataset (NNHandler.train builds the mode's loaders) or build them with "
    "LoaderFactory.reproducible_train_loader / reproducible_eval_loader"
)


class ReproducibleMode:
    """One Trainer's reproducible mode over its plain ``module``."""

    def __init__(
        self,
        config: ReproducibleConfig,
        module: nn.Module,
        comm: Communicator,
        device: torch.device,
        precision: Precision,
        fault_tolerance: FaultToleranceConfig | None = None,
        non_blocking: bool = False,
    ) -> None:
        if precision.scaler is not None:
            raise ConfigError(
                "reproducible: fp16 with a dynamic GradScaler skips steps and rescales on "
                "overflows, which the mode cannot keep identical; use precision 'bf16' or '32'."
            )
        exact = config.reduction == "exact"
        if exact and device.type == "cuda" and not torch.are_deterministic_algorithms_enabled():
            raise ConfigError(
                "reproducible on CUDA needs deterministic kernels (some backward kernels sum "
                "with atomics, in a different order each run): call "
                "torch.use_deterministic_algorithms(True) and set "
                "CUBLAS_WORKSPACE_CONFIG=:4096:8 before building the handler."
            )
        self.config = config
        self.precision = precision
        self.device = device
        #: Micro-batches copied to the device asynchronously (TrainerConfig.non_blocking).
        self.non_blocking = non_blocking
        self.exact = (ExactStep if exact else FloatStep)(config, module, comm, device)
        #: The steps of a fault-tolerant run (TrainerConfig.fault_tolerance; None: off).
        self.fault_tolerance = (
            FaultTolerantSteps(fault_tolerance, self.exact, comm) if fault_tolerance else None
        )

    @classmethod
    def build(
        cls,
        config: ReproducibleConfig | None,
        module: nn.Module,
        comm: Communicator,
        device: torch.device,
        precision: Precision,
        automatic: bool,
        metrics: Mapping[str, Any],
        fault_tolerance: FaultToleranceConfig | None = None,
        gradients: Callable[[list[nn.Parameter]], ExactGradients] | None = None,
        non_blocking: bool = False,
    ) -> ReproducibleMode | None:
        """A Trainer's mode (None: ``config`` is None), its checks made now, before the first
        step; after ``configure_optimizers`` (the parameters that train). ``gradients``: the
        strategy's (Strategy.exact_gradients; default: replicated); ``non_blocking``: copy
        micro-batches to a GPU asynchronously (from pinned memory)."""
        if config is None:
            return None
        mode = cls(config, module, comm, device, precision, fault_tolerance, non_blocking)
        params = [p for p in module.parameters() if p.requires_grad]
        mode.adopt(params, automatic, metrics, gradients)
        return mode

    def adopt(
        self,
        params: list[nn.Parameter],
        automatic: bool,
        metrics: Mapping[str, Any],
        gradients: Callable[[list[nn.Parameter]], ExactGradients] | None = None,
    ) -> None:
        """After ``configure_optimizers``: the parameters that train; manual optimization and
        metrics that reduce themselves are refused."""
        if not automatic:
            raise ConfigError(
                "reproducible: manual optimization (automatic_optimization = False) is not "
                "supported: the mode runs the step's backward and reduction itself."
            )
        stateful = [name for name, metric in metrics.items() if isinstance(metric, StatefulMetric)]
        if stateful:
            raise ConfigError(
                f"reproducible: metrics {stateful} keep their own state and synchronise it "
                f"themselves (not exactly); pass functions of (outputs, targets) that return "
                f"per-batch means."
            )
        self.exact.adopt(params, gradients(params) if gradients is not None else None)

    @staticmethod
    def check_loaders(train: Iterable[Any], val: Iterable[Any] | None) -> None:
        """Before the first step: the loaders must be the mode's (fixed batches)."""
        if not isinstance(train, FixedBatchLoader):
            raise ConfigError(
                f"reproducible: the training loader is a {type(train).__name__}, whose batches "
                f"depend on the number of ranks; {_LOADER_FIX}."
            )
        if val is not None and not isinstance(val, FixedEvalLoader):
            raise ConfigError(
                f"reproducible: the validation loader is a {type(val).__name__}, whose batches "
                f"depend on the number of ranks; {_LOADER_FIX}."
            )

    def step(
        self, batch: Any, training_step: Callable[[Any], Any], global_step: int
    ) -> torch.Tensor:
        """The whole optimizer step's forward, backward and exact reduction (``.grad`` set on
        every rank alike); returns the step's loss. Every rank must call this."""
        if not isinstance(batch, StepBatch):
            raise ConfigError(
                f"reproducible: a training batch is a {type(batch).__name__}, not a StepBatch; "
                f"{_LOADER_FIX}."
            )

        def forward_backward(micro: Any) -> torch.Tensor:
            micro = move_to_device(micro, self.device, self.non_blocking)
            with self.precision.autocast():
                output = training_step(micro)
                loss = loss_of(output)
            if isinstance(output, Mapping):
                extra = sorted(k for k, v in output.items() if k != "loss" and is_scalar(v))
                if extra:
                    raise ConfigError(
                        f"reproducible: training_step returned {extra} besides the loss; the "
                        f"mode records the loss only (return the loss alone)."
                    )
            torch.autograd.backward(loss)
            return loss.detach()

        if self.fault_tolerance is None:
            return self.exact.run(batch, forward_backward, global_step)
        return self.fault_tolerance.step(
            batch, lambda mine: self.exact.run(mine, forward_backward, global_step), global_step
        )

    def begin_fit(self, global_step: int, checkpoints: TrainerCheckpoints) -> None:
        """A fit starts at ``global_step`` (after its own resume, if any): a fault-tolerant
        run's member joins the run there. Behind it, the member loads the checkpoint state of
        one that is not; when the run cannot go on, it saves an emergency checkpoint (with a
        folder). See FaultTolerantSteps.begin_fit."""
        if self.fault_tolerance is None:
            return
        source = "the state of a member of the run"
        self.fault_tolerance.begin_fit(
            global_step,
            checkpoints.state_dict,
            functools.partial(checkpoints.load, source=source, allow_world_size_change=True),
            functools.partial(checkpoints.save_periodic, final=True)
            if checkpoints.manager is not None
            else None,
            checkpoints.own_run,
            checkpoints.fingerprint(),
        )

    def end_fit(self) -> None:
        if self.fault_tolerance is not None:
            self.fault_tolerance.end_fit()

    def part(self) -> Part:
        """The fixed-point scales in checkpoints (the same on every rank)."""
        return Part(
            "reproducible", self.exact.state_dict, self.exact.load_state_dict, missing="ignore"
        )

    @property
    def bytes_per_step(self) -> int:
        return self.exact.bytes_per_step


__all__ = ["ReproducibleMode"]
