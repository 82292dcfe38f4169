"""Property tests: any nesting of tensors, arrays and plain values survives an object frame."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nn_handler.distributed.communicator import _objects

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int8, torch.int64, torch.bool]

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
tensors = st.builds(
    lambda dtype, shape, seed: (
        torch.rand(shape, generator=torch.Generator().manual_seed(seed)) * 100
    ).to(dtype),
    st.sampled_from(DTYPES),
    shapes,
    st.integers(0, 2**16),
)
arrays = st.builds(
    lambda n, k: np.arange(n, dtype=np.float32) * k, st.integers(0, 50), st.floats(-2, 2)
)
leaves = st.one_of(tensors, arrays, st.integers(), st.text(max_size=5), st.binary(max_size=100))
values = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=3), inner, max_size=4)
    ),
    max_leaves=12,
)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


@settings(max_examples=80, deadline=None)
@given(values, st.integers(0, 3))
def test_a_frame_gives_back_what_was_pickled(value: Any, pad: int) -> None:
    frame, error = _objects.dumps(value)
    assert error is None
    assert frame.length % _objects.ALIGN == 0
    out = np.full(frame.length + pad * _objects.ALIGN, 255, dtype=np.uint8)  # padded, dirty tail
    frame.write_into(out)
    assert _same(_objects.loads(out), value)


def test_an_unpicklable_object_gives_its_error_text_as_the_stream() -> None:
    import threading

    frame, error = _objects.dumps({"lock": threading.Lock()})
    assert isinstance(error, TypeError)
    out = np.zeros(frame.length, dtype=np.uint8)
    frame.write_into(out)
    assert b"lock" in _objects.read_stream(out)


def test_tensors_arrive_aligned_as_views_of_the_received_buffer() -> None:
    frame, _ = _objects.dumps([torch.ones(3), torch.ones(5, dtype=torch.float64)])
    out = torch.zeros(frame.length, dtype=torch.uint8)
    frame.write_into(out.numpy())
    first, second = _objects.loads(out.numpy())
    base = out.data_ptr()
    for tensor in (first, second):
        assert base <= tensor.data_ptr() < base + frame.length, "a view, not a copy"
        assert (tensor.data_ptr() - base) % _objects.ALIGN == 0
