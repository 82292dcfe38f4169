"""ShutdownShield: a preempted process ignores SIGTERM during its grace period, then hands the
signal back to the previous handler; a forked child never keeps it."""

from __future__ import annotations

import os
import signal
import time
from types import FrameType

from nn_handler.distributed.faults.preemption import ShutdownShield


def test_sigterm_is_ignored_during_the_grace_period_then_handed_back() -> None:
    seen: list[int] = []

    def previous(signum: int, frame: FrameType | None) -> None:
        seen.append(signum)

    original = signal.getsignal(signal.SIGTERM)
    try:
        shield = ShutdownShield(previous, rank=0, grace_s=60.0)
        shield.install()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert seen == [] and signal.getsignal(signal.SIGTERM) == shield._on_signal
        shield.deadline = time.monotonic() - 1  # the grace period is over
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert seen == [signal.SIGTERM], "the signal was not handed back"
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, original)


def test_a_forked_child_that_inherited_the_shield_still_dies_of_sigterm() -> None:
    original = signal.getsignal(signal.SIGTERM)
    try:
        ShutdownShield(signal.SIG_DFL, rank=0, grace_s=60.0).install()
        pid = os.fork()
        if pid == 0:  # the child: the shield is its parent's, so SIGTERM ends it
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, original)
