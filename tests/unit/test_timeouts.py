"""The suite's time bounds scale with the machine's load (tests/timeouts.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests import timeouts


@given(st.floats(min_value=0.0, max_value=1000.0), st.integers(min_value=1, max_value=256))
def test_the_scale_is_the_load_per_core_between_1_and_8(load: float, cpus: int) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("NN_HANDLER_TEST_TIMEOUT_SCALE", raising=False)
        patch.setattr(timeouts.os, "getloadavg", lambda: (load, 0.0, 0.0))
        patch.setattr(timeouts.os, "cpu_count", lambda: cpus)
        scale = timeouts.measured_scale()
    assert 1.0 <= scale <= timeouts.MAX_SCALE
    assert scale == pytest.approx(min(8.0, max(1.0, load / cpus)))


def test_the_environment_variable_sets_the_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NN_HANDLER_TEST_TIMEOUT_SCALE", "3")
    assert timeouts.measured_scale() == 3.0
    monkeypatch.setenv("NN_HANDLER_TEST_TIMEOUT_SCALE", "0.5")  # never below the bounds
    assert timeouts.measured_scale() == 1.0
