"""Collectives that work the same alone and under torchrun.

python examples/collectives.py
torchrun --nproc-per-node=2 examples/collectives.py
"""

from __future__ import annotations

import torch

from nn_handler import DistributedConfig, DistributedContext


def main() -> None:
    with DistributedContext(DistributedConfig(backend="auto")) as ctx:
        comm = ctx.communicator
        torch.manual_seed(ctx.rank)
        preds = torch.randn(ctx.rank + 3, 4)  # a different number of rows on every rank
        every = comm.gather_into_tensor(preds)
        metrics = comm.reduce_dict({"rows": float(preds.shape[0]), "mean": preds.mean().item()})
        if ctx.is_main_process:
            print(f"world size {comm.world_size}: gathered {tuple(every.shape)}, metrics {metrics}")


if __name__ == "__main__":
    main()
