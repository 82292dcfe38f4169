"""Bit-identical training at any world size (TrainerConfig.reproducible): the digits CNN with
BatchNorm, trained on 1, 2, 3 or 4 processes, ends with the same weights, optimizer state and
History, to the last bit. The script prints the validation accuracy and a SHA-256 of the final
state; run it with several world sizes and compare:

    python examples/reproducible_training.py
    torchrun --nproc-per-node 2 examples/reproducible_training.py
    torchrun --nproc-per-node 3 examples/reproducible_training.py

Each optimizer step takes the same 64 samples, cut into 4 micro-batches of 16, whatever the
number of ranks (docs/reproducible.md). What must match between the runs: the device type, the
dtype, the threads per process (one here), and the torch version.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from nn_handler import NNHandler, accuracy
from nn_handler.digits import DigitsCNN, digits_datasets


def state_digest(handler: NNHandler) -> str:
    """SHA-256 of the weights, buffers and optimizer state (every rank holds the same)."""
    sha = hashlib.sha256()
    optimizer = handler.trainer.optimizer
    tensors = dict(handler.model.state_dict())
    if optimizer is not None:
        for index, state in optimizer.state_dict()["state"].items():
            tensors.update({f"optimizer.{index}.{k}": v for k, v in state.items()})
    for name in sorted(tensors):
        value = torch.as_tensor(tensors[name]).detach().cpu().contiguous()
        sha.update(name.encode() + value.view(-1).view(torch.uint8).numpy().tobytes())
    for record in handler.history:
        sha.update(f"{record['train_loss'].hex()} {record['val_loss'].hex()}".encode())
    return sha.hexdigest()


def main() -> None:
    torch.set_num_threads(1)  # the same threads per process at every world size
    train, val = digits_datasets()
    torch.manual_seed(0)
    config = {
        "loader": {"batch_size": 64, "seed": 0},
        "trainer": {
            "progress_bar": False,
            "reproducible": {"global_batch_size": 64, "micro_batch_size": 16},
        },
    }
    with NNHandler(
        DigitsCNN(batchnorm=True),
        lambda params: torch.optim.Adam(params, lr=3e-3),
        nn.CrossEntropyLoss(),
        config=config,
        metrics={"accuracy": accuracy},
    ) as handler:
        history = handler.train(train, val, epochs=4)
        digest = state_digest(handler)
        if handler.is_main_process:
            print(
                f"world size {handler.world_size}: val_accuracy="
                f"{history.last['val_accuracy']:.4f} sha256={digest}"
            )


if __name__ == "__main__":
    main()
