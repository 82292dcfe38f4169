"""The reproducible mode's gradient seam in one process (strategies/exact_gradients.py,
strategies/fsdp_gradients.py; the sharded sum itself runs in real groups in
tests/distributed/test_reproducible_sharded.py): the replicated side's contract, and each error
the sharded side and its filler passes raise, naming the culprit and the way out."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler.config.training import ReproducibleConfig
from nn_handler.data.fixed_batches import MicroBatch, StepBatch
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.errors import ConfigError
from nn_handler.strategies.exact_gradients import ReplicatedGradients
from nn_handler.strategies.fsdp_gradients import ShardedGradients, _sharding
from nn_handler.training.reproducible.exact_step import ExactStep


def test_replicated_gradients_read_sum_and_assign_whole_tensors() -> None:
    model = nn.Linear(3, 2)
    params = list(model.parameters())
    side = ReplicatedGradients(params)
    assert side.local_numels == [6, 2] and side.collectives_per_sum == 1 and not side.balanced
    assert [tuple(g.shape) for g in side.gradients()] == [(2, 3), (2,)]  # zeros: no grad yet
    model(torch.ones(1, 3)).sum().backward()
    assert torch.equal(side.gradients()[0], params[0].grad)  # type: ignore[arg-type]
    vector = torch.arange(10, dtype=torch.int64)
    assert side.sum_(vector, 2, NullCommunicator()) is vector  # one process: the sum is itself
    flat = torch.arange(8, dtype=torch.float32)
    side.assign(flat)
    assert torch.equal(params[0].grad, flat[:6].view(2, 3))  # type: ignore[arg-type]
    side.clear()
    assert all(p.grad is None for p in params) and side.held_bytes() == 0


def test_parameters_fsdp2_does_not_shard_are_named() -> None:
    model = nn.Linear(3, 2)  # no fully_shard: none of its parameters is FSDP2's
    with pytest.raises(ConfigError, match=r"trained parameters \[0, 1\] .* not sharded by FSDP2"):
        ShardedGradients(model, list(model.parameters()))


def test_a_model_with_nothing_to_train_is_refused_when_sharded() -> None:
    with pytest.raises(ConfigError, match="no sharded parameter to train"):
        ShardedGradients(nn.Linear(3, 2), [])


def test_a_parameter_sharded_on_another_dim_is_refused() -> None:
    owner: Any = SimpleNamespace(fsdp_placement=SimpleNamespace(dim=1))
    with pytest.raises(ConfigError, match=r"shape \(4, 6\) is sharded on dim 1.*dim-0"):
        _sharding(nn.Parameter(torch.zeros(4, 6)), owner, 2, 0)


@pytest.mark.parametrize(
    ("rows", "shards", "rank", "held"),
    [(6, 4, 0, 2), (6, 4, 2, 2), (6, 4, 3, 0), (8, 3, 2, 2), (1, 2, 1, 0)],
)
def test_the_shard_layout_follows_fsdp2s_dim_0_chunks(
    rows: int, shards: int, rank: int, held: int
) -> None:
    """ceil(rows / shards) rows a chunk, the last ones shorter or empty (torch.chunk's cut)."""
    owner: Any = SimpleNamespace(fsdp_placement=SimpleNamespace(dim=0))
    found = _sharding(nn.Parameter(torch.zeros(rows, 5)), owner, shards, rank)
    expected = len(torch.zeros(rows).chunk(shards)[rank]) if rank < len(
        torch.zeros(rows).chunk(shards)) else 0  # fmt: skip
    assert (found.rows, found.cols, found.padded, found.held) == (rows, 5, -(-rows // shards), held)
    assert found.held == expected


class _Sharded(ReplicatedGradients):
    """Replicated gradients that ask for as many passes on every rank as a sharded side."""

    balanced = True


def test_fewer_micro_batches_than_ranks_is_refused_when_sharded() -> None:
    config = ReproducibleConfig(global_batch_size=4, micro_batch_size=4)
    comm: Any = SimpleNamespace(world_size=2, rank=1)
    step = ExactStep(config, nn.Linear(3, 2), comm, torch.device("cpu"))
    params = list(step.module.parameters())
    with pytest.raises(ConfigError, match=r"a step has 1 micro-batches .* for 2 ranks"):
        step.adopt(params, _Sharded(params))  # type: ignore[arg-type]


def test_a_rank_with_no_micro_batch_and_none_seen_names_itself_and_the_fix() -> None:
    """Resumed at a short step that gives rank 1 nothing, before it ever had a micro-batch:
    it cannot run the filler pass the others gather parameters for."""
    config = ReproducibleConfig(global_batch_size=8, micro_batch_size=4)
    comm: Any = SimpleNamespace(world_size=2, rank=1)
    step = ExactStep(config, nn.Linear(3, 2), comm, torch.device("cpu"))
    params = list(step.module.parameters())
    step.adopt(params, _Sharded(params))  # type: ignore[arg-type]
    short = StepBatch(step=5, micro=(), samples=8)  # two micro-batches: rank 0 runs both
    with pytest.raises(ConfigError, match=r"rank 1 owns no micro-batch of step 7 and has seen"):
        step._fill(short, lambda batch: torch.zeros(()), 7)
    seen = StepBatch(step=0, micro=(MicroBatch(1, 4, torch.ones(4, 3)),), samples=8)
    calls: list[Any] = []

    def forward_backward(batch: Any) -> torch.Tensor:
        calls.append(batch)
        return torch.zeros(())

    step._fill(seen, forward_backward, 0)
    assert calls == []  # one micro-batch each: no filler
    step._fill(short, forward_backward, 7)
    assert len(calls) == 1 and torch.equal(calls[0], torch.ones(4, 3))  # the one it saw


def test_a_gradient_that_outgrows_its_scale_is_summed_again_and_nan_skips() -> None:
    """The kept scale is used without a host check before the sum: a step whose gradients
    grow a billionfold makes meaningless integers first, and the agreed maxima then sum it
    again at new scales (the result is the float64 gradient); a NaN gradient gives NaN."""
    config = ReproducibleConfig(global_batch_size=8, micro_batch_size=4)
    model = nn.Linear(3, 2)
    step = ExactStep(config, model, NullCommunicator(), torch.device("cpu"))
    step.adopt(list(model.parameters()))
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    batch = StepBatch(step=0, micro=(MicroBatch(0, 4, x[:4]), MicroBatch(1, 4, x[4:])), samples=8)
    for index, factor in enumerate([1.0, 2.0, 1e9, math.nan, 3.0]):

        def forward_backward(micro: Any, factor: float = factor) -> torch.Tensor:
            loss = factor * model(micro).pow(2).mean()
            loss.backward()
            return loss.detach()

        rescaled = step.rescaled_steps
        loss = step.run(batch, forward_backward, index)
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        if math.isnan(factor):
            assert all(bool(g.isnan().all()) for g in grads)
            continue
        # The reference: each micro-batch's float32 gradient, their mean in float64.
        expected = [torch.zeros_like(g, dtype=torch.float64) for g in grads]
        for micro in batch.micro:
            twin = copy.deepcopy(model)
            twin.zero_grad(set_to_none=True)
            (factor * twin(micro.batch).pow(2).mean()).backward()
            for total, p in zip(expected, twin.parameters(), strict=True):
                total += micro.size * p.grad.double() / batch.samples  # type: ignore[union-attr]
        for got, want in zip(grads, expected, strict=True):
            # Fixed point keeps at least 35 bits of a tensor's largest element.
            small = 2.0**-30 * float(want.abs().max())
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=small)
        with torch.no_grad():
            expected = factor * float(model(x).pow(2).mean())
        assert math.isclose(float(loss), expected, rel_tol=1e-6)
        # The first step sets the scales; 1e9 outgrows them; 3.0 after it is too coarse.
        assert step.rescaled_steps == rescaled + (factor in (1e9, 3.0)), factor


@pytest.mark.parametrize("micro", [1, 2, 4])
def test_one_accumulator_whatever_the_micro_batches_and_the_passes_it_takes(micro: int) -> None:
    """The micro-batches' gradients go into one int64 accumulator as their backwards end:
    the buffers a step holds do not grow with the micro-batches a rank runs. A run's first
    step passes twice (the maxima agreed first), a step at the kept scale once, a step that
    outgrew it twice; each pass over the same micro-batches gives the same gradients."""
    config = ReproducibleConfig(global_batch_size=8, micro_batch_size=8 // micro)
    model = nn.Linear(3, 2)
    step = ExactStep(config, model, NullCommunicator(), torch.device("cpu"))
    step.adopt(list(model.parameters()))
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(1))
    size = 8 // micro
    batch = StepBatch(
        step=0,
        micro=tuple(MicroBatch(i, size, x[i * size : (i + 1) * size]) for i in range(micro)),
        samples=8,
    )
    calls: list[int] = []
    for index, factor in enumerate([1.0, 1.5, 1e9]):

        def forward_backward(batch: Any, factor: float = factor, at: int = index) -> torch.Tensor:
            calls.append(at)
            loss = factor * model(batch).pow(2).mean()
            loss.backward()
            return loss.detach()

        step.run(batch, forward_backward, index)
    assert [calls.count(i) for i in range(3)] == [2 * micro, micro, 2 * micro]
    numel = sum(p.numel() for p in model.parameters())
    # int64 sum (+ slots) and float64 workspace, nothing per element beyond them (the scales
    # are one float per tensor); a slot row per micro-batch: its samples, its loss, a maximum
    # per tensor (no BatchNorm)
    slots = config.micro_batches * (2 + len(list(model.parameters())))
    assert step.held_bytes() == 8 * (numel + slots) + 8 * numel
