"""ReductionTimer: how long each step's gradient reduction ran past the end of backward.

DDP launches one all-reduce per gradient bucket while backward is still computing the next
buckets' gradients; only what is left when backward ends (the *exposed* communication) costs
step time. A DDP communication hook (``DDPStrategy.timed_reductions``) notes when each bucket
was launched and when its reduction finished; ``take()`` returns, per step, the time from the
last launch (backward's last gradient) to the last finish. On CUDA both ends are CUDA events
on the streams the work ran on, read at ``take()``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


def timing_event() -> Any:
    """A CUDA event recorded now on the current stream (read it with ``elapsed_time``)."""
    event: Any = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    event.record()
    return event


class ReductionTimer:
    """Launch and finish times of the current step's bucket reductions (thread-safe: gloo
    finishes them on its own threads)."""

    def __init__(self, cuda: bool = False) -> None:
        self.cuda = cuda
        self._lock = threading.Lock()
        self._launched: list[Any] = []  # perf_counter seconds, or CUDA events
        self._finished: list[Any] = []

    def _now(self) -> Any:
        return timing_event() if self.cuda else time.perf_counter()

    def launched(self) -> None:
        mark = self._now()
        with self._lock:
            self._launched.append(mark)

    def finished(self) -> None:
        mark = self._now()
        with self._lock:
            self._finished.append(mark)

    def take(self) -> tuple[float, int]:
        """(exposed seconds, buckets) of the reductions since the last call; (0.0, 0) when the
        step reduced nothing (a micro-batch inside an accumulation window)."""
        with self._lock:
            launched, self._launched = self._launched, []
            finished, self._finished = self._finished, []
        if not launched or not finished:
            return 0.0, 0
        if self.cuda:
            for event in finished:  # each on the stream its reduction ran on
                event.synchronize()
            last_launch = launched[-1]
            exposed = max(last_launch.elapsed_time(done) for done in finished) / 1000.0
        else:
            exposed = max(finished) - max(launched)
        return max(exposed, 0.0), len(launched)

    def hook(self, group: dist.ProcessGroup | None, bucket: Any) -> Any:
        """A DDP communication hook: DDP's own all-reduce (average over ``group``), timed."""
        self.launched()

        def done(future: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            self.finished()
            return future.value()

        return default_hooks.allreduce_hook(group, bucket).then(done)  # type: ignore[arg-type]


__all__ = ["ReductionTimer", "timing_event"]
