"""SIGTERM handling: remember the signal, and let every rank agree when to stop.

SLURM and torchrun send SIGTERM before they kill a job. The handler only sets a flag; every
N optimizer steps the ranks all_reduce their flags, so they all stop after the same step even
when only one of them received the signal.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType
from typing import Any

import torch
from loguru import logger

from nn_handler.distributed.communicator import Communicator


class PreemptionWatch:
    """A SIGTERM flag plus the collective check of it; use as a context manager around the
    loop (it installs the handler on entry and restores the previous one on exit)."""

    def __init__(
        self, communicator: Communicator, device: torch.device, every_n_steps: int
    ) -> None:
        self.comm = communicator
        self.device = device
        self.every_n_steps = every_n_steps
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self.requested:
            logger.bind(rank=self.comm.rank).warning(
                "rank {} received SIGTERM: stopping after the current step, with a checkpoint",
                self.comm.rank,
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

    def agreed(self, global_step: int, force: bool = False) -> bool:
        """Whether any rank received SIGTERM, on every rank alike. Checks (one tiny all_reduce)
        every ``every_n_steps`` steps or when ``force``; every rank must call this at the same
        steps."""
        if not force and global_step % self.every_n_steps:
            return False
        if self.comm.world_size == 1:
            return self.requested
        flag = torch.tensor([int(self.requested)], device=self.device)
        return bool(self.comm.all_reduce(flag, op="max").item())


__all__ = ["PreemptionWatch"]
