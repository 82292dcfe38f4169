"""The step anatomy's arithmetic: shares of the wall time, and which verdict a set of ranks
gets."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nn_handler.monitoring import DOMINANT, StepTimes, verdict
from nn_handler.monitoring.anatomy import ADVICE, PARTS, advice

seconds = st.floats(min_value=0.0, max_value=1e4, allow_nan=False)
times = st.builds(
    StepTimes,
    steps=st.integers(min_value=0, max_value=10_000).map(float),
    wall=seconds,
    data=seconds,
    compute=seconds,
    comm=seconds,
    checkpoint=seconds,
)
share = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
rank_shares = st.fixed_dictionaries({part: share for part in PARTS})


@given(times)
def test_shares_are_fractions_of_the_wall_time(step_times: StepTimes) -> None:
    shares = step_times.shares()
    assert set(shares) == set(PARTS)
    for part, value in shares.items():
        assert 0.0 <= value <= 1.0
        if step_times.wall > 0 and getattr(step_times, part) <= step_times.wall:
            assert abs(value * step_times.wall - getattr(step_times, part)) <= 1e-9 * max(
                step_times.wall, 1.0
            )
    assert StepTimes.from_list(step_times.as_list()) == step_times


@given(st.lists(rank_shares, min_size=1, max_size=8), st.booleans())
def test_the_verdict_names_the_first_dominant_cause_on_its_worst_rank(
    ranks: list[dict[str, float]], cuda: bool
) -> None:
    line = verdict(ranks, cuda)
    dominant = [part for part in ADVICE if any(r[part] >= DOMINANT for r in ranks)]
    if not dominant:  # compute (or nothing) dominates: nothing to say
        assert line is None
        return
    part = dominant[0]  # data before checkpoints before communication
    worst = max(r[part] for r in ranks)
    rank = next(i for i, r in enumerate(ranks) if r[part] == worst)
    assert line is not None
    bound = "communication" if part == "comm" else part
    assert line.startswith(f"{bound}-bound: {worst:.0%} of the step {ADVICE[part][0]}")
    assert line.endswith(advice(part, cuda))
    assert ("pin_memory" in line) == (cuda and part == "data")  # pinning helps CUDA only
    assert (f" on rank {rank};" in line) == (len(ranks) > 1)


def test_checkpoint_advice_is_what_the_run_does_not_do_already() -> None:
    ranks = [{"data": 0.0, "compute": 0.3, "comm": 0.0, "checkpoint": 0.6}]
    plain, background = verdict(ranks), verdict(ranks, background_saves=True)
    assert plain is not None and plain.endswith("use sharded checkpoints with async_save")
    assert background is not None and "async_save" not in background
    assert background.endswith(
        "save less often (every_n_steps), or a faster disk (or store) for checkpoint.dir"
    )


def test_a_straggler_waiting_for_data_is_named_before_the_ranks_waiting_for_it() -> None:
    # Rank 1 waits for its batches; rank 0 waits for rank 1 in the gradient reduction.
    ranks = [
        {"data": 0.01, "compute": 0.09, "comm": 0.9, "checkpoint": 0.0},
        {"data": 0.8, "compute": 0.1, "comm": 0.05, "checkpoint": 0.0},
    ]
    assert verdict(ranks, cuda=True) == (
        "data-bound: 80% of the step waiting for batches on rank 1; raise num_workers, "
        "pin_memory, or use rank-cached loading (loader mode rank_cached)"
    )
    assert verdict(ranks) == (
        "data-bound: 80% of the step waiting for batches on rank 1; raise num_workers, or "
        "use rank-cached loading (loader mode rank_cached)"
    )
