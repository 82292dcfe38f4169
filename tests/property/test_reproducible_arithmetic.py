"""Properties of the reproducible mode's pure parts: the fixed-point sum does not depend on how
its terms are split over ranks or ordered, keeps the precision it promises, and the fixed
batches of a step are the same samples, each run by exactly one rank, at any world size."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_handler.data.fixed_batches import epoch_order, micro_batches, owns, steps_per_epoch
from nn_handler.training.reproducible import fixed_point

floats = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)


def _sum(terms: list[torch.Tensor], weights: list[int], scale: fixed_point.Scale) -> torch.Tensor:
    total = torch.zeros(terms[0].numel(), dtype=torch.int64)
    for values, weight in zip(terms, weights, strict=True):
        total += fixed_point.quantize(values, weight, scale.per_element)
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
    numels = torch.tensor([2, 3])  # two tensors of 2 and 3 elements
    scale = fixed_point.Scale(terms=8, device=torch.device("cpu"))
    scale.numels = numels
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
    value = fixed_point.dequantize(whole, scale.factors(count))
    tolerance = len(terms) * 0.5 * scale.factors(count) * (1 + 1e-12) + 1e-300
    assert bool(((value - exact).abs() <= tolerance).all())


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=8),
    st.integers(1, 2**12),
    st.integers(1, 2**12),
    st.integers(-60, 60),
)
def test_a_scale_that_holds_the_usual_weight_quantises_every_weight_to_the_same_integers(
    values: list[float], weight: int, unit: int, exponent: int
) -> None:
    """``Scale.per_element`` holds the unit weight (a micro-batch's samples) to save a
    multiply; a term of any weight still becomes ``round(values * weight * 2**e)`` exactly."""
    tensor = torch.tensor(values, dtype=torch.float32)
    plain = fixed_point.Scale(terms=8, device=torch.device("cpu"))
    held = fixed_point.Scale(terms=8, device=torch.device("cpu"), unit=unit)
    for scale in (plain, held):
        scale.numels = torch.tensor([len(values)])
        scale.set(torch.tensor([exponent]))
    expected = torch.round(tensor.double() * weight * 2.0**exponent)  # exact: 53 bits
    found = fixed_point.scaled(tensor, weight, held.per_element, unit=unit)
    assert found.view(torch.int64).tolist() == expected.view(torch.int64).tolist()
    assert torch.equal(
        fixed_point.quantize(tensor, weight, held.per_element, unit=unit),
        fixed_point.quantize(tensor, weight, plain.per_element),
    )


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
