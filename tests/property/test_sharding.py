"""Property tests: shard and step arithmetic, against torch's own samplers and loaders."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from nn_handler.config import LoaderConfig
from nn_handler.data import LoaderFactory, ShardBatchSampler
from nn_handler.data.reshard import rest_batches
from nn_handler.data.sharding import (
    eval_indices,
    eval_steps,
    train_samples_per_rank,
    train_shard,
    train_steps_per_rank,
)
from nn_handler.distributed.env import DistributedInfo
from nn_handler.errors import ConfigError

sizes = st.integers(1, 300)
worlds = st.integers(1, 9)
batches = st.integers(1, 40)


@given(sizes, worlds, batches, st.booleans())
def test_every_rank_takes_the_same_number_of_training_steps(
    n: int, world: int, batch: int, drop_last: bool
) -> None:
    samples = train_samples_per_rank(n, world, drop_last)
    assume(not drop_last or samples >= batch)
    steps = train_steps_per_rank(n, world, batch, drop_last)
    dataset = TensorDataset(torch.arange(n))
    for rank in range(world):
        sampler = DistributedSampler(dataset, world, rank, shuffle=False, drop_last=drop_last)
        loader = DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=drop_last)
        assert len(sampler) == samples and len(loader) == steps
        shard = train_shard(list(range(n)), world, rank, drop_last)
        assert shard == list(sampler), "the same rule as DistributedSampler"
        cached = ShardBatchSampler(len(shard), batch, True, drop_last, 0, rank)
        assert len(cached) == steps == len(list(cached))


@given(worlds, batches, st.data())
def test_drop_last_without_a_full_batch_is_an_error_not_an_empty_epoch(
    world: int, batch: int, data: st.DataObject
) -> None:
    # Drawn inside the region (an assume() there rejected most inputs: a health-check failure).
    assume(world * batch > 1)
    n = data.draw(st.integers(1, world * batch - 1), label="n")
    assert n // world < batch
    with pytest.raises(ConfigError, match="no full batch"):
        train_steps_per_rank(n, world, batch, drop_last=True)


@given(sizes, worlds, st.booleans(), st.randoms(use_true_random=False))
def test_training_shards_are_equal_complete_and_only_repeat_the_padding(
    n: int, world: int, drop_last: bool, rng: object
) -> None:
    order = list(range(n))
    rng.shuffle(order)  # type: ignore[attr-defined]
    shards = [train_shard(order, world, rank, drop_last) for rank in range(world)]
    assert len({len(s) for s in shards}) == 1
    counts = Counter(i for shard in shards for i in shard)
    if drop_last:
        assert max(counts.values(), default=1) == 1 and len(counts) == (n // world) * world
    else:
        assert set(counts) == set(range(n)), "every sample is trained on"
        padding = math.ceil(n / world) * world - n
        assert sum(c - 1 for c in counts.values()) == padding


@given(sizes, worlds, batches)
def test_evaluation_visits_every_sample_exactly_once(n: int, world: int, batch: int) -> None:
    visited = [i for rank in range(world) for i in eval_indices(n, world, rank)]
    assert sorted(visited) == list(range(n))
    steps = [eval_steps(n, world, rank, batch) for rank in range(world)]
    assert max(steps) - min(steps) <= 1


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 60), st.integers(1, 4), st.integers(1, 8), st.booleans(), st.booleans())
def test_factory_loaders_match_the_arithmetic_in_both_modes(
    n: int, world: int, batch: int, drop_last: bool, cached: bool
) -> None:
    assume(not drop_last or n // world >= batch)
    dataset = TensorDataset(torch.arange(n))
    config = LoaderConfig(
        batch_size=batch, drop_last=drop_last, mode="rank_cached" if cached else "distributed"
    )
    seen: list[int] = []
    for rank in range(world):
        info = DistributedInfo(rank, rank, world, world)
        factory = LoaderFactory(config, info, torch.device("cpu"))
        train = factory.train_loader(dataset)
        train.set_epoch(2)
        assert sum(1 for _ in train) == train_steps_per_rank(n, world, batch, drop_last)
        seen.extend(i for (b,) in factory.eval_loader(dataset) for i in b.tolist())
    assert sorted(seen) == list(range(n))


@given(
    st.fixed_dictionaries(
        {},
        optional={
            "batch_size": st.integers(-5, 0),
            "num_workers": st.integers(-5, -1),
            "prefetch_factor": st.integers(-5, 0),
            "seed": st.integers(-10, -1),
            "mode": st.text(max_size=5),
        },
    ).filter(bool)
)
def test_loader_config_rejects_bad_values_naming_the_field(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError) as info:
        LoaderConfig(**bad)  # type: ignore[arg-type]
    assert any(name in str(info.value) for name in bad)


@given(sizes, worlds, batches, st.randoms(use_true_random=False), st.data())
def test_after_any_batches_every_world_has_visited_a_prefix_of_the_epoch_order(
    n: int, world: int, batch: int, rng: random.Random, data: st.DataObject
) -> None:
    """What makes a mid-epoch position re-shardable: rank r takes positions r, r + W, ... so
    the samples visited after b batches on every rank are the order's first b * B * W."""
    order = list(range(n))
    rng.shuffle(order)
    steps = train_steps_per_rank(n, world, batch, drop_last=False)
    done = data.draw(st.integers(0, steps))
    visited = [
        index
        for rank in range(world)
        for index in train_shard(order, world, rank, drop_last=False)[: done * batch]
    ]
    prefix = done * batch * world
    if prefix <= n:
        assert sorted(visited) == sorted(order[:prefix])
    else:  # into the padding: everything, and repeats of the order's start only
        assert set(visited) == set(order)


@given(sizes, worlds, batches, st.data())
def test_the_rest_of_an_epoch_is_split_once_with_equal_steps(
    n: int, world: int, batch: int, data: st.DataObject
) -> None:
    rest = list(range(1000, 1000 + data.draw(st.integers(0, n))))
    parts = [rest_batches(rest, world, rank, batch) for rank in range(world)]
    steps = math.ceil(len(rest) / (world * batch))
    assert all(len(p) == steps for p in parts)  # DDP and FSDP pair the ranks' steps
    assert all(1 <= len(b) <= batch for p in parts for b in p)
    seen = Counter(i for p in parts for b in p for i in b)
    assert set(seen) == set(rest)
    if len(rest) >= world and (batch > 1 or len(rest) % world == 0):
        assert all(count == 1 for count in seen.values()), seen  # exactly once
    else:  # the documented corners: fewer samples than ranks, or batches of one
        assert sum(seen.values()) == steps * world
