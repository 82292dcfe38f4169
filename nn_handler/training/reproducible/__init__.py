"""The reproducible mode (TrainerConfig.reproducible): training whose every step is
bit-identical at any world size. docs/reproducible.md explains it; fixed_point.py holds the
arithmetic, norm_statistics.py the BatchNorm statistics, exact_step.py one optimizer step and
exact_means.py the validation means."""

from nn_handler.training.reproducible.exact_means import ExactMeans
from nn_handler.training.reproducible.exact_step import ExactStep

__all__ = ["ExactMeans", "ExactStep"]
