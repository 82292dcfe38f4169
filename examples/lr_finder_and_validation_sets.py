"""Find a learning rate, then validate on two sets at once (what a Lightning user reaches for).

    python examples/lr_finder_and_validation_sets.py                       # one process
    torchrun --nproc-per-node=2 examples/lr_finder_and_validation_sets.py  # the same, 2 ranks

``handler.lr_find`` sweeps the rate of Adam from 1e-5 to 1 over 80 steps (one per rate, the
loss averaged over ranks), writes the curve to lr_find.png and suggests the rate where the
loss falls fastest; the model and optimizer are then exactly as before the sweep. Training at
that rate validates on the clean digits and on a noisy copy of them, each recorded by name
(``val_accuracy/clean``, ``val_accuracy/noisy``), and early stopping watches the noisy one.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import TensorDataset

from nn_handler import NNHandler, accuracy
from nn_handler.digits import digits_datasets


def noisy(data: TensorDataset, std: float = 0.3) -> TensorDataset:
    images, labels = data.tensors
    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(1)) * std
    return TensorDataset((images + noise).clamp(0, 1), labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--plot", default="lr_find.png")
    args = parser.parse_args()
    torch.manual_seed(0)
    train, val = digits_datasets()
    model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    trainer = {"epochs": 8, "progress_bar": False,
               "early_stopping": {"monitor": "val_loss/noisy", "patience": 3}}  # fmt: skip
    with NNHandler(
        model,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
        loss_fn=nn.CrossEntropyLoss(),
        config={"loader": {"batch_size": 32}, "trainer": trainer},
        metrics={"accuracy": accuracy},
    ) as handler:
        found = handler.lr_find(train, min_lr=1e-5, max_lr=1.0, num_training=80)
        rate = found.suggestion() or 1e-3
        if handler.is_main_process:
            found.plot(args.plot)
            print(f"lr_find: {len(found.lrs)} rates tried, suggested lr={rate:.3g}")
        optimizer = handler.trainer.optimizer
        assert optimizer is not None
        for group in optimizer.param_groups:
            group["lr"] = rate
        history = handler.train(train, {"clean": val, "noisy": noisy(val)})
        if handler.is_main_process:
            last = history.last
            print(
                f"final: val_accuracy/clean={last['val_accuracy/clean']:.3f} "
                f"val_accuracy/noisy={last['val_accuracy/noisy']:.3f}"
            )


if __name__ == "__main__":
    main()
