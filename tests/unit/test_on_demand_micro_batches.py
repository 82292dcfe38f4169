"""FixedBatchLoader(on_demand=True) (a fault-tolerant member's loader): every micro-batch of a
step is yielded, and loaded only when first read, once, as the eager loader loads it."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import Dataset, TensorDataset

from nn_handler.data.fixed_batches import FixedBatchLoader


class Counted(Dataset[Any]):
    """A dataset that notes each index it is asked for."""

    def __init__(self, n: int) -> None:
        self.data = TensorDataset(torch.arange(n * 3.0).reshape(n, 3), torch.arange(n))
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Any:
        self.read.append(index)
        return self.data[index]


def _loader(data: Dataset[Any], on_demand: bool, **kwargs: Any) -> FixedBatchLoader:
    base: dict[str, Any] = {
        "global_batch_size": 8,
        "micro_batch_size": 3,
        "seed": 5,
        "shuffle": True,
        "drop_last": False,
        "rank": 0,
        "world_size": 1,
    }
    return FixedBatchLoader(data, on_demand=on_demand, **{**base, **kwargs})


def test_nothing_is_loaded_until_read_and_each_micro_batch_once() -> None:
    data = Counted(20)
    loader = _loader(data, on_demand=True)
    assert loader.on_demand
    steps = list(loader)
    assert [s.step for s in steps] == [0, 1, 2] and data.read == []
    assert [len(s.micro) for s in steps] == [3, 3, 2]  # 8 + 8 + 4 samples, micro-batches of 3
    late, early = steps[2].micro[1], steps[0].micro[0]
    assert not late.loaded
    first = late.batch  # out of order: a later step's micro-batch before an earlier one's
    assert late.loaded and len(data.read) == late.size == 1
    assert late.batch is first and len(data.read) == 1  # read again: not loaded again
    early.batch  # noqa: B018 (the read is the point)
    assert len(data.read) == 1 + early.size == 4


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 30),
    sizes=st.tuples(st.integers(1, 9), st.integers(1, 9)),
    seed=st.integers(0, 2**31),
    shuffle=st.booleans(),
    epoch=st.integers(0, 3),
    start=st.integers(0, 4),
)
def test_on_demand_batches_are_the_eager_loaders(
    n: int, sizes: tuple[int, int], seed: int, shuffle: bool, epoch: int, start: int
) -> None:
    """Any dataset size, global and micro batch, seed, epoch and starting step: the same
    steps, micro-batches and tensors; and the global random stream is left as it was."""
    micro, global_batch = min(sizes), max(sizes)
    kwargs = {"global_batch_size": global_batch, "micro_batch_size": micro, "seed": seed,
              "shuffle": shuffle}  # fmt: skip
    eager, lazy = (_loader(Counted(n), on_demand, **kwargs) for on_demand in (False, True))
    for loader in (eager, lazy):
        loader.set_epoch(epoch)
        loader.start_at(min(start, loader.steps))
    state = torch.get_rng_state()
    expected, got = list(eager), list(lazy)
    assert [(s.step, s.samples) for s in got] == [(s.step, s.samples) for s in expected]
    for want, have in zip(expected, got, strict=True):
        assert [(m.index, m.size) for m in have.micro] == [(m.index, m.size) for m in want.micro]
        for a, b in zip(want.micro, have.micro, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(a.batch, b.batch, strict=True))
    assert torch.equal(torch.get_rng_state(), state)


def test_with_workers_every_micro_batch_is_loaded_with_its_step() -> None:
    """Workers load ahead of the loop: on_demand asks for nothing they could not keep."""
    loader = _loader(Counted(20), on_demand=True, num_workers=1)
    assert not loader.on_demand
    assert not _loader(Counted(20), on_demand=False).on_demand
