"""Train a model whose weights and Adam state do not fit one rank's memory budget: built on
the meta device (nothing allocated), sharded with FSDP2, each rank materialising only its own
shards, with activation checkpointing per block and the memory plan checked before training.

    torchrun --nproc-per-node=2 examples/large_model.py   # CPU (gloo) or GPUs (nccl)

The model is a transformer classifier (``TransformerEncoderLayer`` blocks) whose fp32 weights
and Adam state take 12.2 MiB; each rank's budget here is 12 MiB (``memory_budget``; on a real
job, left unset, it is the GPU's memory). The plan printed at the start (rank 0, one line per
item, the validation pass included) says what each rank holds: 11.1 MiB with 2 ranks and full
activation checkpointing (11.9 MiB with 'selective'; without checkpointing 13.3 MiB, and the
run stops before its first step with a ConfigError that names the layout that fits). The
task is examples/fsdp_transformer.py's (which of four marker tokens a sequence holds); it
reaches a validation accuracy above 0.95.
Alone (one process) the script trains the same model unsharded, without the budget.
"""

from __future__ import annotations

import os

import torch
from fsdp_transformer import MarkerClassifier, marker_data  # the task and model, larger here
from torch import nn

from nn_handler import NNHandler, accuracy


def main() -> None:
    sharded = int(os.environ.get("WORLD_SIZE", "1")) > 1
    with torch.device("meta"):  # shapes only: each rank allocates its own shards later
        model = MarkerClassifier(width=128, layers=4, feedforward=512, dropout=0.0)
    config = {
        "loader": {"batch_size": 16, "seed": 0},
        "trainer": {
            "epochs": 2,
            "progress_bar": False,
            "gradient_clip_val": 1.0,
            "strategy": "fsdp" if sharded else "auto",
            "fsdp": {
                "blocks": ["TransformerEncoderLayer"],  # the units to shard and recompute
                "activation_checkpointing": "full",  # keep only each block's input
            },
            "memory_budget": "12MiB" if sharded else None,
            "init_seed": 0,  # each module's reset_parameters, seeded by its name
        },
        "logging": {"monitor": False},
    }
    with NNHandler(
        model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=2e-3),
        loss_fn=nn.CrossEntropyLoss(),
        config=config,
        metrics={"accuracy": accuracy},
    ) as handler:
        history = handler.train(marker_data(1024, seed=1), marker_data(256, seed=2))
        memory = handler.trainer.memory
        plan, budget = memory.plan, memory.budget or 0
        whole = 16 * sum(p.numel() for p in handler.trainer.module.parameters())
        if handler.is_main_process and plan is not None:
            print(
                f"final: val_accuracy={history.last['val_accuracy']:.3f}; whole model + Adam "
                f"{whole / 2**20:.1f} MiB, plan {plan.total / 2**20:.1f} MiB per rank, budget "
                f"{budget / 2**20:.1f} MiB"
            )


if __name__ == "__main__":
    main()
