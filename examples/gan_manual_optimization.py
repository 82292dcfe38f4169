"""Two optimizers with manual optimization: a tiny GAN learning points on a circle.

    python examples/gan_manual_optimization.py                        # one process
    torchrun --nproc-per-node=2 examples/gan_manual_optimization.py   # two, with DDP

``automatic_optimization = False`` lets ``training_step`` update the discriminator and the
generator with their own optimizers (``self.optimizers()``, ``self.manual_backward``); the
global step, the EMA and per-step schedulers still advance once per batch, and both
optimizers and schedulers are checkpointed. Under DDP each backward follows one forward of the
wrapped model, and ``find_unused_parameters`` lets each step leave the part it does not train
without gradients (the generator's step freezes the discriminator). In one process the
generated points end on the circle (mean radius 1.00 +- 0.25 after 480 steps); with 2 ranks
(240 steps of twice the batch) they are on their way there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional
from torch.utils.data import TensorDataset

from nn_handler import NNHandler, Trainer


class GAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor, part: str) -> torch.Tensor:
        if part == "generator":
            return self.generator(x)  # type: ignore[no-any-return]
        if part == "discriminator":
            return self.discriminator(x)  # type: ignore[no-any-return]
        return self.discriminator(self.generator(x))  # type: ignore[no-any-return]


class GANTrainer(Trainer):
    automatic_optimization = False

    def configure_optimizers(self, optimizer: Any, scheduler: Any) -> tuple[Any, Any]:
        d = torch.optim.Adam(self.module.discriminator.parameters(), lr=1e-2, betas=(0.5, 0.9))
        g = torch.optim.Adam(self.module.generator.parameters(), lr=1e-2, betas=(0.5, 0.9))
        return [d, g], None

    def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
        real = batch[0]
        opt_d, opt_g = self.optimizers()
        noise = torch.randn_like(real)
        with torch.no_grad():
            fake = self.forward(noise, "generator")
        scores = self.forward(torch.cat([real, fake]), "discriminator")
        d_loss = functional.softplus(-scores[: len(real)]).mean()
        d_loss = d_loss + functional.softplus(scores[len(real) :]).mean()
        opt_d.zero_grad(set_to_none=True)
        self.manual_backward(d_loss)
        opt_d.step()
        # The generator's step trains only the generator: freezing the discriminator skips its
        # gradients, and under DDP leaves it unused as the discriminator's step leaves the
        # generator (find_unused_parameters then finds unused parameters at every step).
        self.module.discriminator.requires_grad_(False)
        g_loss = functional.softplus(-self.forward(noise, "fake_scores")).mean()
        opt_g.zero_grad(set_to_none=True)
        self.manual_backward(g_loss)
        opt_g.step()
        self.module.discriminator.requires_grad_(True)
        return {"d_loss": d_loss.detach(), "g_loss": g_loss.detach()}


def circle(n: int = 512) -> TensorDataset:
    angle = torch.rand(n, generator=torch.Generator().manual_seed(0)) * 6.2832
    return TensorDataset(torch.stack([angle.cos(), angle.sin()], dim=1), torch.zeros(n))


def main() -> None:
    torch.manual_seed(0)
    with NNHandler(
        GAN(),
        config={
            "loader": {"batch_size": 64},
            "trainer": {"progress_bar": False, "find_unused_parameters": True},
        },
        trainer_class=GANTrainer,
    ) as handler:
        history = handler.train(circle(), epochs=60)
        samples = handler.model.generator(torch.randn(1000, 2))
        radius = samples.norm(dim=1).mean().item()
        if handler.rank == 0:
            last = history.last
            print(
                f"{handler.trainer.state.global_step} steps on {handler.world_size} "
                f"process(es): d_loss {last['train_d_loss']:.3f}, g_loss "
                f"{last['train_g_loss']:.3f}, generated radius {radius:.2f} (real: 1.00)"
            )


if __name__ == "__main__":
    main()
