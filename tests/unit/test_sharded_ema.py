"""ShardedEma's arithmetic against ModelEma's, on a plain module (the same code runs on each
rank's shard of an FSDP2 model: tests/distributed/test_fsdp.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from nn_handler.config.training import EmaConfig, TrainerConfig
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.strategies.single import SingleDeviceStrategy
from nn_handler.training.ema import ModelEma
from nn_handler.training.sharded_ema import ShardedEma


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))


def _views() -> SingleDeviceStrategy:
    return SingleDeviceStrategy(NullCommunicator(), torch.device("cpu"), TrainerConfig())


@pytest.mark.parametrize("buffers", ["copy", "average"])
@pytest.mark.parametrize("warmup", [True, False])
def test_sharded_ema_averages_exactly_like_model_ema(buffers: str, warmup: bool) -> None:
    config = EmaConfig(enabled=True, decay=0.8, warmup=warmup, buffers=buffers, start_step=1)
    model = _model()
    full = ModelEma(model, config)
    sharded = ShardedEma(model, config, _views())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(4):
        model.train()
        model(torch.randn(6, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        full.update()
        sharded.update()
    training = {k: v.clone() for k, v in model.state_dict().items()}
    with sharded.applied() as applied:
        assert applied is model
        for key, value in full.module.state_dict().items():
            assert torch.equal(model.state_dict()[key], value), key
    for key, value in model.state_dict().items():  # the training weights are back
        assert torch.equal(value, training[key]), key
    saved = sharded.state_dict()
    assert saved["num_updates"] == full.num_updates == 3
    other = ShardedEma(_model(), config, _views())
    other.load_state_dict(saved)
    with other.applied() as applied:
        for key, value in full.module.state_dict().items():
            assert torch.equal(applied.state_dict()[key], value), key
    # The sharded view (a sharded checkpoint's) round-trips the same way.
    shards = sharded.shards()
    assert shards["num_updates"] == 3
    third = ShardedEma(_model(), config, _views())
    third.load_shards(shards)
    with third.applied() as applied:
        for key, value in full.module.state_dict().items():
            assert torch.equal(applied.state_dict()[key], value), key
