"""One worker of benchmarks/fault_tolerance.py's job (not a benchmark by itself): the same
NNHandler job either as a member of a fault-tolerant run (under ``nn-handler supervise``) or
as a torchrun worker (restarted with all the others from the latest checkpoint).

Usage: python ft_job.py RUN_DIR STEPS                      (a torchrun worker, world size 3)
       python ft_job.py RUN_DIR STEPS LIGHTHOUSE MEMBER    (a member, world size 1)

The job: an MLP on 3,072 synthetic samples in the reproducible mode (global batch 96, three
micro-batches of 32), ``STEPS`` optimizer steps, a periodic checkpoint every 20 steps. A
micro-batch's compute is a 30 ms sleep besides its (tiny) forward and backward, so that three
workers on two cores do not measure the cores' sharing. RUN_DIR/pids/<name>-<pid> says the
worker is up (the benchmark kills one of those); RUN_DIR/done-<name> gets its last step.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nn_handler import NNHandler

SAMPLES, GLOBAL_BATCH, MICRO_BATCH, CHECKPOINT_EVERY = 3072, 96, 32, 20
#: A micro-batch's emulated compute.
MICRO_BATCH_S = 0.03


class SlowMLP(nn.Module):
    """An MLP whose training forward also sleeps ``micro_batch_s`` (a micro-batch's compute)."""

    def __init__(self, micro_batch_s: float = MICRO_BATCH_S) -> None:
        super().__init__()
        self.micro_batch_s = micro_batch_s
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            time.sleep(self.micro_batch_s)
        return self.net(x)


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, 32, generator=generator)
    return torch.utils.data.TensorDataset(x, (x[:, :10].argmax(1)))


def main(run: Path, steps: int, lighthouse: str | None, member: str | None) -> None:
    name = member or f"rank{os.environ.get('RANK', '0')}"
    trainer: dict[str, Any] = {
        "progress_bar": False,
        "max_steps": steps,
        "reproducible": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH},
    }
    checkpoint = {"dir": str(run / "checkpoints"), "every_n_steps": CHECKPOINT_EVERY,
                  "every_n_epochs": None, "keep_last": 2,
                  "resume": "auto" if member else "on_restart"}  # fmt: skip
    if lighthouse is not None:
        trainer["fault_tolerance"] = {
            "lighthouse": lighthouse, "member_id": member, "timeout_s": 3.0,
            "quorum_timeout_s": 30.0,
        }  # fmt: skip
    torch.manual_seed(0)
    h = NNHandler(
        SlowMLP(),
        lambda p: torch.optim.SGD(p, lr=0.05),
        nn.CrossEntropyLoss(),
        config={"loader": {"seed": 3}, "trainer": trainer, "checkpoint": checkpoint,
                "logging": {"level": "WARNING"}},
    )  # fmt: skip
    (run / "pids").mkdir(exist_ok=True)
    (run / "pids" / f"{name}-{os.getpid()}").touch()
    epochs = -(-steps // (SAMPLES // GLOBAL_BATCH))
    h.train(dataset(), epochs=epochs)
    (run / f"done-{name}").write_text(str(h.trainer.state.global_step))
    h.close()


if __name__ == "__main__":
    run_dir, steps_arg, *member_args = sys.argv[1:]
    main(Path(run_dir), int(steps_arg), *(member_args or [None, None]))  # type: ignore[arg-type]
