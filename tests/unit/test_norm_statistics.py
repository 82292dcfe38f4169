"""NormStatistics, the reproducible mode's BatchNorm statistics, against the law of total
variance written out per layer: a step's micro-batches move each layer's running statistics
once, by the statistics of all their samples together, with the layer's momentum (or the
cumulative average of ``momentum=None``); a layer that did not run keeps its statistics and
its count; a failed step leaves everything as it was. And the fused largest magnitudes the
scales are set from, on the CPU and on a GPU (NaN must reach the maxima: the step skips)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler.training.reproducible.fixed_point import largest_magnitudes
from nn_handler.training.reproducible.norm_statistics import NormStatistics
from tests.conftest import cuda_only

SIZES = [5, 3, 2]  # samples of the step's micro-batches


def _layers() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.BatchNorm1d(3, momentum=0.25),
        nn.BatchNorm1d(2, momentum=None),  # a cumulative average
        nn.BatchNorm1d(4),  # does not run in this step
    ).double()
    model[1].num_batches_tracked.fill_(3)
    model[1].running_mean.fill_(0.5)
    model[2].running_var.fill_(2.0)
    return model


def _step(model: nn.Sequential, inputs: list[list[torch.Tensor]]) -> NormStatistics:
    """One step over micro-batches of ``inputs`` (per micro-batch, layer 0's and 1's)."""
    norms = NormStatistics(model)
    norms.begin_step()
    stats, counts = [], []
    for first, second in inputs:
        model[0](first)
        model[1](second)
        values, elements = norms.after_micro()
        stats.append(values)
        counts.append(elements)
    norms.end_step(torch.stack(stats).double(), torch.tensor(counts, dtype=torch.float64))
    return norms


def _expected(before: nn.BatchNorm1d, samples: torch.Tensor, factor: float) -> tuple[Any, Any]:
    mean = samples.mean(0)
    var = samples.var(0, unbiased=True)
    return (
        (1 - factor) * before.running_mean + factor * mean,
        (1 - factor) * before.running_var + factor * var,
    )


def test_a_step_moves_each_layer_once_by_all_its_samples() -> None:
    model = _layers()
    before = [nn.BatchNorm1d(1).double() for _ in range(3)]
    for copy, layer in zip(before, model, strict=True):
        copy.running_mean = layer.running_mean.clone()
        copy.running_var = layer.running_var.clone()
    generator = torch.Generator().manual_seed(1)
    inputs = [
        [torch.randn(n, 3, generator=generator, dtype=torch.float64) * 2 + 1,
         torch.randn(n, 2, generator=generator, dtype=torch.float64)]
        for n in SIZES
    ]  # fmt: skip
    norms = _step(model, inputs)
    assert not norms.in_step
    mean, var = _expected(before[0], torch.cat([x for x, _ in inputs]), 0.25)
    torch.testing.assert_close(model[0].running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model[0].running_var, var, rtol=1e-12, atol=1e-12)
    assert int(model[0].num_batches_tracked) == 1 and model[0].momentum == 0.25
    mean, var = _expected(before[1], torch.cat([y for _, y in inputs]), 1 / 4)  # 3 before
    torch.testing.assert_close(model[1].running_mean, mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(model[1].running_var, var, rtol=1e-12, atol=1e-12)
    assert int(model[1].num_batches_tracked) == 4 and model[1].momentum is None
    assert torch.equal(model[2].running_mean, torch.zeros(4))  # did not run: unchanged
    assert torch.equal(model[2].running_var, torch.full((4,), 2.0))
    assert int(model[2].num_batches_tracked) == 0 and model[2].momentum == 0.1


def test_a_failed_step_leaves_the_statistics_as_they_were() -> None:
    model = _layers()
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    norms = NormStatistics(model)
    norms.begin_step()
    model[0](torch.randn(4, 3, dtype=torch.float64))
    assert model[0].momentum == 1.0 and not torch.equal(
        model[0].running_mean, saved["0.running_mean"]
    )
    norms.abort()
    assert not norms.in_step and model[0].momentum == 0.25 and model[1].momentum is None
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key


def test_a_layer_that_runs_twice_in_one_forward_is_refused() -> None:
    model = _layers()
    norms = NormStatistics(model)
    norms.begin_step()
    model[0](torch.randn(4, 3, dtype=torch.float64))
    model[0](torch.randn(4, 3, dtype=torch.float64))
    with pytest.raises(Exception, match=r"BatchNorm layer '0' ran 2 times in one forward"):
        norms.after_micro()
    norms.abort()


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda_only])]
)
def test_largest_magnitudes_are_exact_and_carry_nan(device: str) -> None:
    nan, inf = math.nan, math.inf
    tensors = [
        torch.tensor([1.0, -3.5, 2.0]),
        torch.tensor([-2.0, nan, 0.5]),
        torch.zeros(0),
        torch.tensor([[-inf, 1.0]]),
        torch.tensor([0.1, -0.7], dtype=torch.bfloat16),
        torch.full((70000,), -1.0).index_fill_(0, torch.tensor([65537]), nan),  # many blocks
    ]
    found = largest_magnitudes([t.to(device) for t in tensors]).cpu()
    assert found.dtype == torch.float64
    assert found[0] == 3.5 and math.isnan(found[1]) and found[2] == 0.0 and found[3] == inf
    assert found[4] == float(torch.tensor(-0.7, dtype=torch.bfloat16).abs())
    assert math.isnan(found[5])
