"""How long a test may run before it counts as hung: a bound for hangs, not for slowness.

Every bound the suite sets (pytest-timeout's per test, the harness's per process group and
per launched command, and the few "within N seconds" checks) is multiplied by ``SCALE``:
``NN_HANDLER_TEST_TIMEOUT_SCALE`` when set (a CI machine shared with other work can set 3),
else measured when a test process starts: the runnable processes per core over the last
minute (the 1-minute load average over the cores), between 1 (a quiet machine: the bounds as
written) and 8. A machine at load 14 on 2 cores gives 7: the suite stays green, and a hang
still fails, only later.
"""

from __future__ import annotations

import os

MAX_SCALE = 8.0


def measured_scale() -> float:
    given = os.environ.get("NN_HANDLER_TEST_TIMEOUT_SCALE", "").strip()
    if given:
        return max(1.0, float(given))
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 1.0
    return min(MAX_SCALE, max(1.0, load / (os.cpu_count() or 1)))


SCALE = measured_scale()


def scaled(seconds: float) -> float:
    """``seconds`` as the bound to use on this machine (its load when the test process started)."""
    return seconds * SCALE


def scaled_now(seconds: float) -> float:
    """``seconds`` scaled by the larger of the load when the test process started and the load
    now: for a check made after a long run, which the load may have grown during (two suites
    at once: from 1 at the start to 5.5 per core)."""
    return seconds * max(SCALE, measured_scale())


__all__ = ["SCALE", "measured_scale", "scaled", "scaled_now"]
