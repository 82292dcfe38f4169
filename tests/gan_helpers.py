"""A tiny GAN trained with manual optimization (two optimizers), for the tests and the docs:
one grad-enabled forward through the (possibly DDP-wrapped) model per backward."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional

from nn_handler import Trainer


class TinyGAN(nn.Module):
    """``forward(x, part)``: 'generator' G(x), 'discriminator' D(x), 'fake_scores' D(G(x))."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 2))
        self.discriminator = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor, part: str) -> torch.Tensor:
        if part == "generator":
            return self.generator(x)  # type: ignore[no-any-return]
        if part == "discriminator":
            return self.discriminator(x)  # type: ignore[no-any-return]
        return self.discriminator(self.generator(x))  # type: ignore[no-any-return]


class GANTrainer(Trainer):
    """Alternating D and G updates, each with its own optimizer and scheduler."""

    automatic_optimization = False

    def configure_optimizers(self, optimizer: Any, scheduler: Any) -> tuple[Any, Any]:
        gan = self.module
        d = torch.optim.Adam(gan.discriminator.parameters(), lr=1e-2)
        g = torch.optim.Adam(gan.generator.parameters(), lr=1e-2)
        decay = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for o in (d, g)]
        return [d, g], decay

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
        g_loss = functional.softplus(-self.forward(noise, "fake_scores")).mean()
        opt_g.zero_grad(set_to_none=True)
        self.manual_backward(g_loss)
        opt_g.step()
        return {"loss": (d_loss + g_loss).detach(), "d_loss": d_loss.detach(), "g": g_loss.detach()}


def ring_data(n: int = 64) -> torch.utils.data.TensorDataset:
    """Points on the unit circle (the real distribution), with dummy labels."""
    generator = torch.Generator().manual_seed(1)
    angle = torch.rand(n, generator=generator) * 6.283
    points = torch.stack([angle.cos(), angle.sin()], dim=1)
    return torch.utils.data.TensorDataset(points, torch.zeros(n, dtype=torch.long))
