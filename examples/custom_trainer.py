"""Extend the Trainer by subclassing, and watch it with a custom hook.

    python examples/custom_trainer.py                       # one process
    torchrun --nproc-per-node=2 examples/custom_trainer.py  # two processes, same code

The model has two outputs (class scores and a reconstruction of its input); the subclass
trains on a weighted sum of both losses and returns each of them too, so the History logs
``train_classification`` and ``train_reconstruction`` (exact over ranks). Its validation_step
reports the reconstruction error and feeds ``metrics=`` (a torchmetrics F1 score) through
``self.update_metrics``. The hook prints the best validation accuracy so far on rank 0, and
its ``state_dict`` makes it part of every checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torchmetrics.classification import MulticlassF1Score

from nn_handler import Hook, NNHandler, Trainer, accuracy
from nn_handler.digits import digits_datasets


class ClassifyAndRebuild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU())
        self.classes = nn.Linear(128, 10)
        self.decoder = nn.Linear(128, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.encoder(x)
        return self.classes(hidden), self.decoder(hidden).view_as(x)


class TwoLossTrainer(Trainer):
    """Cross-entropy on the scores plus half the reconstruction error."""

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        images, labels = batch
        scores, rebuilt = self.forward(images)  # self.forward: the DDP model while training
        classification = nn.functional.cross_entropy(scores, labels)
        reconstruction = nn.functional.mse_loss(rebuilt, images)
        return {
            "loss": classification + 0.5 * reconstruction,
            "classification": classification.detach(),  # logged as train_classification
            "reconstruction": reconstruction.detach(),
        }

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        images, labels = batch
        scores, rebuilt = self.forward(images)  # the plain (or EMA) model while evaluating
        return {
            "loss": nn.functional.cross_entropy(scores, labels),
            "reconstruction": nn.functional.mse_loss(rebuilt, images),
            "accuracy": accuracy(scores, labels),
            **self.update_metrics(scores, labels),  # feeds metrics= (the F1 score below)
        }


class BestAccuracy(Hook):
    """Prints the best validation accuracy so far after every epoch, on rank 0."""

    def __init__(self) -> None:
        self.best = 0.0

    def after_validation(self, metrics: dict[str, float]) -> None:
        self.best = max(self.best, metrics["accuracy"])

    def state_dict(self) -> dict[str, float]:  # a hook with state: checkpointed by itself
        return {"best": self.best}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.best = state["best"]

    def after_epoch(self) -> None:
        if self.trainer.is_main_process:
            record = self.trainer.history.last
            print(
                f"epoch {record['epoch']:.0f}: val_accuracy={record['val_accuracy']:.3f} "
                f"val_f1={record['val_f1']:.3f} reconstruction={record['val_reconstruction']:.4f} "
                f"train_classification={record['train_classification']:.4f} best={self.best:.3f}"
            )


def main() -> None:
    torch.manual_seed(0)
    train, val = digits_datasets()
    with NNHandler(
        ClassifyAndRebuild(),
        optimizer=lambda params: torch.optim.Adam(params, lr=2e-3),
        config={"loader": {"batch_size": 32}, "trainer": {"epochs": 6, "progress_bar": False}},
        trainer_class=TwoLossTrainer,
        metrics={"f1": MulticlassF1Score(num_classes=10)},
        hooks=[BestAccuracy()],
    ) as handler:
        history = handler.train(train, val)
        if handler.is_main_process:
            print(f"final: val_accuracy={history.last['val_accuracy']:.3f}")


if __name__ == "__main__":
    main()
