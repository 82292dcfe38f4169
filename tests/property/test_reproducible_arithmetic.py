"""Properties of the reproducible mode's pure parts: the fixed-point sum does not depend on how
its terms are split over ranks or ordered, keeps the precision it promises, and the fixed
batches of a step are the same samples, each run by exactly one rank, at any world size."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_handler.data.fixed_batches import epoch_order, micro_batches, owns, steps_per_epoch
from nn_handler.strategies.fsdp_gradients import Sharding, pack
from nn_handler.training.reproducible import fixed_point

floats = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)


def _sum(terms: list[torch.Tensor], weights: list[int], scale: fixed_point.Scale) -> torch.Tensor:
    """The fixed-point sum of ``terms`` (each two tensors of 2 and 3 elements, flattened)."""
    total = torch.zeros(terms[0].numel(), dtype=torch.int64)
    for values, weight in zip(terms, weights, strict=True):
        total += fixed_point.quantize([values[:2], values[2:]], scale.multipliers(weight))
    return total


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(floats, min_size=5, max_size=5), min_size=1, max_size=8),
    st.lists(st.integers(1, 64), min_size=8, max_size=8),
    st.randoms(use_true_random=False),
    st.integers(1, 4),
)
def test_the_sum_is_the_same_however_the_terms_are_split_and_ordered(
    rows: list[list[float]], weights: list[int], rng: object, world: int
) -> None:
    terms = [torch.tensor(row, dtype=torch.float32) for row in rows]
    weights = weights[: len(terms)]
    scale = fixed_point.Scale(terms=8, device=torch.device("cpu"))
    maxima = torch.stack([
        torch.stack([t[:2].abs().max() * w, t[2:].abs().max() * w])
        for t, w in zip(terms, weights, strict=True)
    ]).amax(0).double()  # fmt: skip
    scale.recenter(maxima)
    assert scale.fits(maxima) and scale.holds(maxima)
    whole = _sum(terms, weights, scale)
    # The same terms over ``world`` ranks (term j on rank j % world), each rank in its own
    # order, then summed over the ranks in a shuffled order.
    order = list(range(len(terms)))
    rng.shuffle(order)  # type: ignore[attr-defined]
    parts = []
    for rank in range(world):
        mine = [j for j in order if j % world == rank]
        if mine:
            parts.append(_sum([terms[j] for j in mine], [weights[j] for j in mine], scale))
    rng.shuffle(parts)  # type: ignore[attr-defined]
    assert torch.equal(sum(parts, torch.zeros_like(whole)), whole)
    # Precision: within half a unit of each term's last place, at least 35 bits of the max.
    count = sum(weights)
    exact = sum(t.double() * w for t, w in zip(terms, weights, strict=True)) / count
    value = fixed_point.dequantize(whole, [2, 3], scale.factors(count))
    unit = torch.tensor(scale.factors(count), dtype=torch.float64).repeat_interleave(
        torch.tensor([2, 3])
    )  # each element's 2**-e / count
    tolerance = len(terms) * 0.5 * unit * (1 + 1e-12) + 1e-300
    assert bool(((value - exact).abs() <= tolerance).all())


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=2, max_size=9),
    st.integers(1, 2**12),
    st.lists(st.integers(-60, 60), min_size=2, max_size=2),
    st.integers(1, 2**12),
)
def test_each_tensor_is_scaled_by_its_own_power_of_two_exactly(
    values: list[float], weight: int, exponents: list[int], divisor: int
) -> None:
    """``scaled`` multiplies each tensor by its ``weight * 2**e`` (one float per tensor) and
    rounds: exactly ``round(values * weight * 2**e)``; ``dequantize`` multiplies each tensor
    by its ``2**-e / divisor``, as a per-element multiply would."""
    tensor = torch.tensor(values, dtype=torch.float32)
    cut = len(values) // 2
    parts, sizes = [tensor[:cut], tensor[cut:]], [cut, len(values) - cut]
    scale = fixed_point.Scale(terms=8, device=torch.device("cpu"))
    scale.set(torch.tensor(exponents))
    per_element = torch.tensor([2.0**e for e in exponents], dtype=torch.float64)
    per_element = per_element.repeat_interleave(torch.tensor(sizes))
    expected = torch.round(tensor.double() * weight * per_element)  # exact: 53 bits
    out = torch.empty(len(values), dtype=torch.float64)
    found = fixed_point.scaled(parts, scale.multipliers(weight), out)
    assert found.view(torch.int64).tolist() == expected.view(torch.int64).tolist()
    whole = found.to(torch.int64)
    back = fixed_point.dequantize(whole, sizes, scale.factors(divisor))
    inverse = torch.ldexp(torch.ones(2, dtype=torch.float64), -torch.tensor(exponents)) / divisor
    element = whole.double() * inverse.repeat_interleave(torch.tensor(sizes))
    assert back.view(torch.int64).tolist() == element.view(torch.int64).tolist()


@given(st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), max_size=16))
def test_slots_carry_every_bit_through_a_sum_with_zeros(values: list[float]) -> None:
    """Only one rank fills a slot: the others add int64 zeros, which keep every bit (NaN
    payloads and -0.0 included)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    slots = fixed_point.as_slots(tensor) + torch.zeros(len(values), dtype=torch.int64)
    back = fixed_point.from_slots(slots)
    assert back.view(torch.int64).tolist() == tensor.view(torch.int64).tolist()


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 200),
    st.integers(1, 8),
    st.integers(1, 8),
    st.booleans(),
    st.integers(0, 3),
    st.integers(1, 9),
)
def test_a_steps_micro_batches_are_fixed_and_each_runs_on_one_rank(
    n: int, micro: int, per_step: int, shuffle: bool, epoch: int, world: int
) -> None:
    global_batch = micro * per_step
    if n < global_batch:
        return
    steps = steps_per_epoch(n, global_batch, drop_last=False)
    assert steps == math.ceil(n / global_batch)
    order = epoch_order(n, seed=5, epoch=epoch, shuffle=shuffle)
    assert sorted(order) == list(range(n))
    seen: list[int] = []
    for step in range(steps):
        cut = micro_batches(order, step, global_batch, micro)
        assert all(len(m) == micro for m in cut[:-1]) and 0 < len(cut[-1]) <= micro
        owners = [[rank for rank in range(world) if owns(j, rank, world)] for j in range(len(cut))]
        assert all(len(o) == 1 for o in owners)  # each micro-batch on exactly one rank
        seen += [i for m in cut for i in m]
    assert seen == order  # every sample once per epoch, in the epoch's order


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 9), st.integers(1, 4)), min_size=1, max_size=6),
    st.integers(1, 5),
)
def test_the_sharded_sum_packs_each_parameter_as_fsdp2_shards_it(
    shapes: list[tuple[int, int]], shards: int
) -> None:
    """``pack`` (the exact reduce-scatter's input, at most two copies a parameter) puts the
    same elements where one copy per parameter and shard does: shard r holds rows
    [r * padded, (r + 1) * padded) of each parameter, padded with zeros."""
    layout = [Sharding(rows, cols, -(-rows // shards), 0) for rows, cols in shapes]
    total = sum(rows * cols for rows, cols in shapes)
    width = sum(s.padded * s.cols for s in layout)
    vector = torch.arange(1, total + 1, dtype=torch.int64)
    found = torch.zeros((shards, width), dtype=torch.int64)
    assert pack(found, vector, layout) == total
    expected = torch.zeros((shards, width), dtype=torch.int64)
    start = offset = 0
    for s in layout:
        whole = vector[start : start + s.rows * s.cols].view(s.rows, s.cols)
        for r in range(shards):
            low, high = r * s.padded, min((r + 1) * s.padded, s.rows)
            if high > low:
                expected[r, offset : offset + (high - low) * s.cols] = whole[low:high].reshape(-1)
        start, offset = start + s.rows * s.cols, offset + s.padded * s.cols
    assert torch.equal(found, expected)
