"""save_top_k's bookkeeping (checkpoint/top_k.py): after any sequence of values, the kept
names are the k best seen (ties: the earlier ahead), each one that falls out is reported
once, and a NaN is never kept."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nn_handler.checkpoint.top_k import TopK, top_name
from nn_handler.errors import CheckpointError

values = st.lists(
    st.one_of(st.sampled_from([0.0, 1.0, 2.0, math.nan]), st.floats(-5, 5)), max_size=30
)


@given(values=values, k=st.integers(1, 5), mode=st.sampled_from(["min", "max"]))
def test_the_kept_are_the_k_best_and_every_drop_is_reported_once(
    values: list[float], k: int, mode: str
) -> None:
    top = TopK(k, mode)
    kept_ever: list[str] = []
    dropped: list[str] = []
    for index, value in enumerate(values):
        if top.admits(value):
            name = top_name("val_loss", 0.0, index, index, sharded=False)
            kept_ever.append(name)
            dropped += top.add(value, name)
    finite = [(v, i) for i, v in enumerate(values) if not math.isnan(v)]
    sign = 1.0 if mode == "min" else -1.0
    expected = sorted(finite, key=lambda pair: (sign * pair[0], pair[1]))[:k]
    assert top.names() == [top_name("val_loss", 0.0, i, i, sharded=False) for _, i in expected]
    assert sorted(dropped + top.names()) == sorted(kept_ever)  # each kept once, then dropped
    assert len(set(dropped)) == len(dropped)
    copy = TopK(k, mode)
    copy.load_state_dict(top.state_dict())
    assert copy.entries == top.entries


@given(monitor=st.text(min_size=1, max_size=20), value=st.floats(allow_nan=False))
def test_a_top_name_is_one_plain_file_name(monitor: str, value: float) -> None:
    name = top_name(monitor, value, 3, 120, sharded=False)
    assert name.startswith("top-e0003-s00000120-") and name.endswith(".pt")
    assert "/" not in name and "\\" not in name and "\0" not in name
    top = TopK(2, "min")
    top.load_state_dict([[value, name]])  # what a checkpoint keeps loads back
    assert top.names() == [name]


@pytest.mark.parametrize(
    "state",
    [
        [[0.1, "../../home/user/.bashrc"]],
        [[0.1, "top-e0001-s00000005-val_loss=0.1.pt/../../x"]],
        [[0.1, "ckpt-e0001-s00000005.pt"]],
        [["0.1", "top-e0001-s00000005-val_loss=0.1.pt"]],
        [[0.1]],
        "top-e0001-s00000005-val_loss=0.1.pt",
    ],
)
def test_a_checkpoints_top_k_names_outside_the_pattern_are_refused(state: object) -> None:
    """The names are deleted from the folder when they fall out of the k: a corrupt or
    crafted checkpoint must not name a path outside it."""
    with pytest.raises(CheckpointError, match=r"top_k entry .* is not \(value, top-k file name\)"):
        TopK(2, "min").load_state_dict(state)
