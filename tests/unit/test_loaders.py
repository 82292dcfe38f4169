"""LoaderFactory in one process; ranks are simulated by DistributedInfo (loaders need no group)."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset
from torch.utils.data._utils.collate import default_collate
from torch.utils.data.distributed import DistributedSampler

from nn_handler.config import LoaderConfig
from nn_handler.data import ExactEvalSampler, LoaderFactory, RankCachedDataset, ShardBatchSampler
from nn_handler.distributed.env import DistributedInfo
from nn_handler.errors import ConfigError
from nn_handler.utils.dd_helpers import (
    _create_distributed_loader,
    _create_rank_cached_dataloader,
)

CPU = torch.device("cpu")


def factory(
    rank: int = 0, world: int = 2, device: torch.device = CPU, **config: Any
) -> LoaderFactory:
    return LoaderFactory(LoaderConfig(**config), DistributedInfo(rank, rank, world, world), device)


class Counting(Dataset[tuple[torch.Tensor, int]]):
    """Samples (tensor of shape (3, 4) filled with i, label i % 3); counts __getitem__ calls."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.calls += 1
        return torch.full((3, 4), float(i)), i % 3


class RandomDraws(Dataset[tuple[float, float, float]]):
    """Each sample is one draw from torch, random and numpy: shows how workers are seeded."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> tuple[float, float, float]:
        return torch.rand(1).item(), random.random(), float(np.random.rand())


def test_defaults_follow_the_device_and_the_workers() -> None:
    cpu = factory(num_workers=1)
    assert cpu.settings["pin_memory"] is False and cpu.settings["persistent_workers"] is True
    assert cpu.settings["effective_batch_size"] == 64
    cuda = factory(device=torch.device("cuda", 0))
    assert cuda.settings["pin_memory"] is True and cuda.settings["persistent_workers"] is False
    forced = factory(pin_memory=True, persistent_workers=True, prefetch_factor=4)
    assert forced.settings["pin_memory"] is False and forced.settings["persistent_workers"] is False
    assert forced.settings["prefetch_factor"] is None
    assert len(forced.adjustments) == 3 and "not CUDA" in forced.adjustments[0]


def test_num_workers_are_clamped_to_the_cpus_per_local_rank(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("nn_handler.data.factory.cpus_available", lambda: 8)
    assert factory(world=4, num_workers=16).settings["num_workers"] == 2
    assert factory(world=4, num_workers=1).settings["num_workers"] == 1
    assert factory(num_workers=3, mode="rank_cached").settings["num_workers"] == 0


def test_settings_are_logged_once_and_only_on_rank_zero() -> None:
    dataset = TensorDataset(torch.arange(10))
    lines: dict[int, list[str]] = {0: [], 1: []}
    for rank in (0, 1):
        made = LoaderFactory(
            LoaderConfig(), DistributedInfo(rank, rank, 2, 2), CPU, lines[rank].append
        )
        made.train_loader(dataset)
        made.eval_loader(dataset)
    assert len(lines[0]) == 1 and lines[1] == []
    assert "batch_size=32" in lines[0][0] and "effective_batch_size=64" in lines[0][0]


@pytest.mark.parametrize("mode", ["distributed", "rank_cached"])
def test_set_epoch_gives_the_same_order_every_run_and_new_orders_each_epoch(mode: str) -> None:
    dataset = TensorDataset(torch.arange(40))

    def order(epoch: int, seed: int = 0, rank: int = 0) -> list[int]:
        loader = factory(rank=rank, batch_size=4, mode=mode, seed=seed).train_loader(dataset)
        loader.set_epoch(epoch)
        return [i for (batch,) in loader for i in batch.tolist()]

    assert order(3) == order(3), "same seed and epoch: same order"
    assert order(3) != order(4), "another epoch: another order"
    assert order(3) != order(3, seed=1), "another seed: another order"
    assert set(order(3)).isdisjoint(order(3, rank=1)), "ranks see different samples"


def _worker_draws(epoch: int, rank: int = 0, persistent: bool = False) -> list[tuple[float, ...]]:
    loader = factory(
        rank=rank, batch_size=1, num_workers=2, shuffle=False, persistent_workers=persistent
    ).eval_loader(RandomDraws())
    loader.set_epoch(epoch)
    return [tuple(float(v) for v in sample) for sample in loader]


def test_workers_are_seeded_from_seed_rank_epoch_and_worker() -> None:
    first = _worker_draws(epoch=1)
    assert first == _worker_draws(epoch=1), "reproducible across runs"
    assert first != _worker_draws(epoch=2), "a new epoch gives new streams"
    assert first != _worker_draws(epoch=1, rank=1), "ranks do not share streams"
    worker0, worker1 = first[0::2], first[1::2]  # two workers serve alternate batches
    for lib in range(3):  # torch, random and numpy are all seeded, differently per worker
        assert worker0[0][lib] != worker1[0][lib]


def test_rank_cached_reads_its_shard_once_and_serves_batches_like_default_collate() -> None:
    dataset = Counting(101)
    loader = factory(rank=1, batch_size=8, mode="rank_cached").train_loader(dataset)
    cached = loader.dataset
    assert isinstance(cached, RankCachedDataset) and cached.is_stacked
    assert dataset.calls == len(cached) == 51, "only this rank's shard, read once"
    for epoch in range(3):
        loader.set_epoch(epoch)
        batches = list(loader)
    assert dataset.calls == 51, "no __getitem__ after the first pass"
    x, y = batches[0]
    expected = default_collate([Counting(101)[int(i)] for i in x[:, 0, 0].tolist()])
    assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
    assert cached.nbytes == 51 * (3 * 4 * 4 + 8), "about 1/world_size of the dataset"


def test_rank_cached_keeps_non_uniform_samples_as_a_list() -> None:
    words = ["a", "bb", "ccc", "dddd", "e"]

    class Words(Dataset[str]):
        def __len__(self) -> int:
            return len(words)

        def __getitem__(self, i: int) -> str:
            return words[i]

    loader = factory(world=1, batch_size=2, mode="rank_cached", shuffle=False).eval_loader(Words())
    assert not loader.dataset.is_stacked  # type: ignore[attr-defined]
    assert list(loader) == [["a", "bb"], ["ccc", "dddd"], ["e"]]
    joined = factory(world=1, batch_size=2, mode="rank_cached").eval_loader(
        Words(), collate_fn=lambda batch: "+".join(batch)
    )
    assert list(joined) == ["a+bb", "ccc+dddd", "e"]


def test_unusable_datasets_and_empty_epochs_are_config_errors() -> None:
    class Stream(IterableDataset[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(3))

    with pytest.raises(ConfigError, match="map-style dataset with __len__, got Stream"):
        factory().train_loader(Stream())
    with pytest.raises(ConfigError, match="dataset is empty"):
        factory().eval_loader(TensorDataset(torch.zeros(0)))
    with pytest.raises(ConfigError, match="fewer than batch_size=32: no full batch"):
        factory(drop_last=True).train_loader(TensorDataset(torch.zeros(20)))


def test_seed_001_loader_helpers_return_a_loader_and_its_sampler() -> None:
    dataset = TensorDataset(torch.arange(9))
    logged: list[str] = []
    loader, sampler = _create_distributed_loader(dataset, {"batch_size": 4}, "cpu", logged.append)
    assert isinstance(sampler, DistributedSampler) and loader.sampler is sampler
    assert len(loader) == 3 and logged
    loader, sampler = _create_distributed_loader(dataset, {}, CPU, None, is_eval=True)
    assert isinstance(sampler, ExactEvalSampler) and isinstance(sampler, DistributedSampler)
    loader, sampler = _create_rank_cached_dataloader(
        dataset, {"batch_size": 2, "collate_fn": None}, CPU, None
    )
    assert isinstance(sampler, ShardBatchSampler) and len(loader) == 5
    with pytest.raises(ConfigError, match="batchsize"):
        _create_distributed_loader(dataset, {"batchsize": 4}, CPU, None)
