"""Seed 002's rank-specific operations: on_rank and main_process_first.

python examples/rank_decorators.py                          # one process
torchrun --nproc-per-node=2 examples/rank_decorators.py     # two processes
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from nn_handler import RankFailedError, record
from nn_handler.distributed import get_rank
from nn_handler.utils.ddp import initialize_ddp
from nn_handler.utils.ddp_decorators import main_process_first, on_rank


@on_rank(0)  # only rank 0 writes; the other ranks wait and learn if it failed
def save_checkpoint(model: torch.nn.Module, epoch: int, path: Path) -> Path:
    torch.save({"model": model.state_dict(), "epoch": epoch}, path)
    print(f"Checkpoint saved to {path}")
    return path


@on_rank([0, 1])  # ranks 0 and 1 (in one process: rank 0 only)
def process_data(data: list[int]) -> list[int]:
    return [x * 2 for x in data]


@on_rank(0)
def flaky() -> None:
    raise OSError("disk full")


@record
def main() -> None:
    result = initialize_ddp()
    distributed = bool(result and result[0])
    folder = Path(tempfile.gettempdir()) / "nn_handler_rank_decorators"
    with main_process_first():  # rank 0 creates the folder before the others look at it
        folder.mkdir(exist_ok=True)
    model = torch.nn.Linear(2, 1)
    saved = save_checkpoint(model, 3, folder / "checkpoint.pth")
    processed = process_data([1, 2])
    print(f"rank {get_rank()}: save_checkpoint returned {saved}; process_data -> {processed}")
    try:
        flaky()
    except RankFailedError as error:  # every rank gets it when several ranks run
        print(f"rank {get_rank()} caught: {str(error).splitlines()[0]}")
    except OSError as error:  # one process: the original exception, unchanged
        print(f"rank {get_rank()} caught the original error: {error!r}")
    if distributed:
        from nn_handler.distributed import shutdown_dist

        shutdown_dist()


if __name__ == "__main__":
    main()
