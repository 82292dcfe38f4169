"""Started by hand on 2 ranks (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, as srun without an
agent would), not by pytest: rank LEAVER leaves mid-training by MODE; the survivor writes
OUT/survivor.json with what it raised and when, and LEAVER writes OUT/left.json first.

Usage: python leaving_rank.py OUT MODE LEAVER
MODE: 'exit' (sys.exit(3) in a hook), 'sigint' (a real SIGINT: KeyboardInterrupt), 'os_exit'
(os._exit(4)), 'sigkill' (a real SIGKILL).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from nn_handler import Hook, NNHandler, RankFailedError

LEAVE_AT_STEP = 3


class Leave(Hook):
    def __init__(self, out: Path, mode: str, leaver: int) -> None:
        super().__init__()
        self.out, self.mode, self.leaver = out, mode, leaver

    def after_step(self) -> None:
        trainer = self.trainer
        if trainer.comm.rank != self.leaver or trainer.state.global_step != LEAVE_AT_STEP:
            return
        (self.out / "left.json").write_text(json.dumps({"time": time.time()}))
        if self.mode == "exit":
            sys.exit(3)
        if self.mode == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # KeyboardInterrupt arrives before this ends
        if self.mode == "os_exit":
            os._exit(4)
        if self.mode == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, mode, leaver = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    # Python's own Ctrl-C handler, also when the suite runs as a background job (which starts
    # its children with SIGINT ignored): the 'sigint' mode needs a real KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(400, 6, generator=generator), torch.randint(0, 3, (400,), generator=generator)
    )
    config = {
        "loader": {"batch_size": 4},
        "trainer": {"progress_bar": False},
        "distributed": {"timeout": 60},
    }
    with NNHandler(
        nn.Linear(6, 3),
        lambda p: torch.optim.SGD(p, lr=0.1),
        nn.CrossEntropyLoss(),
        config=config,
        hooks=[Leave(out, mode, leaver)],
    ) as handler:
        try:
            handler.train(data, epochs=1)
        except RankFailedError as error:
            report = {"failed": error.failed_ranks, "message": str(error), "time": time.time()}
            (out / "survivor.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
