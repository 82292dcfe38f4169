"""SIGTERM handling: remember the signal, and let every rank agree when to stop.

SLURM and torchrun send SIGTERM before they kill a job. The handler only sets a flag. At check
steps the ranks reduce their flags, so they all stop after the same step even when only one of
them received the signal. The reduction is asynchronous (read at the next check) and the
checks are spaced to about ``interval_s`` seconds apart, with the spacing itself agreed in the
same reduction: fault tolerance costs one tiny all_reduce per interval, not one per step.
"""

from __future__ import annotations

import signal
import threading
import time
from types import FrameType, TracebackType
from typing import Any

import torch
from loguru import logger

from nn_handler.distributed.communicator import Communicator
from nn_handler.distributed.communicator.base import Waiter

MAX_STEPS_BETWEEN_CHECKS = 10_000


class PreemptionWatch:
    """A SIGTERM flag plus the collective check of it; use as a context manager around the
    loop (it installs the handler on entry and restores the previous one on exit)."""

    def __init__(self, communicator: Communicator, device: torch.device, interval_s: float) -> None:
        self.comm = communicator
        self.device = device
        self.interval_s = interval_s
        self.requested = False
        self._previous: Any = None
        self._installed = False
        self._pending: Waiter | None = None
        self._next_check = 0
        self._last: tuple[int, float] | None = None

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            logger.bind(rank=self.comm.rank).warning(
                "rank {} received SIGTERM: stopping soon, with a checkpoint", self.comm.rank
            )
        self.requested = True

    def __enter__(self) -> PreemptionWatch:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            self._installed = True
        else:
            logger.bind(rank=self.comm.rank).warning(
                "training runs outside the main thread: SIGTERM cannot be caught, so a "
                "preemption will not write an emergency checkpoint"
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
        if exc_type is None:
            self._collect()  # every rank started it; finish it before the group moves on
        self._pending = None

    def agreed(self, global_step: int, force: bool = False) -> bool:
        """Whether any rank received SIGTERM, on every rank alike. Every rank must call this
        after every optimizer step (and with ``force`` at the end of each epoch).

        In one process the flag is read directly. Otherwise, at each check step every rank
        reads the reduction started at the previous check and starts a new one with its flag
        and its proposal for the next check's spacing (steps per ``interval_s``); the smallest
        proposal wins, so every rank checks at the same steps. ``force`` also reduces the
        current flags at once. Ranks stop at most about two intervals after a signal.
        """
        if self.comm.world_size == 1:
            return self.requested
        if not force and global_step < self._next_check:
            return False
        stop, spacing = self._collect()
        if force:
            stop = stop or bool(self._reduce(global_step)()[0].item() > 0)
            self._next_check = global_step + 1
            return stop
        self._pending = self._reduce(global_step)
        self._next_check = global_step + spacing
        return stop

    def _reduce(self, global_step: int) -> Waiter:
        now = time.perf_counter()
        proposal = 1
        if self._last is not None and global_step > self._last[0]:
            per_step = max((now - self._last[1]) / (global_step - self._last[0]), 1e-6)
            proposal = int(min(max(self.interval_s / per_step, 1), MAX_STEPS_BETWEEN_CHECKS))
        self._last = (global_step, now)
        # max-reduce [flag, -proposal]: any rank's flag, and the smallest proposed spacing.
        values = torch.tensor([float(self.requested), -float(proposal)], device=self.device)
        return self.comm.all_reduce_async(values, op="max")

    def _collect(self) -> tuple[bool, int]:
        pending, self._pending = self._pending, None
        if pending is None:
            return False, 1
        flag, negative = pending().tolist()
        return flag > 0, max(int(-negative), 1)


__all__ = ["MAX_STEPS_BETWEEN_CHECKS", "PreemptionWatch"]
