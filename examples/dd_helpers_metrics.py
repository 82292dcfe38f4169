"""Seed 001's dd_helpers: aggregate metrics and losses across ranks, broadcast a config that
only rank 0 reads.

    python examples/dd_helpers_metrics.py                       # one process
    torchrun --nproc-per-node=2 examples/dd_helpers_metrics.py  # two processes
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import torch

from nn_handler.distributed import DistributedContext
from nn_handler.utils.dd_helpers import aggregate_loss, aggregate_metrics, broadcast_if_ddp


def load_config_from_file(path: Path) -> dict[str, Any]:
    return dict(json.loads(path.read_text()))


def main() -> None:
    with DistributedContext() as ctx:
        rank, world_size = ctx.rank, ctx.world_size

        # Only rank 0 loads the configuration (here from a file only it writes)
        config = None
        if rank == 0:
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "config.json"
                path.write_text(json.dumps({"lr": 0.001, "epochs": 3}))
                config = load_config_from_file(path)

        # Broadcast to all ranks: now all ranks have the same config
        config = broadcast_if_ddp(config)
        print(f"rank {rank}: config {config}")

        # Every rank measured something different; aggregate to the mean over ranks
        metrics = {"accuracy": 0.80 + 0.05 * rank, "f1": 0.70 + 0.10 * rank}
        loss = torch.tensor(1.0 + rank)
        averaged = aggregate_metrics(metrics, world_size)
        mean_loss = aggregate_loss(loss, world_size)
        if rank == 0:
            shown = {k: round(v, 4) for k, v in averaged.items()}
            print(f"aggregated over {world_size} rank(s): {shown}, loss {mean_loss:.4f}")


if __name__ == "__main__":
    main()
