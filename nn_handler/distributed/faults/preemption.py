"""SIGTERM and Ctrl-C handling: remember the signal, and let every rank agree when to stop.

SLURM and torchrun send SIGTERM before they kill a job; a user stops a run with Ctrl-C
(SIGINT, sent to every process of the terminal's foreground group, torchrun's workers
included). The handler only sets a flag; a second Ctrl-C raises KeyboardInterrupt at once. At
check steps the ranks reduce their flags, so they all stop after the same step even when only
one of them received the signal. The reduction is asynchronous (read at the next check) and the
checks are spaced to about ``interval_s`` seconds apart, with the spacing itself agreed in the
same reduction: fault tolerance costs one tiny all_reduce per interval, not one per step.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from collections.abc import Mapping
from types import FrameType, TracebackType
from typing import Any

import torch
from loguru import logger

from nn_handler.distributed.communicator import Communicator
from nn_handler.distributed.communicator.base import Waiter
from nn_handler.distributed.faults.notice import NoticePoller, NoticeSource, notice_from
from nn_handler.errors import TrainingPreempted
from nn_handler.log import process_name

MAX_STEPS_BETWEEN_CHECKS = 10_000
#: Seconds a preempted process shields its shutdown from further SIGTERMs (torchrun waits up
#: to 30 s after its SIGTERM before it sends SIGKILL).
SHUTDOWN_GRACE_S = 20.0


#: The emergency save's budget where none is configured: Kubernetes gives a pod 30 s between
#: SIGTERM and SIGKILL by default (terminationGracePeriodSeconds), and the ranks still have to
#: agree and exit; elsewhere (SLURM's --signal lead time, a spot notice) more is usual.
KUBERNETES_BUDGET_S = 25.0
DEFAULT_BUDGET_S = 120.0


def preemption_budget(configured: float | None, env: Mapping[str, str]) -> float:
    """The emergency checkpoint's time budget: ``configured``, else 25 s in a Kubernetes pod
    (``KUBERNETES_SERVICE_HOST`` set) and 120 s elsewhere."""
    if configured is not None:
        return configured
    return KUBERNETES_BUDGET_S if "KUBERNETES_SERVICE_HOST" in env else DEFAULT_BUDGET_S


#: The flag values each rank contributes (max-reduced: an interrupt outranks a preemption).
_NONE, _SIGTERM, _SIGINT = 0, 1, 2


class PreemptionWatch:
    """A SIGTERM (and, with ``interrupt``, SIGINT) flag plus the collective check of it; use
    as a context manager around the loop (it installs the handlers on entry and restores the
    previous ones on exit). ``notice``: a preemption notice source besides the signal (a file
    path, an http(s) URL or a callable; notice.py), polled every ``notice_interval_s`` seconds
    in a thread while the watch is on, and treated as a SIGTERM.

    Attributes:
        requested: this rank received SIGTERM or a first Ctrl-C.
        interrupted: this rank received a Ctrl-C.
        agreed_interrupt: after ``agreed`` returned True, whether any rank's stop was a
            Ctrl-C (the same on every rank), rather than SIGTERM alone.
        hold: in one process, a stop asked for waits while this is True (a fault-tolerant
            member's, set at each vote: a preemption that came after the vote said the member
            stays waits for the next step's, which says it leaves).
    """

    def __init__(
        self,
        communicator: Communicator,
        device: torch.device,
        interval_s: float,
        interrupt: bool = False,
        notice: str | NoticeSource | None = None,
        notice_interval_s: float = 5.0,
    ) -> None:
        self.comm = communicator
        self._poller: NoticePoller | None = None
        if notice is not None:
            source, self._notice_name = notice_from(notice)
            self._poller = NoticePoller(source, notice_interval_s, self._on_notice)
        self.device = device
        self.interval_s = interval_s
        self.interrupt = interrupt
        self.requested = False
        self.interrupted = False
        self.agreed_interrupt = False
        self.hold = False
        self._previous: Any = None
        self._previous_sigint: Any = None
        self._installed = False
        self._pending: Waiter | None = None
        self._next_check = 0
        self._last: tuple[int, float] | None = None
        self._pid = os.getpid()

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a forked child (a DataLoader worker): not ours
            _deliver_default(signum)
            return
        if signum == signal.SIGINT:
            self._on_interrupt()
            return
        if not self.requested:
            logger.bind(rank=self.comm.rank).warning(
                "{} received SIGTERM: stopping soon, with a checkpoint",
                process_name(self.comm.rank),
            )
        self.requested = True

    def _on_notice(self) -> None:
        """A preemption notice (notice.py), from the poller's thread: as a SIGTERM."""
        if not self.requested:
            logger.bind(rank=self.comm.rank).warning(
                "{} got a preemption notice from {}: stopping soon, with a checkpoint",
                process_name(self.comm.rank),
                self._notice_name,
            )
        self.requested = True

    def _on_interrupt(self) -> None:
        if self.interrupted:  # the second Ctrl-C: stop now, without a checkpoint
            signal.signal(signal.SIGINT, self._previous_sigint)
            raise KeyboardInterrupt
        self.interrupted = self.requested = True
        logger.bind(rank=self.comm.rank).warning(
            "{} received Ctrl-C: stopping after this step with a checkpoint "
            "(press Ctrl-C again to stop at once, without one)",
            process_name(self.comm.rank),
        )

    def __enter__(self) -> PreemptionWatch:
        if self._poller is not None:
            self._poller.start()
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
            if self.interrupt:
                self._previous_sigint = signal.signal(signal.SIGINT, self._on_signal)
            self._installed = True
        else:
            logger.bind(rank=self.comm.rank).warning(
                "training runs outside the main thread: SIGTERM cannot be caught, so a "
                "preemption will not write an emergency checkpoint (where the launcher "
                "restarts from its own latest checkpoint, as Ray Train does, set "
                "checkpoint.handle_sigterm=False)"
            )
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._poller is not None:
            self._poller.stop()
        if self._installed:
            if self.interrupt and signal.getsignal(signal.SIGINT) == self._on_signal:
                signal.signal(signal.SIGINT, self._previous_sigint)
            if isinstance(exc, TrainingPreempted):
                # The process is on its way out with its checkpoint: a launcher that stops
                # the other workers when the first exits (torchrun, also on Ctrl-C) must not
                # cut this one's shutdown short, so further SIGTERMs wait for it, for a while.
                ShutdownShield(self._previous, self.comm.rank).install()
            else:
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
            self.agreed_interrupt = self.interrupted
            return self.requested and not self.hold
        if not force and global_step < self._next_check:
            return False
        kind, spacing = self._collect()
        if force:
            kind = max(kind, int(self._reduce(global_step)()[0].item()))
            self._next_check = global_step + 1
        else:
            self._pending = self._reduce(global_step)
            self._next_check = global_step + spacing
        self.agreed_interrupt = kind == _SIGINT
        return kind != _NONE

    def _reduce(self, global_step: int) -> Waiter:
        now = time.perf_counter()
        proposal = 1
        if self._last is not None and global_step > self._last[0]:
            per_step = max((now - self._last[1]) / (global_step - self._last[0]), 1e-6)
            proposal = int(min(max(self.interval_s / per_step, 1), MAX_STEPS_BETWEEN_CHECKS))
        self._last = (global_step, now)
        # max-reduce [flag, -proposal]: any rank's flag (an interrupt outranks a SIGTERM), and
        # the smallest proposed spacing.
        flag = _SIGINT if self.interrupted else _SIGTERM if self.requested else _NONE
        values = torch.tensor([float(flag), -float(proposal)], device=self.device)
        return self.comm.all_reduce_async(values, op="max")

    def _collect(self) -> tuple[int, int]:
        pending, self._pending = self._pending, None
        if pending is None:
            return _NONE, 1
        flag, negative = pending().tolist()
        return int(flag), max(int(-negative), 1)


class ShutdownShield:
    """The SIGTERM handler of a preempted process: signals within ``grace_s`` of the
    preemption are logged and ignored (the process is already exiting, with its checkpoint);
    a later one restores the previous handler and is delivered again, so a process that
    lingers can still be stopped. Once the interpreter exits, SIGTERM is ignored outright
    (SIGKILL, which launchers send after their grace period, still ends it)."""

    def __init__(self, previous: Any, rank: int, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        self.previous = previous
        self.rank = rank
        self.deadline = time.monotonic() + grace_s
        self.pid = os.getpid()

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        # Python puts its own handlers back to the default while the interpreter shuts down
        # (torch's teardown runs after that), but leaves an ignored signal ignored.
        atexit.register(self._ignore_while_exiting)

    def _ignore_while_exiting(self) -> None:
        if os.getpid() == self.pid and signal.getsignal(signal.SIGTERM) == self._on_signal:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self.pid:  # a forked child: not the process that is shutting down
            _deliver_default(signum)
            return
        if time.monotonic() < self.deadline:
            logger.bind(rank=self.rank).info(
                "rank {} received SIGTERM while exiting after its preemption checkpoint: "
                "finishing the shutdown first",
                self.rank,
            )
            return
        signal.signal(signal.SIGTERM, self.previous)
        os.kill(os.getpid(), signal.SIGTERM)


def _deliver_default(signum: int) -> None:
    """Act on ``signum`` as if no handler were installed (in a forked child that inherited
    one: it must still stop when its parent terminates it)."""
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


__all__ = [
    "DEFAULT_BUDGET_S",
    "KUBERNETES_BUDGET_S",
    "MAX_STEPS_BETWEEN_CHECKS",
    "SHUTDOWN_GRACE_S",
    "PreemptionWatch",
    "ShutdownShield",
    "preemption_budget",
]
