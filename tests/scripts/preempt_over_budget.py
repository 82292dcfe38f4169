"""Run by tests/distributed/test_fault_tolerance.py as a plain process (not by pytest): a model
whose checkpoint takes far longer to write than preemption_budget_s gets a real SIGTERM after
optimizer step 3; the emergency save must be cancelled and the process must exit with 75.

Usage: python preempt_over_budget.py CKPT_DIR
"""

from __future__ import annotations

import os
import signal
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from nn_handler import Hook, NNHandler


class SigtermAfterStep3(Hook):
    def after_step(self) -> None:
        if self.trainer.state.global_step == 3:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    torch.manual_seed(0)
    # 4096 x 4096 float32 weights plus Adam's two moments: about 200 MB per checkpoint.
    model = nn.Sequential(nn.Linear(6, 4096), nn.Linear(4096, 4096), nn.Linear(4096, 3))
    data = TensorDataset(torch.randn(32, 6), torch.randint(0, 3, (32,)))
    config = {
        "loader": {"batch_size": 4},
        "trainer": {"progress_bar": False},
        "logging": {"enabled": True, "level": "WARNING"},
        "checkpoint": {"dir": sys.argv[1], "every_n_steps": 2, "preemption_budget_s": 0.05},
    }
    with NNHandler(
        model,
        lambda p: torch.optim.Adam(p, lr=1e-4),
        nn.CrossEntropyLoss(),
        config=config,
        hooks=[SigtermAfterStep3()],
    ) as handler:
        handler.train(data, epochs=1)


if __name__ == "__main__":
    main()
