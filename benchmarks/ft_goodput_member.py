"""One member of benchmarks/ft_goodput.py's job (not a benchmark by itself), started by
``nn-handler supervise`` (and again, with the same name, after each kill).

Usage: python ft_goodput_member.py RUN_DIR STEPS LIGHTHOUSE MEMBER

The job: an MLP on synthetic samples in the reproducible mode with per-step fault tolerance
(global batch 96 in 24 micro-batches of 4: six per member of four), ``STEPS`` optimizer steps.
A micro-batch's compute is a MICRO_BATCH_S sleep besides its (tiny) forward and backward, so
that a step takes about 2 s with four members on two cores and measures the run's recovery,
not the cores' sharing. It writes, as it goes (kept when it is killed):
RUN_DIR/pids/<member>-<pid> once it is up, RUN_DIR/commits-<member> one line per committed
step (its number, the time, the SHA-256 of the weights and the optimizer state after it),
RUN_DIR/loaded-<member> one line per micro-batch it loaded (the
step, the samples' indices), RUN_DIR/lighthouse the Lighthouse's address; and at the end
RUN_DIR/done-<member>: the steps done and the SHA-256 of the weights and the optimizer state.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ft_job import SlowMLP

from nn_handler import NNHandler
from nn_handler.training.hooks import Hook

SAMPLES, GLOBAL_BATCH, MICRO_BATCH = 1920, 96, 4
#: A micro-batch's emulated compute.
MICRO_BATCH_S = float(os.environ.get("FT_GOODPUT_MICRO_BATCH_S", "0.3"))


class Noted(Dataset[Any]):
    """The training set, noting the samples each micro-batch loads (the ledger)."""

    def __init__(self, h: NNHandler, ledger: Path) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.randn(SAMPLES, 32, generator=generator)
        self.y = self.x[:, :10].argmax(1)
        self.h, self.ledger, self.batch = h, ledger, []  # type: ignore[var-annotated]

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> Any:
        self.batch.append(index)
        if len(self.batch) == MICRO_BATCH:
            step = self.h.trainer.state.global_step
            with open(self.ledger, "a") as out:
                out.write(" ".join(map(str, [step, *self.batch])) + "\n")
            self.batch = []
        return self.x[index], self.y[index]


class Commits(Hook):
    """Appends each committed step, its time and the SHA-256 after it to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def after_optimizer_step(self) -> None:
        when = time.time()
        with open(self.path, "a") as out:
            out.write(f"{self.trainer.state.global_step} {when!r} {digest(self.trainer)}\n")


def digest(trainer: Any) -> str:
    """SHA-256 of the trainer's weights and its optimizer's state."""
    sha = hashlib.sha256()
    for name, tensor in sorted(trainer.module.state_dict().items()):
        sha.update(name.encode() + tensor.detach().contiguous().numpy().tobytes())
    sha.update(repr(trainer.optimizer.state_dict()).encode())
    return sha.hexdigest()


def main(run: Path, steps: int, lighthouse: str, member: str) -> None:
    torch.set_num_threads(1)
    trainer: dict[str, Any] = {
        "progress_bar": False,
        "max_steps": steps,
        "reproducible": {"global_batch_size": GLOBAL_BATCH, "micro_batch_size": MICRO_BATCH},
        "fault_tolerance": {"lighthouse": lighthouse, "member_id": member, "timeout_s": 10.0,
                            "quorum_timeout_s": 60.0},
    }  # fmt: skip
    torch.manual_seed(0)
    h = NNHandler(
        SlowMLP(MICRO_BATCH_S),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
        nn.CrossEntropyLoss(),
        config={"loader": {"seed": 3}, "trainer": trainer, "logging": {"level": "WARNING"}},
        hooks=[Commits(run / f"commits-{member}")],
    )  # fmt: skip
    staged = run / f"lighthouse-{member}"
    staged.write_text(lighthouse)
    staged.replace(run / "lighthouse")  # whole or not at all
    (run / "pids").mkdir(exist_ok=True)
    (run / "pids" / f"{member}-{os.getpid()}").touch()
    h.train(Noted(h, run / f"loaded-{member}"), epochs=-(-steps // (SAMPLES // GLOBAL_BATCH)))
    done = {"steps": h.trainer.state.global_step, "sha256": digest(h.trainer)}
    (run / f"done-{member}").write_text(json.dumps(done))
    h.close()


if __name__ == "__main__":
    run_dir, steps_arg, lighthouse_arg, member_arg = sys.argv[1:]
    main(Path(run_dir), int(steps_arg), lighthouse_arg, member_arg)
