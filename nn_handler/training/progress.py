"""The rank-0 progress bar (tqdm); every other rank, a disabled bar, or a stderr that is not a
terminal (a pipe, a log file, a SLURM output file) does nothing: there the bar's carriage
returns would run into the epoch summaries."""

from __future__ import annotations

import sys
import time

from tqdm.auto import tqdm

from nn_handler.log import is_terminal
from nn_handler.training.metrics import RunningLoss


class ProgressBar:
    """One epoch's bar: ``update()`` per batch, ``show(**values)`` for the postfix."""

    def __init__(self, enabled: bool, total: int | None, description: str) -> None:
        self._bar = (
            tqdm(total=total, desc=description, leave=False, dynamic_ncols=True, file=sys.stderr)
            if enabled and is_terminal(sys.stderr)
            else None
        )

    @property
    def active(self) -> bool:
        """Whether a bar is shown (rank 0, enabled, stderr a terminal)."""
        return self._bar is not None

    def update(self, n: int = 1) -> None:
        if self._bar is not None and n:
            self._bar.update(n)

    def show(self, **values: float) -> None:
        if self._bar is not None:
            self._bar.set_postfix({k: f"{v:.4g}" for k, v in values.items()}, refresh=True)

    def show_running(self, running: RunningLoss, started: float) -> None:
        """The epoch's running loss, samples/s and extra scalars (this rank's: a host sync,
        only for a shown bar)."""
        if self._bar is not None:
            elapsed = time.perf_counter() - started
            values = running.extras.local_means()
            self.show(loss=running.local_mean(), samples_s=running.samples / elapsed, **values)

    def after_batch(
        self, index: int, first: int, log_step: bool, running: RunningLoss, started: float
    ) -> None:
        """After batch ``index``: one more, and the running values from the epoch's first
        batch on (a short epoch too), then every log step and at the epoch's end."""
        if self._bar is None:
            return
        self._bar.update(1)
        if index == first or index + 1 == self._bar.total or log_step:
            self.show_running(running, started)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


__all__ = ["ProgressBar"]
