"""Run by tests/distributed/test_fault_tolerance.py under the real torchrun (not by pytest).

Usage: torchrun --nproc-per-node=2 [--max-restarts=1] torchrun_fault.py CKPT_DIR OUT_DIR MODE
[gan | multitask]
MODE: 'plain' trains uninterrupted; 'sigkill' makes rank 1 SIGKILL itself after optimizer step
7 in the first attempt; 'slow' sleeps 0.1 s per step and reports its progress (for a SIGTERM
from outside). Resumes per CheckpointConfig(resume=...): 'on_restart' unless MODE is 'slow'
('auto', for the relaunch after a preemption). Each rank writes OUT_DIR/rank<r>-attempt<a>.json
and OUT_DIR/rank<r>.pt (the final weights) when it finishes. With 'gan', a GAN trained with
manual optimization (two optimizers) and a hook whose per-rank loss sum is tracked state.
With 'multitask', examples/custom_trainer.py's model and Trainer (two logged training losses,
a torchmetrics F1 fed by its overridden validation_step, a hook with state) plus the same
tracked loss sum, validated every epoch; the report then holds the History too.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

from nn_handler import HandlerConfig, Hook, NNHandler, TrainingPreempted
from nn_handler.monitoring import RECORD_KEYS

#: Measured, not reproducible: the loop's clocks and the ThroughputMonitor's keys.
TIMING_KEYS = ("epoch_time", "samples_per_sec", *RECORD_KEYS)

KILL_AFTER_STEP = 7


class Fault(Hook):
    def __init__(self, mode: str, attempt: int, out: Path) -> None:
        super().__init__()
        self.mode, self.attempt, self.out = mode, attempt, out
        self.first_step: int | None = None

    def before_train(self) -> None:
        self.first_step = self.trainer.state.global_step

    def after_step(self) -> None:
        trainer = self.trainer
        step, rank = trainer.state.global_step, trainer.comm.rank
        if self.mode == "sigkill" and self.attempt == 0 and rank == 1 and step == KILL_AFTER_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.mode == "slow":
            time.sleep(0.1)
            progress = {"pid": os.getpid(), "step": step}
            tmp = self.out / f".progress{rank}"
            tmp.write_text(json.dumps(progress))
            os.replace(tmp, self.out / f"progress{rank}.json")


def main() -> None:
    ckpt_dir, out, mode = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(
        torch.randn(64, 6, generator=generator), torch.randint(0, 3, (64,), generator=generator)
    )
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    variant = sys.argv[4] if len(sys.argv) > 4 else ""
    gan = variant == "gan"
    extra: dict[str, Any] = {}
    hooks: list[Hook] = []
    val: Any = None
    if variant == "multitask":
        from torchmetrics.classification import MulticlassF1Score

        from examples.custom_trainer import BestAccuracy, ClassifyAndRebuild, TwoLossTrainer
        from tests.unit.test_tracked_state import LossSums

        images = torch.randn(88, 8, 8, generator=generator)
        labels = torch.randint(0, 10, (88,), generator=generator)
        data, val = TensorDataset(images[:64], labels[:64]), TensorDataset(images[64:], labels[64:])
        torch.manual_seed(0)
        model = ClassifyAndRebuild()
        extra = {
            "trainer_class": TwoLossTrainer,
            "metrics": {"f1": MulticlassF1Score(num_classes=10)},
        }
        hooks = [LossSums(), BestAccuracy()]
    if gan:
        from tests.gan_helpers import GANTrainer, TinyGAN, ring_data
        from tests.unit.test_tracked_state import LossSums

        model, data = TinyGAN(), ring_data()
        extra = {"trainer_class": GANTrainer}
        hooks = [LossSums()]
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 4, "shuffle": True, "seed": 1},
            "trainer": {"epochs": 3, "progress_bar": False, "find_unused_parameters": gan},
            "checkpoint": {
                "dir": str(ckpt_dir),
                "every_n_steps": 3,
                "resume": "auto" if mode == "slow" else "on_restart",
            },
        }
    )
    fault = Fault(mode, attempt, out)
    with NNHandler(
        model,
        lambda params: torch.optim.Adam(params, lr=0.01),
        nn.CrossEntropyLoss(),
        config=config,
        hooks=[fault, *hooks],
        **extra,
    ) as handler:
        report = {"attempt": attempt, "rank": handler.rank}
        try:
            history = handler.train(data, val)
        except TrainingPreempted as stop:
            report.update(preempted=stop.code, step=stop.global_step, checkpoint=stop.checkpoint)
            raise
        else:
            report.update(step=handler.trainer.state.global_step)
            if hooks:  # the tracked loss sum, exactly (hex keeps every bit)
                report["loss_total"] = hooks[0].total.hex()  # type: ignore[attr-defined]
            if variant == "multitask":  # the example's hook state, restored by itself
                report["best"] = hooks[1].best.hex()  # type: ignore[attr-defined]
            if val is not None:  # every logged value, exactly (the clocks' aside)
                report["history"] = [
                    {k: v.hex() for k, v in r.items() if k not in TIMING_KEYS}
                    for r in history.records
                ]
            torch.save(handler.model.state_dict(), out / f"rank{handler.rank}.pt")
        finally:
            report["first_step"] = fault.first_step
            name = f"rank{handler.rank}-attempt{attempt}.json"
            (out / name).write_text(json.dumps(report))


if __name__ == "__main__":
    main()
