"""ReproducibleMode: the Trainer's step mode for TrainerConfig.reproducible. It refuses, before
the first step, what it cannot keep identical at any world size, and runs each step's
micro-batches through ExactStep (exact_step.py) or FloatStep. A fault-tolerant member wraps it
(training/fault_tolerance/mode.py); it knows nothing of that."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from nn_handler.checkpoint.registry import Part
from nn_handler.config.training import ReproducibleConfig
from nn_handler.data.fixed_batches import FixedBatchLoader, FixedEvalLoader, StepBatch
from nn_handler.distributed.communicator import Communicator, NullCommunicator
from nn_handler.errors import ConfigError
from nn_handler.strategies.exact_gradients import ExactGradients
from nn_handler.training.batch import is_scalar, move_to_device
from nn_handler.training.metrics import StatefulMetric
from nn_handler.training.modes.base import StepMode, TrainingStep
from nn_handler.training.precision import Precision
from nn_handler.training.reproducible.exact_step import ExactStep
from nn_handler.training.reproducible.float_step import FloatStep
from nn_handler.training.step_output import loss_of

_LOADER_FIX = (
    "pass the dataset (NNHandler.train builds the mode's loaders) or build them with "
    "LoaderFactory.reproducible_train_loader / reproducible_eval_loader"
)


class ReproducibleMode(StepMode):
    """One Trainer's reproducible mode over its plain ``module``."""

    whole_steps = True

    def __init__(
        self,
        config: ReproducibleConfig,
        module: nn.Module,
        comm: Communicator,
        device: torch.device,
        precision: Precision,
        non_blocking: bool = False,
    ) -> None:
        super().__init__(comm)
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

    @classmethod
    def build(
        cls,
        config: ReproducibleConfig,
        module: nn.Module,
        comm: Communicator,
        device: torch.device,
        precision: Precision,
        automatic: bool,
        metrics: Mapping[str, Any],
        gradients: Callable[[list[nn.Parameter]], ExactGradients] | None = None,
        non_blocking: bool = False,
    ) -> ReproducibleMode:
        """A Trainer's mode, its checks made now, before the first step; after
        ``configure_optimizers`` (the parameters that train). ``gradients``: the strategy's
        (Strategy.exact_gradients; default: replicated); ``non_blocking``: copy micro-batches
        to a GPU asynchronously (from pinned memory)."""
        mode = cls(config, module, comm, device, precision, non_blocking)
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

    def check(self, train: Iterable[Any], val: Sequence[Iterable[Any]]) -> None:
        """Before the first step: the loaders must be the mode's (fixed batches), every
        validation set's too."""
        if not isinstance(train, FixedBatchLoader):
            raise ConfigError(
                f"reproducible: the training loader is a {type(train).__name__}, whose batches "
                f"depend on the number of ranks; {_LOADER_FIX}."
            )
        for loader in val:
            if not isinstance(loader, FixedEvalLoader):
                raise ConfigError(
                    f"reproducible: a validation loader is a {type(loader).__name__}, whose "
                    f"batches depend on the number of ranks; {_LOADER_FIX}."
                )

    def step(self, batch: Any, training_step: TrainingStep, global_step: int) -> torch.Tensor:
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

        return self.exact.run(batch, forward_backward, global_step)

    def first_inputs(self, batch: Any) -> Any:
        """The step's first micro-batch (the memory plan's activations)."""
        micro = getattr(batch, "micro", ())
        return micro[0].batch if micro else batch

    def parts(self) -> list[Part]:
        """The fixed-point scales in checkpoints (the same on every rank)."""
        state = self.exact
        return [Part("reproducible", state.state_dict, state.load_state_dict, missing="ignore")]

    def record_comm(self) -> Communicator:
        """None to average over: every rank trained the whole step, with the same loss."""
        return NullCommunicator()

    @property
    def bytes_per_step(self) -> int:
        return self.exact.bytes_per_step


__all__ = ["ReproducibleMode"]
