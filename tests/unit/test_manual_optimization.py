"""Several optimizers with manual optimization (a GAN), in one process: the global step, EMA
and schedulers advance once per batch, both optimizers checkpoint and resume exactly, and the
configurations manual optimization cannot honour are refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import ConfigError, HandlerConfig, NNHandler, Trainer, TrainingPreempted
from tests.gan_helpers import GANTrainer, TinyGAN, ring_data
from tests.resume_helpers import TIMING_KEYS, SigtermAt, same
from tests.training_helpers import mlp, sgd

DATA = ring_data()  # 64 points: 8 batches of 8


def _gan(folder: Path | None = None, hooks: Any = (), **checkpoint: Any) -> NNHandler:
    config: dict[str, Any] = {
        "loader": {"batch_size": 8, "seed": 2},
        "trainer": {"progress_bar": False},
        "ema": {"enabled": True, "decay": 0.9},
    }
    if folder is not None:
        config["checkpoint"] = {"dir": str(folder), "every_n_steps": 3, **checkpoint}
    return NNHandler(
        TinyGAN(), config=HandlerConfig.from_dict(config), trainer_class=GANTrainer, hooks=hooks
    )


def test_a_gan_advances_once_per_batch_and_logs_both_losses() -> None:
    with _gan() as handler:
        torch.manual_seed(3)
        history = handler.train(DATA, epochs=2)
        trainer = handler.trainer
        assert trainer.state.global_step == 16  # once per batch, not once per optimizer
        assert trainer.ema is not None and trainer.ema.num_updates == 16
        d, g = trainer.optimizers()
        assert d.param_groups[0]["lr"] == g.param_groups[0]["lr"] == pytest.approx(2.5e-3)
        assert len(trainer.lr_schedulers()) == 2
        record = history.last
        assert {"train_loss", "train_d_loss", "train_g"} <= set(record)
        assert record["train_loss"] == pytest.approx(record["train_d_loss"] + record["train_g"])


def _outcome(handler: NNHandler) -> dict[str, Any]:
    d, g = handler.trainer.optimizers()
    return {
        "model": {k: v.clone() for k, v in handler.model.state_dict().items()},
        "d": d.state_dict(),
        "g": g.state_dict(),
        "lr": [s.get_last_lr() for s in handler.trainer.lr_schedulers()],
        "history": [
            {k: v for k, v in r.items() if k not in TIMING_KEYS} for r in handler.history.records
        ],
    }


def test_both_optimizers_resume_exactly_mid_epoch(tmp_path: Path) -> None:
    with _gan(tmp_path / "full") as handler:
        handler.train(DATA, epochs=2)
        full = _outcome(handler)
    with _gan(tmp_path / "cut", hooks=[SigtermAt(5)]) as handler, pytest.raises(TrainingPreempted):
        handler.train(DATA, epochs=2)
    with _gan(tmp_path / "cut", resume="auto") as handler:
        handler.train(DATA, epochs=2)
        resumed = _outcome(handler)
    for part in full:
        assert same(full[part], resumed[part]), part


class TwoOptimizersAutomatic(Trainer):
    def configure_optimizers(self, optimizer: Any, scheduler: Any) -> tuple[Any, Any]:
        params = list(self.module.parameters())
        return [torch.optim.SGD(params[:2], lr=0.1), torch.optim.SGD(params[2:], lr=0.1)], None


class Manual(Trainer):
    automatic_optimization = False


@pytest.mark.parametrize(
    ("trainer_class", "trainer", "message"),
    [
        (TwoOptimizersAutomatic, {}, "2 optimizers need manual optimization"),
        (Manual, {"accumulate_grad_batches": 2}, "accumulate_grad_batches must be 1"),
        (Manual, {"gradient_clip_val": 1.0}, "gradient_clip_val is not applied"),
    ],
)
def test_what_manual_optimization_cannot_honour_is_refused(
    trainer_class: type[Trainer], trainer: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        NNHandler(
            mlp(),
            sgd,
            nn.CrossEntropyLoss(),
            config={"trainer": trainer},
            trainer_class=trainer_class,
        )
